"""Bad secrets are one line and exit 2, before anything starts (DESIGN.md §3.4, §3.7): a
``secret=`` value on the command line, a missing, empty or loose secret file, an etcd
password over plain http without ``insecure=true``; for ``meshrun`` and ``meshrun status``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

SECRET = "do-not-print-this-secret-91c3"
C10D = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1"]
ETCD = ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:1"]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("open('started', 'w')\n")
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    (tmp_path / "loose").write_text(SECRET)
    (tmp_path / "loose").chmod(0o644)
    (tmp_path / "pw").write_text("etcd-pass-word")
    (tmp_path / "pw").chmod(0o600)
    return tmp_path


CASES = {
    "secret on the command line": (C10D, f"secret={SECRET}", {}, "secret_file=PATH"),
    "missing secret file": (C10D, "secret_file=nope", {}, "no such file"),
    "empty secret file": (C10D, "secret_file=empty", {}, "the secret is empty"),
    "loose secret file": (C10D, "secret_file=loose", {}, "chmod 600"),
    "empty secret variable": (C10D, "", {"MESHRUN_RDZV_SECRET": " "}, "the secret is empty"),
    "password over http": (ETCD, f"user=u,password={SECRET}", {}, "insecure=true"),
    "password file over http": (ETCD, "user=u,password_file=pw", {}, "insecure=true"),
    "password variable over http": (ETCD, "user=u", {"MESHRUN_ETCD_PASSWORD": SECRET},
                                    "insecure=true"),
    "missing password file": (ETCD, "user=u,password_file=nope,insecure=true", {},
                              "no such file"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_secret_is_one_line_exit_2(case: str, files: Path, run_meshrun):
    base, conf, env, problem = CASES[case]
    args = [*base, *(["--rdzv-conf", conf] if conf else []), "train.py"]
    proc = run_meshrun(args, files, **env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and problem in lines[0], proc.stderr
    assert lines[0].startswith("meshrun: error:")
    assert SECRET not in proc.stdout + proc.stderr
    assert not (files / "started").exists()


@pytest.mark.parametrize("case", ["missing secret file", "password over http"])
def test_status_refuses_the_same(case: str, files: Path, run_meshrun):
    base, conf, env, problem = CASES[case]
    backend = "etcd" if base is ETCD else "c10d"
    args = ["status", "--rdzv-backend", backend, "--rdzv-endpoint", "127.0.0.1:1",
            "--rdzv-id", "j", "--rdzv-conf", conf]  # fmt: skip
    proc = run_meshrun(args, files, **env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and problem in lines[0], proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
