"""`timeout_pause`: a failure whose report takes longer to build than the test's time left is
reported as itself, not hidden by pytest-timeout's alarm (issue: an INTERNALERROR once hid a
failing test under load). The same inner run without the plugin shows what it prevents."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

INNER = """\
import time
import pytest

class SlowToShow:
    def __repr__(self):
        time.sleep(1.0)  # formatting the failure outlasts the 0.5 s timeout
        return "SlowToShow()"

@pytest.mark.timeout(0.5)
def test_fails_slowly():
    time.sleep(0.2)
    raise ValueError(SlowToShow())

def test_after():
    pass
"""


def _inner_run(tmp_path: Path, *plugin: str) -> str:
    (tmp_path / "test_inner.py").write_text(INNER)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, "test_inner.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(Path(__file__).parent), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    return done.stdout + done.stderr


@pytest.mark.timeout(60)
def test_a_slowly_formatted_failure_is_reported_as_itself(tmp_path):
    without = _inner_run(tmp_path)
    assert "E       ValueError: SlowToShow()" not in without, without  # the alarm hid it
    with_plugin = _inner_run(tmp_path, "-p", "timeout_pause")
    assert "E       ValueError: SlowToShow()" in with_plugin, with_plugin
    assert "1 failed, 1 passed" in with_plugin and "INTERNALERROR" not in with_plugin
