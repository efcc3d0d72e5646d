"""meshrun.parallel.cp (context parallelism) on real 2- and 4-process gloo groups.

Ring and Ulysses attention against full SDPA in one process (output, dq, dk, dv), causal and
not, zigzag and contiguous layouts, float32 and float64 (the ring's fused CPU blocks and its
matmul blocks), bf16; a cp group inside a dp x cp mesh and the flattened dp x cp group; the
example's CharLM under its parallelize_lm with --cp against the unsplit model (loss, gradients,
parameters, clip norm): cp x ddp, cp x fsdp, and on 4 ranks tp x cp (with and without sequence
parallelism), dp x cp, pp x cp; SDPA calls routed by context_parallel_attention; the layouts;
the refusals. One launch per world size runs every check in workers/cp_checks.py.
"""

import pytest
from harness import launch

CHECKS = ["check_ring_zigzag", "check_ring_contiguous", "check_ring_matmul_blocks",
          "check_ulysses_zigzag", "check_ulysses_contiguous", "check_bfloat16",
          "check_subgroup", "check_flat_group", "check_char_lm_ddp", "check_char_lm_fsdp",
          "check_char_lm_pp", "check_sdpa_routing", "check_layouts", "check_errors",
          "check_example_refusals"]


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def results(request):
    return launch("cp_checks.py", nproc=request.param, timeout=150).results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", CHECKS)
def test_cp(results, check):
    for rank, result in enumerate(results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(180)
def test_every_check_reported(results):
    assert sorted(results[0]) == sorted(CHECKS)
