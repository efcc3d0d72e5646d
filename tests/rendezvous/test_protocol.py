"""The rendezvous protocol with real threads on the in-memory store.

Each "node" is a thread running `Rendezvous`; short timeouts keep these fast. The randomized
test asserts the protocol's invariant: no two nodes ever see different memberships for the
same round.
"""

import random
import threading
import time
from dataclasses import replace

import pytest
from counting_store import CountingStore

from meshrun.rendezvous import (
    JobFailed,
    JobFinished,
    MemoryStore,
    NodeDesc,
    Rendezvous,
    RendezvousSettings,
    RendezvousTimeoutError,
)
from meshrun.rendezvous.api import RendezvousError

pytestmark = pytest.mark.timeout(60)


def settings(min_nodes, max_nodes, **kw):
    kw.setdefault("last_call_timeout", 0.1)
    kw.setdefault("join_timeout", 10.0)
    kw.setdefault("keep_alive_interval", 0.05)
    kw.setdefault("keep_alive_max_attempt", 4)
    return RendezvousSettings(run_id="job", min_nodes=min_nodes, max_nodes=max_nodes, **kw)


def make_node(store, s, name, nproc=1, hint=None):
    me = NodeDesc(node_id=name, addr="127.0.0.1", nproc=nproc, node_rank_hint=hint)
    return Rendezvous(store, s, me, host_bootstrap=lambda: ("127.0.0.1", 4000))


def run_all(fns):
    """Run callables on threads; return their results (or exceptions) in order."""
    results = [None] * len(fns)

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            results[i] = e

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_max_nodes_close_at_once_with_contiguous_ranks():
    store, s = MemoryStore(), settings(2, 3)
    nodes = [make_node(store, s, f"n{i}", nproc=i + 1) for i in range(3)]
    infos = run_all([n.next_round for n in nodes])
    assert {i.node_rank for i in infos} == {0, 1, 2}
    assert len({i.nodes for i in infos}) == 1  # one membership
    assert all(i.world_size == 6 for i in infos)  # heterogeneous nproc: 1 + 2 + 3
    offsets = sorted((i.rank_offset, i.local_world_size) for i in infos)
    assert [o for o, _ in offsets] == [0, offsets[0][1], offsets[0][1] + offsets[1][1]]
    assert all((i.master_addr, i.master_port) == ("127.0.0.1", 4000) for i in infos)
    for n in nodes:
        n.close()


def test_min_nodes_close_after_last_call():
    store, s = MemoryStore(), settings(1, 4, last_call_timeout=0.3)
    node = make_node(store, s, "solo")
    start = time.monotonic()
    info = node.next_round()
    assert info.num_nodes == 1 and 0.3 <= time.monotonic() - start < 3
    node.close()


def test_join_timeout_when_fewer_than_min():
    store, s = MemoryStore(), settings(2, 2, join_timeout=0.3)
    node = make_node(store, s, "lonely")
    with pytest.raises(RendezvousTimeoutError, match="fewer than the minimum 2"):
        node.next_round()
    node.close()


def test_node_rank_hints_are_honoured():
    store, s = MemoryStore(), settings(3, 3)
    nodes = [make_node(store, s, f"n{i}", hint=2 - i) for i in range(3)]
    infos = run_all([n.next_round for n in nodes])
    assert [i.node_rank for i in infos] == [2, 1, 0]
    for n in nodes:
        n.close()


def test_failure_spends_the_shared_budget_once_per_round():
    store, s = MemoryStore(), settings(2, 2, max_restarts=1)
    a, b = make_node(store, s, "a"), make_node(store, s, "b")
    run_all([a.next_round, b.next_round])
    # both nodes see a failure in the same round: one restart is spent, not two
    run_all([lambda: a.request_restart("x", failure=True), lambda: b.request_restart("y", failure=True)])
    infos = run_all([a.next_round, b.next_round])
    assert [i.round for i in infos] == [1, 1] and [i.restart_count for i in infos] == [1, 1]
    # the next failure exhausts the budget: the job fails, and the other node hears of it
    with pytest.raises(JobFailed):
        a.request_restart("again", failure=True)
    with pytest.raises(JobFailed):
        b.poll()
    a.close()
    b.close()


