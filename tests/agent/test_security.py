"""End to end: what meshrun keeps from others on the same machine (DESIGN.md §3.7).

Secrets meshrun reads (``PET_RDZV_CONF``, which may hold an etcd ``password=``; meshrun's own
``MESHRUN_*SECRET*``/``*PASSWORD*``/``*TOKEN*`` variables) never reach a worker's environment
or the log files; log directories are 0700 and log files 0600; a symlink planted in a shared
``--log-dir`` is refused, never followed; the stores of a job whose endpoint is 127.0.0.1
listen on 127.0.0.1 only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"
HOLD_ENV = str(SCRIPTS / "hold_env.py")
SECRET = "s3cr3t-hunter2-7f1d"


def _all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.mark.timeout(60)
def test_secrets_never_reach_the_workers_environment_or_logs(launch):
    """A password in PET_RDZV_CONF and a MESHRUN_*SECRET* variable: absent from a running
    worker's /proc/<pid>/environ and from every log file; the torchrun contract and the user's
    own variables are still there."""
    out, logs = launch.cwd / "out", launch.cwd / "logs"
    out.mkdir()
    env = {
        "PET_RDZV_CONF": f"join_timeout=30,user=alice,password={SECRET}",
        "MESHRUN_RDZV_SECRET": SECRET,
        "USER_VISIBLE": "kept",
    }
    proc = launch.start(
        ["--nproc-per-node", "2", "--log-dir", str(logs), "--tee", "3", HOLD_ENV, str(out)],
        env=env,
    )
    pids = launch.wait_for(
        lambda: [int(p.read_text()) for p in sorted(out.glob("pid_*"))] if len(
            list(out.glob("pid_*"))) == 2 else None,
        30, what="both workers' pids",
    )  # fmt: skip
    launch.extra_pids.update(pids)
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        names = {item.split(b"=", 1)[0] for item in environ.split(b"\0") if item}
        assert SECRET.encode() not in environ, f"worker {pid} holds the secret"
        assert b"PET_RDZV_CONF" not in names and b"MESHRUN_RDZV_SECRET" not in names
        assert {b"RANK", b"MASTER_ADDR", b"TORCHELASTIC_RUN_ID", b"USER_VISIBLE"} <= names
    (out / "stop").touch()
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    files = _all_files(logs)
    assert any(f.name == "stdout.log" for f in files), files
    for f in files:
        assert SECRET.encode() not in f.read_bytes(), f"{f} holds the secret"
    assert SECRET not in stdout and SECRET not in stderr
