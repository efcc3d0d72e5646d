"""The ``meshrun`` command as a user meets it: real subprocesses for bad input (exit 2, one
stderr line, nothing written), --help, --version; in-process for dispatch to the agent and to
subcommands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from meshrun.launcher import cli
from meshrun.launcher.subcommands import SUBCOMMANDS

pytestmark = pytest.mark.timeout(60)

BAD_INPUTS = {
    "no arguments": [],
    "unknown flag": ["--bogus", "train.py"],
    "misspelt flag": ["--nnodse", "2", "train.py"],  # --nnode is a prefix: --nnodes
    "ambiguous prefix": ["--master", "h", "train.py"],
    "unknown logs-specs": ["--logs-specs", "nosuch", "train.py"],
    "flag without value": ["--nnodes"],
    "value for a flag": ["--standalone=1", "train.py"],
    "nnodes 0": ["--nnodes", "0", "train.py"],
    "nnodes 3:2": ["--nnodes", "3:2", "train.py"],
    "nproc garbage": ["--nproc-per-node", "lots", "train.py"],
    "nproc gpu without gpus": ["--nproc-per-node", "gpu", "train.py"],
    "missing script": ["--nproc-per-node", "2", "missing.py", "--lr", "1"],
    "missing run-path script": ["--run-path", "missing.py"],
    "missing no-python command": ["--no-python", "./no-such-program"],
    "no-python command not on PATH": ["--no-python", "no-such-program-xyz"],
    "missing config": ["--config", "missing.toml", "train.py"],
    "unreadable config": ["--config", ".", "train.py"],
    "invalid toml": ["--config", "broken.toml", "train.py"],
    "unknown config key": ["--config", "unknown_key.toml", "train.py"],
    "malformed rdzv-conf": ["--rdzv-conf", "join_timeout", "train.py"],
    "rdzv-conf key with two letters swapped": ["--rdzv-conf", "uesr=me", "train.py"],
    "unknown backend": ["--rdzv-backend", "zk", "train.py"],
    "bad redirects": ["-r", "9", "train.py"],
    "bad signal": ["--signals-to-handle", "SIGNOPE", "train.py"],
    "module with no-python": ["-m", "--no-python", "pkg"],
    "unknown rdzv-conf key": ["--rdzv-conf", "jion_timeout=5", "train.py"],
    "workers_port out of range": ["--rdzv-conf", "workers_port=70000", "train.py"],
    "c10d without endpoint": ["--rdzv-backend", "c10d", "--nnodes", "2", "train.py"],
    "elastic range on static": ["--nnodes", "1:2", "train.py"],
    "malformed ipv6 endpoint": ["--rdzv-backend", "c10d", "--nnodes", "2",
                                "--rdzv-endpoint", "[::1:29400", "train.py"],
    "etcd cert without key": ["--rdzv-backend", "etcd", "--nnodes", "2", "--rdzv-endpoint",
                              "127.0.0.1:2379", "--rdzv-conf", "cert=c.pem", "train.py"],
    # bad input that used to start work (issue 17)
    "rdzv-id with a slash": ["--rdzv-id", "a/b", "train.py"],
    "rdzv-id climbing out of the log dir": ["--rdzv-id", "..", "--standalone", "train.py"],
    "rdzv-id too long": ["--rdzv-id", "x" * 200, "train.py"],
    "log-dir naming a file": ["--log-dir", "train.py", "train.py"],
    "SIGCHLD as a stop signal": ["--signals-to-handle", "SIGTERM,SIGCHLD", "train.py"],
    "nproc that brings the machine down": ["--nproc-per-node", "100000", "train.py"],
    "multi-node c10d on port 0": ["--rdzv-backend", "c10d", "--nnodes", "1:2",
                                  "--rdzv-endpoint", "127.0.0.1:0", "train.py"],
    "multi-node etcd on port 0": ["--rdzv-backend", "etcd", "--nnodes", "2",
                                  "--rdzv-endpoint", "127.0.0.1:0", "train.py"],
    "shutdown-timeout overflow": ["--shutdown-timeout", "1e10", "train.py"],
    "monitor-interval busy loop": ["--monitor-interval", "1e-9", "train.py"],
    "config from /dev/zero": ["--config", "/dev/zero", "train.py"],
    "config of 2 MiB": ["--config", "huge.toml", "train.py"],
    "local-ranks-filter naming no rank": ["--nproc-per-node", "2", "--local-ranks-filter", "5",
                                          "train.py"],
}


@pytest.fixture
def cwd(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    (tmp_path / "broken.toml").write_text("nnodes = [\n")
    (tmp_path / "unknown_key.toml").write_text("nproc_per_nodes = 2\n")
    (tmp_path / "huge.toml").write_text("# padding\n" * 200_000 + "nnodes = 1\n")
    return tmp_path


@pytest.mark.parametrize("args", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_and_exit_2(cwd: Path, args: list[str], run_meshrun):
    before = sorted(p.name for p in cwd.iterdir())
    proc = run_meshrun(args, cwd, CUDA_VISIBLE_DEVICES="", PATH=os.defpath)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("meshrun: error: "), proc.stderr
    assert proc.stdout == ""
    assert sorted(p.name for p in cwd.iterdir()) == before


def test_bad_pet_value_is_one_line(cwd: Path, run_meshrun):
    proc = run_meshrun(["train.py"], cwd, PET_NNODES="3:2")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "meshrun: error: PET_NNODES=3:2: MIN must not exceed MAX (got MIN=3, MAX=2); "
        "give N or MIN:MAX with 1 <= MIN <= MAX"
    ]


def test_help_and_version(cwd: Path, run_meshrun):
    for flag in ("--help", "-h"):
        proc = run_meshrun([flag], cwd)
        assert proc.returncode == 0 and "Usage: meshrun [OPTIONS] SCRIPT [ARGS]..." in proc.stdout
        assert "--nproc-per-node" in proc.stdout and "Rendezvous" in proc.stdout
    proc = run_meshrun(["--version"], cwd)
    assert proc.returncode == 0 and proc.stdout.strip() == "meshrun, version 0.1.0"


def test_parsing_does_not_import_torch(cwd: Path, meshrun_env):
    code = (
        "import sys, os\n"
        "from meshrun.launcher import build_config\n"
        "c = build_config(['--nproc-per-node', 'auto', '--nnodes', '1:2', '--rdzv-backend', 'c10d',"
        " '--rdzv-endpoint', '127.0.0.1:29400', 'train.py'], os.environ)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(c.nproc_per_node)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=meshrun_env(), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


# -- in-process: main() hands the config to the agent, or to a subcommand --------------------


@pytest.mark.timeout(60)
def test_main_runs_the_agent_and_exits_with_its_code(workdir, meshrun_env):
    script = workdir / "train.py"
    script.write_text(
        "import os, sys\n"
        "ok = sys.argv[1:] == ['--lr', '1', '--nnodes', '5'] and os.environ['WORLD_SIZE'] == '2'\n"
        "sys.exit(7 if ok else 1)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "meshrun", "--nproc-per-node", "2", "train.py",
         "--lr", "1", "--nnodes", "5"],
        cwd=workdir, env=meshrun_env(), capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert proc.returncode == 7, proc.stderr


@pytest.mark.timeout(60)
def test_subcommand_dispatch_and_existing_file_wins(workdir, monkeypatch, capsys):
    @click.command()
    @click.option("--job", required=True)
    def probe(job: str) -> int:
        return 5

    monkeypatch.setitem(SUBCOMMANDS, "probe", probe)
    with pytest.raises(SystemExit) as info:
        cli.main(["probe", "--job", "j"])
    assert info.value.code == 5

    with pytest.raises(SystemExit) as info:
        cli.main(["probe", "--nope"])
    assert info.value.code == 2
    assert len(capsys.readouterr().err.splitlines()) == 1

    # a file named like the subcommand is the script, run by the real agent
    (workdir / "probe").write_text("import sys\nsys.exit(7 if sys.argv[1:] == ['--job', 'j'] else 1)\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["probe", "--job", "j"])
    assert info.value.code == 7


SECRET = "hunter2-do-not-print"


@pytest.mark.parametrize("source", ["flag", "PET_RDZV_CONF", "config file"])
def test_a_password_never_reaches_an_error_line(cwd: Path, source: str, run_meshrun):
    """A bad --rdzv-conf beside a password: the error quotes the value, with the password
    shown as *** (flag, PET_* variable and TOML table alike)."""
    conf = f"user=u,password={SECRET},join_timeout=soon"
    base = ["--rdzv-backend", "etcd", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:2379"]
    env = {}
    if source == "flag":
        args = [*base, "--rdzv-conf", conf, "train.py"]
    elif source == "PET_RDZV_CONF":
        args, env = [*base, "train.py"], {"PET_RDZV_CONF": conf}
    else:
        (cwd / "job.toml").write_text(
            f'[rdzv_conf]\nuser = "u"\npassword = "{SECRET}"\njoin_timeout = "soon"\n')
        args = [*base, "--config", "job.toml", "train.py"]
    proc = run_meshrun(args, cwd, **env)
    assert proc.returncode == 2 and "join_timeout=soon" in proc.stderr, proc.stderr
    assert SECRET not in proc.stderr + proc.stdout and "***" in proc.stderr, proc.stderr


@pytest.mark.parametrize("conf", [f"auth_token={SECRET},join_timout=5", f"secrets={SECRET}",
                                  f"etcd_password={SECRET},x=,y"])  # fmt: skip
def test_a_secret_under_another_key_name_never_reaches_an_error_line(cwd: Path, conf: str,
                                                                      run_meshrun):  # fmt: skip
    """Keys with a secret's word in their name (auth_token, etcd_password, a typo such as
    secrets) were quoted in the error line with their values in clear."""
    proc = run_meshrun(["--rdzv-conf", conf, "train.py"], cwd)
    assert proc.returncode == 2, proc.stderr
    assert SECRET not in proc.stderr + proc.stdout and "***" in proc.stderr, proc.stderr


def test_print_completion_as_torchrun_214(tmp_path, run_meshrun):
    done = run_meshrun(["--print-completion", "bash"], tmp_path)
    assert done.returncode == 0 and "_MESHRUN_COMPLETE" in done.stdout, done.stderr
    bad = run_meshrun(["--print-completion", "tcsh"], tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
