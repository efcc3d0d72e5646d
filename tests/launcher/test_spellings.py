"""Option spellings as torchrun's argparse reads them: an unambiguous prefix of a long option is
the option (``--redirect=3``), an ambiguous one is one line naming the candidates and exit 2;
an unknown ``--logs-specs`` name is one line naming the known ones and exit 2, where torchrun
raises. Compared with torchrun's own parser (``torch.distributed.run.get_args_parser``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.launcher import build_config
from meshrun.launcher.options import make_command

run = pytest.importorskip("torch.distributed.run")
pytestmark = pytest.mark.timeout(60)

# argv (before train.py) -> torchrun's dest it sets
PREFIXES = {
    "--redirect=3": "redirects",
    "--redirect 3": "redirects",
    "--nproc-per 2": "nproc_per_node",
    "--nproc_per 2": "nproc_per_node",
    "--rdzv-c join_timeout=5": "rdzv_conf",
    "--rdzv-b c10d": "rdzv_backend",
    "--max-r 2": "max_restarts",
    "--master-p 29511": "master_port",
    "--local-ranks 0": "local_ranks_filter",
    "--monitor-i 0.5": "monitor_interval",
    "--standal": "standalone",
}


@pytest.mark.parametrize("given", list(PREFIXES))
def test_unambiguous_prefix_reads_as_torchrun(workdir, given):
    argv = [*given.split(), "train.py", "--redirect=9"]
    dest = PREFIXES[given]
    theirs = run.get_args_parser().parse_args(argv)
    ours = build_config(argv, {})
    expected = {
        "redirects": lambda c: int(c.redirects.default) == int(theirs.redirects),
        "nproc_per_node": lambda c: c.nproc_per_node == int(theirs.nproc_per_node),
        "rdzv_conf": lambda c: c.rdzv_conf == {"join_timeout": "5"} == dict(
            [theirs.rdzv_conf.split("=")]),
        "rdzv_backend": lambda c: c.rdzv_backend == theirs.rdzv_backend,
        "max_restarts": lambda c: c.max_restarts == theirs.max_restarts,
        "master_port": lambda c: c.master_port == theirs.master_port,
        "local_ranks_filter": lambda c: c.local_ranks_filter == {int(theirs.local_ranks_filter)},
        "monitor_interval": lambda c: c.monitor_interval == theirs.monitor_interval,
        "standalone": lambda c: c.standalone is theirs.standalone is True,
    }[dest]  # fmt: skip
    assert expected(ours), (given, ours)
    # what follows the script is the script's, prefix or not
    assert ours.args == ("--redirect=9",) and theirs.training_script_args == ["--redirect=9"]


def test_prefix_of_one_options_two_spellings(workdir):
    """``--nproc``: both spellings of one option start with it, so it is that option (Python
    3.11's argparse calls it ambiguous; meshrun does not make a user pick a spelling)."""
    assert build_config(["--nproc", "3", "train.py"], {}).nproc_per_node == 3


def test_ambiguous_prefix_is_one_line_naming_the_candidates(workdir, run_meshrun):
    proc = run_meshrun(["--master", "h", "train.py"], workdir)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrun: error: --master: ambiguous"), lines
    assert "--master-addr, --master-port" in lines[0], lines
    with pytest.raises(SystemExit) as e:  # torchrun refuses it too
        run.get_args_parser().parse_args(["--master", "h", "train.py"])
    assert e.value.code == 2
    proc = run_meshrun(["--rd", "x", "train.py"], workdir)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "could be --rdzv-backend, --rdzv-endpoint, --rdzv-id, --rdzv-conf;" in proc.stderr


def test_every_option_and_help_still_reads(workdir, run_meshrun):
    import click

    from meshrun.launcher.options import prefix_resolver

    command = make_command()

    params = command.get_params(click.Context(command))
    resolve = prefix_resolver(params)
    names = [o[2:] for p in params for o in getattr(p, "opts", []) if o.startswith("--")]
    assert {"help", "version", "config", "nproc-per-node", "nproc_per_node"} <= set(names)
    assert all(resolve(n) == n for n in names)
    assert resolve("m") == "m" and resolve("r") == "r"  # short options stay short
    for flag in ("--help", "--he"):
        proc = run_meshrun([flag], workdir)
        assert proc.returncode == 0 and "Usage: meshrun [OPTIONS] SCRIPT" in proc.stdout, flag
    assert build_config(["-r", "3", "-t", "1", "train.py"], {}).tee.default == 1


def test_unknown_logs_specs_is_one_line_naming_the_known(workdir: Path, run_meshrun):
    (workdir / "train.py").write_text("raise SystemExit('must not run')\n")
    proc = run_meshrun(["--logs-specs", "nosuch", "train.py"], workdir)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("meshrun: error: --logs-specs nosuch: no torchrun.logs_specs"), lines
    assert "installed: default" in lines[0], lines  # torch registers "default"
    with pytest.raises(ValueError, match="nosuch"):  # torchrun raises there
        run._get_logs_specs_class("nosuch")
    assert build_config(["--logs-specs", "default", "train.py"], {}).logs_specs == "default"
