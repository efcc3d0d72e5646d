"""meshrun's CLI accepts every option of torch 2.13's torchrun, with the same defaults and the
same PET_* environment fallbacks."""

from __future__ import annotations

import argparse
import sys

import pytest

from meshrun.launcher import build_config
from meshrun.launcher.options import BY_NAME, NUMA_MODES, OPTIONS, START_METHODS, make_command

run = pytest.importorskip("torch.distributed.run")
pytestmark = pytest.mark.timeout(60)

MESHRUN_OWN = {"hang_timeout", "desync_check", "log_line_prefix_template", "log_max_bytes", "raw_console",
               "print_completion"}  # the last: torchrun's own from 2.14 on
# Defaults that differ on purpose: None means "not given" and lets the rendezvous decide.
DIFFERENT_DEFAULT = {"node_rank"}


def _torch_options() -> list[argparse.Action]:
    return [
        a
        for a in run.get_args_parser()._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def test_every_torchrun_option_string_is_accepted():
    click_opts = {opt for p in make_command().params for opt in getattr(p, "opts", [])}
    torch_strings = {s for a in _torch_options() for s in a.option_strings}
    assert torch_strings - click_opts == set()
    ours = {s for spec in OPTIONS if spec.name not in MESHRUN_OWN for s in spec.flags}
    assert ours - torch_strings == set(), "an option torchrun does not have"


@pytest.mark.parametrize("action", _torch_options(), ids=lambda a: a.dest)
def test_defaults_and_env_fallbacks_match(action: argparse.Action):
    spec = BY_NAME[action.dest]
    assert set(spec.flags) == set(action.option_strings)
    if action.dest not in DIFFERENT_DEFAULT:
        theirs = action.default
        if isinstance(theirs, list):
            theirs = ",".join(theirs)
        if isinstance(theirs, (int, float)) and not isinstance(theirs, bool):
            theirs = str(theirs)
        if action.dest == "log_line_prefix_template":
            theirs = theirs or None  # torch 2.13: None; 2.14: "" (both: no template)
        assert spec.default == theirs
    reads_pet = type(action).__name__ in ("env", "check_env")
    if action.dest == "log_line_prefix_template":
        reads_pet = True  # torch 2.13 reads only TORCHELASTIC_...; 2.14 adds PET_...: meshrun both
    assert (f"PET_{action.dest.upper()}" in spec.env) == reads_pet
    assert spec.is_flag == (action.nargs == 0)
    if action.choices:
        assert tuple(action.choices) in (START_METHODS, NUMA_MODES, ("bash", "zsh", "tcsh"))


def test_same_reading_as_torchrun(workdir):
    argv = [
        "--nnodes", "1:3", "--nproc_per_node", "3", "--rdzv-backend", "c10d",
        "--rdzv_endpoint", "h:1", "--rdzv-id", "j", "--rdzv_conf", "join_timeout=5, read_timeout = 7",
        "--max_restarts", "2", "--monitor-interval", "0.5", "-r", "0:1,2:3", "--tee", "2",
        "--local_ranks_filter", "0,2", "--duplicate-stdout-filters", "a,,b,c",
        "--role", "trainer", "--master_addr", "10.0.0.1", "--log_dir", "L",
        "train.py", "--lr", "3e-4", "--nnodes", "5",
    ]  # fmt: skip
    ours = build_config(argv, {})
    theirs = run.get_args_parser().parse_args(argv)
    lo, hi = run.parse_min_max_nnodes(theirs.nnodes)
    assert (ours.min_nodes, ours.max_nodes) == (lo, hi)
    assert ours.nproc_per_node == int(theirs.nproc_per_node)
    assert ours.rdzv_backend == theirs.rdzv_backend
    assert ours.rdzv_endpoint == theirs.rdzv_endpoint
    assert ours.rdzv_id == theirs.rdzv_id
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    assert ours.rdzv_conf == _parse_rendezvous_config(theirs.rdzv_conf)
    assert ours.max_restarts == theirs.max_restarts
    assert ours.monitor_interval == theirs.monitor_interval
    from torch.distributed.elastic.multiprocessing import Std

    assert dict(ours.redirects.per_rank) == {k: int(v) for k, v in Std.from_str("0:1,2:3").items()}
    assert int(ours.tee.default) == int(Std.from_str(theirs.tee))
    assert ours.local_ranks_filter == {0, 2}
    assert list(ours.duplicate_stdout_filters) == theirs.duplicate_stdout_filters
    assert ours.role == theirs.role and ours.master_addr == theirs.master_addr
    assert ours.log_dir == theirs.log_dir
    assert ours.entrypoint == (sys.executable, "-u", theirs.training_script)
    assert list(ours.args) == theirs.training_script_args