def test_a_later_publish_adds_ranks_and_keeps_first_records():
    """The agent publishes the first failures at once and, after stopping its group, every
    rank that failed before the stop: the report gets the late ranks, a rank's first record
    stays."""
    store, s = MemoryStore(), settings(1, 1)
    node = make_node(store, s, "solo")
    round_ = node.next_round().round
    node.publish_failures([{"global_rank": 1, "exitcode": 6, "traceback": ""}])
    node.publish_failures([{"global_rank": 1, "exitcode": 6, "traceback": "more lines"},
                           {"global_rank": 0, "exitcode": 5, "traceback": "boom"}])
    assert node.collect_failures(round_) == [
        {"global_rank": 1, "exitcode": 6, "traceback": ""},
        {"global_rank": 0, "exitcode": 5, "traceback": "boom"},
    ]
    node.close()


def test_scale_up_a_waiting_node_triggers_a_new_round():
    store, s = MemoryStore(), settings(1, 2)
    a = make_node(store, s, "a")
    assert a.next_round().num_nodes == 1
    b = make_node(store, s, "b")
    joined = run_all([b.next_round, lambda: _restart_on_poll(a)])
    info_b, info_a = joined
    assert info_a.round == info_b.round == 1
    assert info_a.nodes == info_b.nodes and info_a.node_rank == 0  # the old member keeps rank 0
    assert info_a.restart_count == 0  # a membership change spends nothing
    a.close()
    b.close()


def _restart_on_poll(node):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        reason = node.poll()
        if reason is not None:
            assert "waiting" in reason
            return node.next_round()
        time.sleep(0.02)
    raise AssertionError("no restart")


def test_scale_down_lost_node_detected_and_survivor_continues():
    store, s = MemoryStore(), settings(1, 2)
    a, b = make_node(store, s, "a"), make_node(store, s, "b")
    run_all([a.next_round, b.next_round])
    b.close()  # b dies: it stops beating
    start = time.monotonic()
    reason = None
    while reason is None and time.monotonic() - start < 5:
        reason = a.poll()
        time.sleep(0.02)
    assert reason is not None and "lost" in reason
    assert time.monotonic() - start < s.dead_after + 1
    info = a.next_round()
    assert info.num_nodes == 1 and info.restart_count == 0
    a.close()


def test_spare_waits_then_exits_when_the_job_succeeds():
    store, s = MemoryStore(), settings(1, 2)
    a, b, c = (make_node(store, s, n) for n in "abc")
    infos = run_all([a.next_round, b.next_round])
    assert {i.num_nodes for i in infos} == {2}
    spare_result = []
    t = threading.Thread(target=lambda: spare_result.append(_catch(c.next_round)), daemon=True)
    t.start()
    time.sleep(0.3)
    assert a.poll() is None  # the round is full: a spare does not restart it
    run_all([lambda: a.exit_barrier(0.05), lambda: b.exit_barrier(0.05)])
    t.join(10)
    assert isinstance(spare_result[0], JobFinished)
    for n in (a, b, c):
        n.close()


def test_a_job_finished_elsewhere_is_a_reason_to_leave_never_an_exception():
    """A member still running when the job was marked succeeded (it was stopped, its round was
    moved on without it, and the others finished): every call of the running round says so as
    a reason; only `next_round` raises `JobFinished` (which the agent catches: exit 0)."""
    store, s = MemoryStore(), settings(2, 2)
    a, b = make_node(store, s, "a"), make_node(store, s, "b")
    run_all([a.next_round, b.next_round])
    state, version = a.read_state()
    finished = replace(state, status="succeeded", reason="job finished")
    assert store.compare_and_set("/meshrun/job/state", version, finished.to_json())[0]
    reason = b.poll()
    assert reason is not None and "finished" in reason
    reason = b.request_restart("worker failure on b", failure=True)
    assert "finished" in reason
    assert b.read_state()[0] == finished  # nothing spent, nothing changed
    assert b.exit_barrier(0.05) is None
    with pytest.raises(JobFinished):
        b.next_round()
    for n in (a, b):
        n.close()


