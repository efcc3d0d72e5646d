"""End to end: what meshrun keeps from others on the same machine (docs/design.md §3.7).

Secrets meshrun reads (``PET_RDZV_CONF``, which may hold an etcd ``password=``; meshrun's own
``MESHRUN_*SECRET*``/``*PASSWORD*``/``*TOKEN*`` variables) never reach a worker's environment
or the log files; log directories are 0700 and log files 0600; a symlink planted in a shared
``--log-dir`` is refused, never followed; the stores of a job whose endpoint is 127.0.0.1
listen on 127.0.0.1 only.
"""

from __future__ import annotations

from pathlib import Path

import psutil
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


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.lstat().st_mode & 0o7777 for p in root.rglob("*")}


@pytest.mark.timeout(60)
def test_log_directories_are_0700_and_files_0600(launch):
    """A run with --log-dir (created by meshrun), filters and --hang-timeout (its progress
    files): every directory meshrun made is 0700, every file it made 0600."""
    out, logs = launch.cwd / "out", launch.cwd / "logs"
    out.mkdir()
    (out / "stop").touch()  # the workers print their environment and exit at once
    done = launch.run(
        ["--nproc-per-node", "2", "--log-dir", str(logs), "--rdzv-id", "perm", "--tee", "3",
         "--duplicate-stdout-filters", "RANK", "--hang-timeout", "30", HOLD_ENV, str(out)],
        timeout=40,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert logs.stat().st_mode & 0o7777 == 0o700
    modes = _modes(logs)
    assert any(name.endswith("stdout.log") for name in modes), modes
    assert any(name.endswith("progress") for name in modes), modes
    wrong = {
        name: oct(mode) for name, mode in modes.items()
        if mode != (0o700 if (logs / name).is_dir() else 0o600)
    }  # fmt: skip
    assert not wrong, wrong


@pytest.mark.timeout(60)
def test_a_symlink_planted_in_a_shared_log_dir_is_refused(launch):
    """In a world-writable --log-dir, someone planted ``<log-dir>/<run id>`` as a symlink to a
    directory of theirs: meshrun says so in one line and exits 2 before starting anything;
    nothing is written through the link."""
    out, shared, planted = launch.cwd / "out", launch.cwd / "shared", launch.cwd / "planted"
    for d in (out, shared, planted):
        d.mkdir()
    (out / "stop").touch()
    shared.chmod(0o1777)
    (shared / "job7").symlink_to(planted)
    done = launch.run(
        ["--nproc-per-node", "1", "--log-dir", str(shared), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "job7", HOLD_ENV, str(out)],
        timeout=40,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "symlink" in errors[0], done.stderr
    assert str(shared / "job7") in errors[0]
    assert list(planted.iterdir()) == []
    assert not list(out.glob("pid_*"))  # no worker ran


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("conf", "expected"), [("", {"127.0.0.1"}), (",bind_all=true", {"::"})], ids=["bound", "all"]
)
def test_stores_listen_on_the_endpoint_address_unless_bind_all(launch, conf, expected):
    """A two-node c10d job on endpoint 127.0.0.1 (two agents here): while its workers run,
    every socket either agent listens on (the rendezvous store, the workers' store) is bound
    to 127.0.0.1, none to the wildcard; with --rdzv-conf bind_all=true (the opt-out) all are
    on the wildcard (dual-stack). The job finishes either way."""
    out = launch.cwd / "out"
    out.mkdir()
    port = launch.free_port()
    agents = [
        launch.start(
            ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bind", "--rdzv-conf",
             "last_call_timeout=0.5,join_timeout=30" + conf, "--monitor-interval", "0.1",
             HOLD_ENV, str(out), "--dist"],
        )  # fmt: skip
        for _ in range(2)
    ]
    launch.wait_for(lambda: len(list(out.glob("pid_*"))) == 2, 60, what="both workers")
    listening = {
        (c.laddr.ip, c.laddr.port)
        for a in agents
        for c in psutil.Process(a.pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    (out / "stop").touch()
    results = [a.communicate(timeout=30) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [err for _, err in results]
    assert port in {p for _, p in listening}, listening  # the rendezvous store
    assert len(listening) >= 2, listening  # and the workers' store
    assert {ip for ip, _ in listening} == expected, listening
