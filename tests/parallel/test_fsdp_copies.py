"""Neighbour copies of fully sharded state (meshrun.parallel.fsdp.copies): seeded trials on 4
gloo processes posing as 2 nodes (workers/fsdp_copies.py, one launch). A node is lost and a
fresh process joins; the new world of 3 restores from the copies, shards again and trains
on; its final parameters must be those of one process that trained every step on the whole
batch. The loop end to end (agents, kill -9) is tests/faults/test_elastic_in_place.py."""

import pytest
from harness import launch


@pytest.fixture(scope="module")
def trials():
    result = launch("fsdp_copies.py", nproc=4, timeout=150)
    assert result.results and all(r.get("trials") for r in result.results), result.output
    return result.results


@pytest.mark.timeout(180)
def test_a_lost_node_is_restored_from_its_neighbours_copies(trials):
    for rank in (0, 1, 3):  # rank 2's node was lost
        for t in trials[rank]["trials"]:
            if t["every"] == 0:
                continue
            assert t["covered"], t
            # the state of the last refresh: the steps since are trained again
            assert t["step"] == t["expect_step"] and t["position"] == 12 * t["step"], t
            # then trained on: the reference's parameters (bf16: reductions round in bf16)
            assert t["max_diff"] < (1e-2 if t["extra"] == "bf16" else 1e-5), t
            assert t.get("restore_exact", True), t  # a restore is bit for bit what was trained
            shards = 2 if t["hsdp"] else 4
            assert f"from memory (the rows of the old world's {shards} shards" in t["used"], t


@pytest.mark.timeout(180)
def test_without_copies_the_restore_says_it_is_not_covered(trials):
    for rank in (0, 1, 3):
        (t,) = [t for t in trials[rank]["trials"] if t["every"] == 0]
        assert not t["covered"] and "no rank holds copies of the shards" in t["why"], t
        assert t["full_shapes"], t  # for a checkpoint's load


@pytest.mark.timeout(180)
def test_a_factored_optimizer_state_is_refused_with_a_message(trials):
    for rank in (0, 1, 2, 3):
        assert "a factored moment, as Adafactor's" in trials[rank]["adafactor"], trials[rank]


@pytest.mark.timeout(180)
def test_the_trials_cover_optimizers_frozen_layers_and_exchanges_in_flight(trials):
    ts = trials[0]["trials"]
    assert {t["optim"] for t in ts} == {"adamw", "sgd"}, ts
    assert any(t["frozen"] is not None for t in ts), ts
    assert any(t["every"] and t["step"] < t["lost_at"] for t in ts), ts  # steps trained again
    assert any(t["every"] and not t["settled"] and not t["hsdp"] for t in ts), ts  # mid-exchange
    # the exchange complete on one survivor and not on the other: a refresh that dropped the
    # previous generation as soon as its own exchange completed would leave nothing in common
    partly = [t for t in ts if t["partly"] and t["every"] and t["lost_at"] % t["every"] == 0]
    assert partly and all(t["covered"] for t in partly), ts
    assert sum(t["hsdp"] for t in ts) == 3, ts
    # mixed dtypes, an LR scheduler, a parameter under two keys, a join's snapshot: each
    # restored bit for bit at least once
    assert {t["extra"] for t in ts if t.get("restore_exact")} >= {"bf16", "sched", "shared",
                                                                    "join"}, ts
    assert any(t["extra"] == "to_ddp" and t["covered"] for t in ts), ts  # whole, trained on
