"""The protocol's pure decisions, table-driven: closing a round, node ranks, the restart budget."""

import pytest

from meshrun.rendezvous.api import NodeDesc
from meshrun.rendezvous.protocol import (
    FAILED,
    RUNNING,
    JobState,
    assign_node_ranks,
    close_decision,
    next_state,
)

# (joined, min, max, now, last_call_at) -> members to close with (0 = keep waiting)
CLOSE_CASES = [
    (1, 2, 4, 0.0, None, 0),  # below MIN: wait
    (2, 2, 4, 0.0, 1.0, 0),  # MIN reached, last call not over
    (2, 2, 4, 1.0, 1.0, 2),  # last call over: close with everyone so far
    (3, 2, 4, 5.0, 1.0, 3),
    (4, 2, 4, 0.0, None, 4),  # MAX reached: close at once
    (6, 2, 4, 0.0, None, 4),  # more than MAX joined: the first MAX are members
    (1, 1, 1, 0.0, None, 1),  # a one-node job never waits
]


@pytest.mark.parametrize("joined,min_nodes,max_nodes,now,last_call_at,expected", CLOSE_CASES)
def test_close_decision(joined, min_nodes, max_nodes, now, last_call_at, expected):
    assert close_decision(joined, min_nodes, max_nodes, now, last_call_at) == expected


def node(name, hint=None, prev=None):
    return NodeDesc(node_id=name, addr="127.0.0.1", nproc=1, node_rank_hint=hint, prev_rank=prev)


RANK_CASES = [
    # join order -> node-rank order
    ([node("a"), node("b"), node("c")], ["a", "b", "c"]),  # newcomers: join order
    ([node("a", hint=1), node("b", hint=0)], ["b", "a"]),  # every hint given, 0..N-1: honoured
    ([node("a", hint=1), node("b")], ["a", "b"]),  # not every node gave one: join order
    ([node("a", hint=0), node("b", hint=0)], ["a", "b"]),  # duplicates: ignored
    ([node("a", hint=0), node("b", hint=2)], ["a", "b"]),  # not contiguous: ignored
    # survivors keep their relative order, newcomers follow in join order
    ([node("new1"), node("x", prev=2), node("y", prev=0), node("new2")], ["y", "x", "new1", "new2"]),
]


@pytest.mark.parametrize("joined,expected", RANK_CASES)
def test_assign_node_ranks(joined, expected):
    assert [d.node_id for d in assign_node_ranks(joined)] == expected


def test_membership_change_spends_nothing():
    state = JobState(round=3, restarts=1)
    assert next_state(state, failure=False, reason="x", max_restarts=1) == JobState(4, 1, RUNNING, "x")


def test_failure_spends_one_restart_then_fails_the_job():
    state = JobState(round=0, restarts=0)
    state = next_state(state, failure=True, reason="boom", max_restarts=2)
    assert (state.round, state.restarts, state.status) == (1, 1, RUNNING)
    state = next_state(state, failure=True, reason="boom", max_restarts=2)
    assert (state.round, state.restarts, state.status) == (2, 2, RUNNING)
    state = next_state(state, failure=True, reason="boom", max_restarts=2)
    assert (state.round, state.restarts, state.status) == (2, 2, FAILED)
