"""A rendezvous host name that does not resolve is said at once: one line naming the host and
the resolver's answer, exit 3, instead of a connect that waits out its timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
@pytest.mark.parametrize("host", ["no-such-host.invalid", "a" * 300])  # idna: label too long
def test_a_name_that_does_not_resolve_is_one_line_at_once(tmp_path, backend, host):
    script = tmp_path / "noop.py"
    script.write_text("print('never runs')\n")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "meshrun", "--nnodes", "2", "--rdzv-backend", backend,
         "--rdzv-endpoint", f"{host}:29500", "--rdzv-id", "x",
         "--rdzv-conf", "join_timeout=30,read_timeout=20", str(script)],
        capture_output=True, text=True, timeout=50, cwd=REPO,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert done.returncode == 3, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot resolve" in lines[0], done.stderr
    assert f"'{host}'" in lines[0] and "never runs" not in done.stdout
    assert elapsed < 15, elapsed  # far below read_timeout=20 (a liveness bound, not a timing)
