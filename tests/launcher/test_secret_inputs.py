"""Bad secrets are one line and exit 2, before anything starts (docs/design.md §3.4, §3.7): a
``secret=`` value on the command line, a missing, empty or loose secret file, an etcd
password over plain http without ``insecure=true``; for ``meshrun`` and ``meshrun status``."""

from __future__ import annotations

import os
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
    os.mkfifo(tmp_path / "fifo")  # opening it for reading would wait for a writer forever
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
    "password file is a FIFO": (ETCD, "user=u,password_file=fifo,insecure=true", {},
                                "not a regular file"),
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


@pytest.mark.parametrize("where", ["flag", "PET_RDZV_CONF", "config file"])
def test_password_with_a_comma_is_not_shown(where: str, files: Path, run_meshrun):
    """``password=`` cannot hold a comma (entries are split on commas): the error line names
    the fix and shows no part of the password, also the part after the comma."""
    head, tail = SECRET[:12], SECRET[12:]
    conf = f"user=u,password={head},{tail},insecure=true"
    args, env = [*ETCD], {}
    if where == "flag":
        args += ["--rdzv-conf", conf]
    elif where == "PET_RDZV_CONF":
        env["PET_RDZV_CONF"] = conf
    else:
        (files / "c.toml").write_text(f'rdzv_conf = "{conf}"\n')
        args += ["--config", "c.toml"]
    proc = run_meshrun([*args, "train.py"], files, **env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "password_file" in lines[0], proc.stderr
    assert head not in proc.stderr and tail not in proc.stderr, proc.stderr
    assert not (files / "started").exists()


def test_non_utf8_secret_variable_is_used(files: Path):
    """A ``MESHRUN_RDZV_SECRET`` that is not UTF-8 is its bytes (as a file's would be), not an
    encoding error."""
    from meshrun.rendezvous.auth import load_secret

    raw = b"\xff\xfe" + SECRET.encode()
    assert load_secret({}, {"MESHRUN_RDZV_SECRET": os.fsdecode(raw)}) == raw


def test_https_in_the_etcd_endpoint_is_https():
    """``--rdzv-endpoint https://HOST:PORT`` is TLS, not plain http with its scheme dropped
    (a password would then be refused as plain http, and without one it would go in clear)."""
    from meshrun.rendezvous.etcd import EtcdOptions

    assert EtcdOptions.from_conf("https://h:2379", {"user": "u"}, 5.0).protocol == "https"
    assert EtcdOptions.from_conf("https://h:2379,https://g", {}, 5.0).protocol == "https"
    assert EtcdOptions.from_conf("h:2379", {}, 5.0).protocol == "http"
    for endpoint, conf in (("http://h,https://g", {}), ("https://h", {"protocol": "http"})):
        with pytest.raises(ValueError, match="disagree"):
            EtcdOptions.from_conf(endpoint, conf, 5.0)