def _catch(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize("seed", range(20))
def test_random_orders_never_split_a_round(seed):
    """Random join delays, deaths and restarts: every round has exactly one membership."""
    rng = random.Random(seed)
    store = MemoryStore()
    n_nodes = rng.randint(2, 6)
    s = settings(rng.randint(1, 2), rng.randint(2, 4), last_call_timeout=rng.choice([0.02, 0.1]),
                 join_timeout=3.0, max_restarts=3)
    seen: dict[int, set] = {}
    lock = threading.Lock()

    def life(i):
        node = make_node(store, s, f"n{i}", hint=rng.choice([None, i]))
        time.sleep(rng.random() * 0.2)
        try:
            for _ in range(3):
                info = node.next_round()
                with lock:
                    seen.setdefault(info.round, set()).add(tuple(d.node_id for d in info.nodes))
                action = rng.random()
                if action < 0.2:
                    return  # dies without a word (heartbeats stop at close)
                if action < 0.5:
                    node.request_restart("random failure", failure=True)
                else:  # run a while; finish (exit barrier) unless the round moves on
                    deadline = time.monotonic() + rng.random()
                    while time.monotonic() < deadline and node.poll() is None:
                        time.sleep(0.01)
                    if node.poll() is None and node.exit_barrier(0.02) is None:
                        return
        except (JobFailed, JobFinished, RendezvousTimeoutError):
            pass
        finally:
            node.close()

    run_all([lambda i=i: life(i) for i in range(n_nodes)])
    assert seen, "no round completed"
    for round_, memberships in seen.items():
        assert len(memberships) == 1, f"round {round_} split: {memberships}"


@pytest.mark.timeout(120)
def test_store_operations_per_node_do_not_grow_with_n():
    """O(1) store operations per agent per round: join, wait, close, read, polls, barrier.

    Keep-alives cost 2 operations per ``keep_alive_interval`` (a beat and one neighbour read)
    whatever N is; the interval is long here so that the count does not depend on how long
    256 threads take to be scheduled on 2 cores.
    """

    def ops_per_node(n):
        shared = MemoryStore()
        stores = [CountingStore(shared) for _ in range(n)]
        s = settings(n, n, keep_alive_interval=60.0)
        nodes = [make_node(st, s, f"n{i}") for i, st in enumerate(stores)]
        infos = run_all([nd.next_round for nd in nodes])
        assert all(not isinstance(i, BaseException) for i in infos)
        for nd in nodes:  # a few monitor ticks, then the exit barrier
            for _ in range(3):
                nd.poll()
        run_all([lambda nd=nd: nd.exit_barrier(5.0) for nd in nodes])
        for nd in nodes:
            nd.close()
        return max(st.ops for st in stores)

    small, large = ops_per_node(8), ops_per_node(256)
    assert large <= small + 6, (small, large)


def _join_and_die(store, name, round_=0, min_nodes=2, max_nodes=2):
    """A node that joins (as `next_round` does), then dies (never beats, never closes)."""
    me = NodeDesc(name, "127.0.0.1", 1).to_json()
    seq = store.register(f"/meshrun/job/r{round_}/node/", name, me)
    if seq == min_nodes < max_nodes:
        store.set_once(f"/meshrun/job/r{round_}/quorum", b"1")


def test_others_close_the_round_when_the_designated_closer_died():
    """The node that drew the MAX-th number closes the round; if it died right after joining,
    the others step in after dead_after."""
    store, s = MemoryStore(), settings(2, 2)
    a = make_node(store, s, "a")
    result = []
    t = threading.Thread(target=lambda: result.append(a.next_round()), daemon=True)
    start = time.monotonic()
    t.start()
    while store.count("/meshrun/job/r0/node/") < 1:
        time.sleep(0.01)
    _join_and_die(store, "b")  # joins second = MAX: the designated closer
    t.join(10)
    assert [d.node_id for d in result[0].nodes] == ["a", "b"]
    assert s.dead_after <= time.monotonic() - start < s.dead_after + 5
    a.close()


def test_a_dead_node_rank_0_after_the_close_starts_a_new_round():
    """Node rank 0 died between the close and publishing the workers' store: the others see it
    lost and meet again without it, instead of failing the rendezvous."""
    store, s = MemoryStore(), settings(1, 2)
    _join_and_die(store, "dead", min_nodes=1)  # joins first: node rank 0
    a = make_node(store, s, "a")
    info = a.next_round()
    assert info.round == 1 and [d.node_id for d in info.nodes] == ["a"]
    assert info.restart_count == 0
    a.close()


class _HostedStore(MemoryStore):
    """A store hosted by one of the agents (as c10d's): it goes with its host."""

    outlives_agents = False


@pytest.mark.parametrize(("store_cls", "deleted"), [(MemoryStore, True), (_HostedStore, False)])
def test_only_a_store_that_outlives_the_agents_is_emptied_by_the_last_node_out(store_cls,
                                                                               deleted):
    """On etcd the last node out deletes the job's keys; on a store an agent hosts (c10d) a
    client must not: the host may still be reading them (it waits for the others to leave),
    and a deleted key read there crashed the host's agent."""
    store, s = store_cls(), settings(2, 2)
    a, b = make_node(store, s, "a"), make_node(store, s, "b")
    run_all([a.next_round, b.next_round])
    for n in (a, b):
        n.leave()
    left = [k for k in store._data if k.startswith("/meshrun/job/")]  # noqa: SLF001
    assert (not left) == deleted, left
    for n in (a, b):
        n.close()


@pytest.mark.parametrize("garbage", [b"not json{", b'{"round": 0, "extra": 1}', b"[1, 2]"])
def test_a_malformed_store_value_is_one_rendezvous_error_never_a_traceback(garbage):
    """Another program writes to the job's store (no auth on TCPStore): what the agents read
    back is checked; a bad value is a RendezvousError naming it (the agent: one line, exit 3),
    never a ValueError or TypeError from deep in the protocol (found by a breaker)."""
    store, s = MemoryStore(), settings(2, 2)
    a, b = make_node(store, s, "a"), make_node(store, s, "b")
    run_all([a.next_round, b.next_round])
    assert store.compare_and_set("/meshrun/job/state", 0, garbage)[0]
    with pytest.raises(RendezvousError, match="the job's state\\) is malformed"):
        b.poll()
    for n in (a, b):
        n.close()


def test_a_membership_round_trips_and_garbage_is_one_error():
    """A round's membership (its ``closed`` key) is stored compressed and column-wise; reading
    it back gives the same NodeDescs in the same order, for random memberships; anything else
    is one RendezvousError, never an exception from zlib or json (a breaker's list: garbage, a
    truncated value, trailing bytes, a value that inflates past the bound, deep nesting that
    overflows json's recursion, columns of the wrong type or length, no members, a node id
    twice; the old list of records names the version mismatch). More members than this
    node's MAX are not refused: the closer's MAX may differ, and all must agree."""
    import json
    import zlib

    from meshrun.rendezvous.api import decode_members, encode_members

    rng = random.Random(7)
    for _ in range(20):
        members = [NodeDesc(node_id=f"h{rng.randrange(10**6)}:{i}:{rng.getrandbits(32):08x}",
                            addr=rng.choice(["10.0.0.1", "::1", "node-7.example"]),
                            nproc=rng.randrange(1, 9),
                            node_rank_hint=rng.choice([None, i]), prev_rank=rng.choice([None, 3]))
                   for i in range(rng.randrange(1, 300))]
        assert decode_members(encode_members(members)) == members
    raw = encode_members(members)

    def packed(**changes):
        columns = {"node_id": ["a", "b"], "addr": ["x", "y"], "nproc": [1, 2],
                   "node_rank_hint": [None, 1], "prev_rank": [0, None]}
        columns.update(changes)
        return zlib.compress(json.dumps({k: v for k, v in columns.items() if v != "-"}).encode())

    assert len(decode_members(packed())) == 2  # the shape the cases below break
    bad = [b"", b"\x00\x01junk", raw[: len(raw) // 2], raw + b"trailing",
           zlib.compress(b"[" + b" " * (20 << 20) + b"]"), zlib.compress(b"[" * 200000),
           zlib.compress(b"not json{"), packed(node_id=[], addr=[], nproc=[], node_rank_hint=[],
                                               prev_rank=[]),
           packed(addr="-"), packed(node_id="ab"), packed(addr={"x": 1, "y": 2}),
           packed(nproc=["x", 1]), packed(nproc=[0, 1]), packed(nproc=[True, 1]),
           packed(prev_rank=[-1, None]), packed(node_id=[["a"], "b"]), packed(node_id=["a", "a"]),
           packed(addr=["x"])]
    for garbage in bad:
        with pytest.raises(RendezvousError, match="a round's members\\) is malformed"):
            decode_members(garbage)
    old = json.dumps([{"node_id": "a", "addr": "x", "nproc": 1, "node_rank_hint": None,
                       "prev_rank": None}]).encode()
    with pytest.raises(RendezvousError, match="another meshrun version.*same meshrun version"):
        decode_members(old)


def test_a_node_with_a_smaller_max_accepts_the_closers_membership():
    """Nodes started with different ``--nnodes`` MAX (a breaker's case): the node that closes
    decides the membership for all, and a member whose own MAX is smaller accepts it (a
    refusal made it exit 3 and the others restart the round without it)."""
    store = MemoryStore()
    # c (MAX 2) joins first, then a and b (MAX 3): by c's MAX the round is full at a, whose
    # place (2nd) closes it only by c's count, so c waits dead_after (long here) to step in;
    # b, the 3rd joiner, closes it with all three by its own MAX
    timing = {"last_call_timeout": 2.0, "keep_alive_interval": 0.5, "keep_alive_max_attempt": 10}
    wide, narrow = settings(1, 3, **timing), settings(1, 2, **timing)
    nodes = [make_node(store, narrow, "c"), make_node(store, wide, "a"),
             make_node(store, wide, "b")]

    def join(i):
        time.sleep(0.2 * i)  # c, a, then b
        return nodes[i].next_round()

    infos = run_all([lambda i=i: join(i) for i in range(3)])
    assert all(not isinstance(i, BaseException) for i in infos), infos
    assert {tuple(m.node_id for m in i.nodes) for i in infos} == {("c", "a", "b")}
    for n in nodes:
        n.close()


class _SlowQuorum(MemoryStore):
    """Writes a round's quorum key only after a pause, and records who waited for which key:
    the nodes woken by the quorum key then arrive well after node rank 0 read the close."""

    def __init__(self):
        super().__init__()
        self.waited: list[tuple[str, str]] = []  # (thread name, key)

    def set_once(self, key, value):
        if key.endswith("/quorum"):
            time.sleep(1.0)
        return super().set_once(key, value)

    def wait_for_change(self, key, version, timeout):
        self.waited.append((threading.current_thread().name, key))
        return super().wait_for_change(key, version, timeout)


def test_node_rank_0_publishes_the_master_before_the_others_look_for_it():
    """MIN = MAX: the first joiner (node rank 0 of a first round) waits for the close itself,
    not for the quorum key that wakes everyone, so the master address is in the store when
    the others read the membership: none of them waits for it (at a thousand nodes, a
    thousand watches and neighbour watches on node rank 0 saved)."""
    # long keep-alives: the others wait for the quorum key in pieces of dead_after, and a
    # piece must not end (and the close be read) before node rank 0 had its chance
    store, s = _SlowQuorum(), settings(4, 4, keep_alive_interval=1.0)
    nodes = [make_node(store, s, f"n{i}") for i in range(4)]
    results = [None] * 4

    def join(i):
        results[i] = nodes[i].next_round()

    first = threading.Thread(target=join, args=(0,), name="node-0", daemon=True)
    first.start()
    while store.count("/meshrun/job/r0/node/") < 1:
        time.sleep(0.01)  # n0 joins first
    others = [threading.Thread(target=join, args=(i,), name=f"node-{i}", daemon=True)
              for i in range(1, 4)]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join(20)
    assert results[0].node_rank == 0 and sorted(r.node_rank for r in results) == [0, 1, 2, 3]
    master_waits = {who for who, key in store.waited if key.endswith("/master")}
    assert master_waits == set(), master_waits
    for n in nodes:
        n.close()


@pytest.mark.parametrize(("hint", "prev", "seq", "likely"), [
    (None, None, 1, True),  # a first round's first joiner
    (None, None, 2, False),
    (0, None, 3, True),  # --node-rank 0
    (1, None, 1, False),
    (None, 0, 2, True),  # node rank 0 of the last round
    (None, 1, 1, False),
    (2, 0, 1, False),  # a hint wins over the last round's rank
])
def test_the_likely_node_rank_0_follows_the_order_of_assign_node_ranks(hint, prev, seq, likely):
    node = Rendezvous(MemoryStore(), settings(2, 2),
                      NodeDesc("x", "127.0.0.1", 1, node_rank_hint=hint, prev_rank=prev),
                      host_bootstrap=lambda: ("127.0.0.1", 4000))
    node._joined = (0, seq)
    assert node._likely_rank0() is likely
    node.close()
