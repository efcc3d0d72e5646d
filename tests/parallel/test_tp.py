"""meshrun.parallel tensor parallelism on a real 2-process gloo group: parity with one process.

One launch runs every check in workers/tp_checks.py (a launch costs seconds); each test here
reports one check: MLP and attention blocks and the full char LM with and without sequence
parallelism (outputs, input grads, gathered param grads, params after a step), the
vocab-parallel loss against F.cross_entropy, collective counts per layer, tied embeddings,
vocabulary padding and refusals, layouts, dropout random streams, and a Mesh as the group.
"""

import pytest
from harness import launch

CHECKS = ["check_mlp", "check_mlp_sp", "check_attention", "check_attention_sp",
          "check_char_lm", "check_char_lm_sp", "check_vocab_loss", "check_collective_counts",
          "check_tied", "check_refusals", "check_layouts", "check_dropout_rng", "check_mesh"]


@pytest.fixture(scope="module")
def results():
    return launch("tp_checks.py", nproc=2, timeout=170).results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", CHECKS)
def test_tp(results, check):
    for rank, result in enumerate(results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(200)
def test_every_check_reported(results):
    assert sorted(results[0]) == sorted(CHECKS)
