"""torch.compile(block.forward, fullgraph=True, backend="aot_eager") per block under ddp,
fully_shard, parallelize and in pipeline stages (1F1B, ZB-H1): equal to eager, one graph per
block (workers/compile_checks.py, one 2-rank launch)."""

import pytest
from harness import launch

CHECKS = ["check_compile_ddp", "check_compile_fully_shard", "check_compile_parallelize",
           "check_compile_pipeline_1f1b", "check_compile_pipeline_zbh1"]


@pytest.fixture(scope="module")
def results():
    return launch("compile_checks.py", nproc=2, timeout=150).results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", CHECKS)
def test_compile(results, check):
    for rank, result in enumerate(results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(180)
def test_every_check_reported(results):
    assert sorted(results[0]) == sorted(CHECKS)
