"""A checkpoint save that hangs is reported by --hang-timeout: save and load count as progress
(`busy`) only for their bound (`checkpoint.busy_bound`: ``busy_timeout=``, else
MESHRUN_CHECKPOINT_TIMEOUT, else torch's default process-group timeout), so a save stuck on
one rank is a hang within the bound plus --hang-timeout. Real runs: 2 ranks, gloo, meshrun."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest

from meshrun.parallel import checkpoint

WORKER = Path(__file__).parent / "workers" / "checkpoint_hang.py"
BOUND_S, HANG_S = 4.0, 3.0  # the worker's busy_timeout (and the variable's), --hang-timeout


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["arg", "env"])
def test_a_save_hung_on_one_rank_is_reported_within_bound_plus_hang_timeout(launch, tmp_path,
                                                                             how):
    env = {checkpoint.BUSY_TIMEOUT_ENV: str(BOUND_S)} if how == "env" else {}
    args = ["--nproc-per-node", "2", "--hang-timeout", str(HANG_S), "--shutdown-timeout", "2",
            str(WORKER), str(tmp_path), how]
    result = launch.run(args, env=env, timeout=120)  # no bound: never reported, runs past this
    ended = time.time()
    assert result.returncode == 124, result.stderr
    assert "no progress" in result.stderr and "saved" not in result.stdout, result.stderr
    saving = float(re.search(r"rank 0 saving at ([0-9.]+)", result.stdout).group(1))
    took = ended - saving
    # the beats carried the save through its bound; then the hang was found (liveness limit
    # generous on a loaded machine: stacks and the stop come after it)
    assert BOUND_S + HANG_S - 0.5 <= took <= BOUND_S + HANG_S + 60, (took, result.stderr)


def test_the_bound_by_argument_variable_and_default(monkeypatch):
    monkeypatch.delenv(checkpoint.BUSY_TIMEOUT_ENV, raising=False)
    assert checkpoint.busy_bound() == checkpoint.DEFAULT_BUSY_TIMEOUT_S == 1800.0
    assert checkpoint.busy_bound(5) == 5.0 and checkpoint.busy_bound(math.inf) == math.inf
    monkeypatch.setenv(checkpoint.BUSY_TIMEOUT_ENV, "90")
    assert checkpoint.busy_bound() == 90.0 and checkpoint.busy_bound(7) == 7.0
    monkeypatch.setenv(checkpoint.BUSY_TIMEOUT_ENV, "inf")
    assert checkpoint.busy_bound() == math.inf
    for bad in ("soon", "0", "-3", "nan"):
        monkeypatch.setenv(checkpoint.BUSY_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match="MESHRUN_CHECKPOINT_TIMEOUT must be seconds > 0"):
            checkpoint.busy_bound()
    with pytest.raises(ValueError, match="busy_timeout must be seconds > 0"):
        checkpoint.busy_bound(0)
