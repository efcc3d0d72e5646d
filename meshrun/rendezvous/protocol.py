"""The rendezvous protocol: who is in each round, in what order, and when to start another.

Written once against the store contract (`meshrun.rendezvous.store.Store`); the in-memory,
TCPStore and etcd stores all run this same code.

Keys, under ``/meshrun/<run_id>/``::

    state                   the job's state: {round, restarts, status, reason}; changed only by
                            compare-and-set, so every node agrees on the round and on how many
                            restarts the job has spent (docs/design.md §3.2)
    r<T>/node/              register: the NodeDescs of round T's joiners, in join order
    r<T>/quorum             written once by the MIN-th joiner (the others wait for it); with
                            MIN = MAX by the closer, once it closed the round
    r<T>/closed             written once: the members of round T, in node-rank order
                            (`encode_members`: compressed columns)
    r<T>/master             "host:port" of the workers' bootstrap store (node rank 0 writes it)
    r<T>/done/, alldone     the exit barrier (a register of the members whose workers succeeded)
    r<T>/succeeded/<node_id>  written once by a member whose workers all succeeded, before it
                            waits in the exit barrier: if it is lost then, its part is done and
                            the others do not restart the round for it
    r<T>/failure/<rank>     each node's worker failures, for the job-wide root cause
    r<T>/desync/<rank>      each node's digest of its ranks' collectives, with --desync-check
                            (`meshrun.agent.desync`; node rank 0 reads them)
    r<T>/reported/, allreported, r<T>/left/   registers: who reported, who left
    swept                   the last round whose keys were deleted
    liveness/<node_id>      heartbeats (etcd: lease-bound keys)

Every count is a *register* (`Store.register`): a node creates its own entry, named by its
node id, and its position is the order of creation. Registering twice counts once, so a request
that the store applied but whose reply was lost (and was retried) never makes a phantom joiner
or a phantom ``done``.

A round T is *open* while ``state.round == T`` and ``r<T>/closed`` is absent. Joining is one
register; a node then waits for the quorum key (one wait), waits out the last call (one wait)
and reads the membership (one get). One node closes the round -- the one at position MAX, or
after the last call the first to have joined -- by reading the first entries and writing the
membership once (one compare-and-set); the others step in only if it has not closed within
dead_after. The closer decides the membership and node ranks for everybody, in one write-once
key, so no two nodes can ever see different memberships for the same round.

While a round runs, each member does two reads per monitor tick (the state, and the count of
the next round's register: nodes waiting there mean scale-up), and a heartbeat thread beats
and watches one neighbour on a ring (node rank r watches r+1 mod N), so dead-node detection
costs O(1) per node whatever N is. Any member that sees a reason to restart (a local worker
failure, a lost neighbour, waiting nodes) moves ``state`` to the next round with one
compare-and-set; the others notice on their next tick. A failure also spends one restart of the
job's budget -- once per round, however many nodes saw failures in it.

The diagnostics cost a bounded number of operations per node too: a ``meshrun stacks``
request is seen by a `KeyWatch` of ``stacks/request`` (`watch_stacks_requests`: a watch on
etcd, a blocking wait on TCPStore, on a thread and a client of its own; one wait and one
read per `WATCH_PIECE_S` while no request comes), and step times are one write per node per
``publish_interval`` (`meshrun.agent.step_times`), which grows with the node count.

Old rounds' keys are deleted by node rank 0 of round T, on its first monitor tick: every round
up to T-2 not deleted yet (``swept`` remembers how far). No node needs them by then: every
member of T has left them, a spare waits on T's keys, a node that fell behind (stopped, cut
off) learns from ``state`` that its round is over. A job that ended leaves nothing on etcd
(the last node out deletes the prefix).

A job that succeeded is `JobFinished` only where a node waits to join (`next_round`); to a node
whose round is still running (it fell behind while the others finished) `poll` and
`request_restart` give it as a reason to leave the round, so it stops its workers and learns in
`next_round` that the job is over.

Node ranks (documented in the README): when every member gave ``--node-rank`` and the values are
exactly 0..N-1, they are used; otherwise members of the previous round keep their relative
order and newcomers follow in join order.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from meshrun.rendezvous.api import (
    JobFailed,
    JobFinished,
    NodeDesc,
    RendezvousError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousTimeoutError,
    StoreLostError,
    decode_json,
    decode_members,
    encode_members,
)
from meshrun.rendezvous.restarts import Cause, Restart, cause_of, joining, node_lost
from meshrun.rendezvous.store import KeyWatch, Store, Versioned

log = logging.getLogger("meshrun.rendezvous")

# Long waits are cut into pieces of this many seconds, so a lost store is noticed even where a
# blocked wait would not see it.
_IDLE_WAIT = 5.0

RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"


@dataclass(frozen=True)
class JobState:
    """The job-wide state record (key ``state``)."""

    round: int = 0
    restarts: int = 0
    status: str = RUNNING
    reason: str = ""
    #: why the last round ended (`Cause`'s value; "" before the first restart), and its
    #: facts: the lost node's id, the number of nodes waiting to join
    cause: str = ""
    node: str = ""
    joining: int = 0

    def restart(self) -> Restart:
        """The restart that ended the previous round, as a node that was not told learns it."""
        cause = Cause(self.cause) if self.cause in _CAUSES else Cause.MOVED_ON
        text = self.reason or f"round {self.round} started"
        return Restart(text, cause, node=self.node, joining=self.joining)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> JobState:
        return decode_json(raw, "the job's state", lambda d: cls(**d))


# -- pure decisions (table-tested with a fake clock in tests/rendezvous) ---------------------


def assign_node_ranks(joined: list[NodeDesc]) -> list[NodeDesc]:
    """Order the members of a round (given in join order) by node rank.

    ``--node-rank`` hints are used when every member gave one and they are exactly 0..N-1;
    otherwise members of an earlier round keep their relative order (by ``prev_rank``) and
    newcomers follow in join order.
    """
    hints = [d.node_rank_hint for d in joined]
    if all(h is not None for h in hints) and sorted(hints) == list(range(len(joined))):
        return sorted(joined, key=lambda d: d.node_rank_hint)
    order = {d.node_id: i for i, d in enumerate(joined)}
    return sorted(
        joined,
        key=lambda d: (d.prev_rank is None, d.prev_rank or 0, order[d.node_id]),
    )


def close_decision(
    joined: int, min_nodes: int, max_nodes: int, now: float, last_call_at: float | None
) -> int:
    """How many members to close a round with now (0: not yet).

    A round closes at once when MAX nodes have joined, or with everyone joined so far (at most
    MAX) once MIN have joined and the last call (``last_call_at``, an absolute time) has passed.
    """
    if joined >= max_nodes:
        return max_nodes
    if joined >= min_nodes and last_call_at is not None and now >= last_call_at:
        return joined
    return 0


def next_state(state: JobState, *, failure: bool, reason: str, max_restarts: int) -> JobState:
    """The state after a member asks for a restart of ``state.round``.

    A failure spends one restart, or fails the job when the budget (``max_restarts``) is spent;
    a membership change starts the next round for free.
    """
    if not failure:
        return replace(state, round=state.round + 1, reason=reason)
    if state.restarts >= max_restarts:
        return replace(state, status=FAILED, reason=reason)
    return replace(state, round=state.round + 1, restarts=state.restarts + 1, reason=reason)


def _finished(state: JobState) -> Restart:
    """The reason a node whose round still runs leaves it: the job succeeded without it."""
    return Restart(
        f"the job finished on the other nodes ({state.reason or 'succeeded'})", Cause.FINISHED
    )


_CAUSES = frozenset(c.value for c in Cause)


# -- keys (the layout in the module docstring) --------------------------------------------------
# ``prefix`` is the job's, `job_prefix`; ``meshrun status`` and ``meshrun stacks`` read the same
# keys the agents write.


def job_prefix(run_id: str) -> str:
    """The prefix of every key of the job ``run_id``: ``/meshrun/<run_id>/``."""
    return f"/meshrun/{run_id}/"


def state_key(prefix: str) -> str:
    """The job's state (`JobState`)."""
    return prefix + "state"


def round_key(prefix: str, round: int, *parts: object) -> str:
    """``r<round>/<parts>``: a key of round ``round`` (``r<round>`` itself without parts)."""
    return prefix + "/".join(str(p) for p in (f"r{round}", *parts))


def nodes_key(prefix: str, round: int) -> str:
    """The register of round ``round``'s joiners (a prefix: one entry per node)."""
    return round_key(prefix, round, "node") + "/"


def closed_key(prefix: str, round: int) -> str:
    """Round ``round``'s members, in node-rank order, written once when it closes."""
    return round_key(prefix, round, "closed")


def steps_key(prefix: str, round: int, node_rank: int) -> str:
    """Node ``node_rank``'s recent step times in round ``round`` (the straggler check's)."""
    return round_key(prefix, round, "steps", node_rank)


def stacks_request_key(prefix: str) -> str:
    """Where ``meshrun stacks`` asks a job for its ranks' stacks: ``{"id": ..., "round": N}``
    (``prefix`` is the job's, ``/meshrun/<run id>/``)."""
    return f"{prefix}stacks/request"


def stacks_answers_prefix(prefix: str, request_id: str) -> str:
    """The answers to stacks request ``request_id`` (deleted together once read)."""
    return f"{prefix}stacks/{request_id}/"


def stacks_answer_key(prefix: str, request_id: str, node_rank: int) -> str:
    """Where node ``node_rank`` answers stacks request ``request_id``."""
    return f"{stacks_answers_prefix(prefix, request_id)}{node_rank}"


# -- the protocol -----------------------------------------------------------------------------


class Rendezvous:
    """One agent's side of the protocol.

    The agent calls `next_round` to join (blocking until a round with this node completes),
    `poll` once per monitor tick while workers run, `request_restart` when its workers fail,
    `exit_barrier` when they succeed, and `close` at the end.

    Args:
        store: the shared store (see `meshrun.rendezvous.store`).
        settings: timeouts and node counts.
        me: this node (``prev_rank`` is filled in by the protocol from round to round).
        host_bootstrap: called on the node of rank 0 after each round closes; starts the
            workers' bootstrap store and returns its ``(addr, port)``.
        clock: a monotonic clock in seconds (a fake one in tests).
    Raises (from its methods): `RendezvousTimeoutError`, `StoreLostError`, `JobFinished`,
        `JobFailed`.
    """

    def __init__(
        self,
        store: Store,
        settings: RendezvousSettings,
        me: NodeDesc,
        host_bootstrap: Callable[[], tuple[str, int]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store = store
        self.settings = settings
        self.me = me
        self._host_bootstrap = host_bootstrap
        self._clock = clock
        self._prefix = job_prefix(settings.run_id)
        self._joined: tuple[int, int] | None = None  # (round, position) we registered in
        self._spare_noted = -1
        self._watched_round = -1  # the running round a waiting node watches a member of
        self._swept = -1  # the last round whose keys this node knows to be deleted
        self._state_seen = 0  # the latest version of the job state this node read
        self.info: RendezvousInfo | None = None
        self._heartbeat = _Heartbeat(store, me.node_id, settings)
        self._stacks_watch: KeyWatch | None = None  # `watch_stacks_requests`
        self._steps_written = (-1, 0)  # (round, version) of this node's last step times

    # -- keys --------------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return self._prefix + "/".join(str(p) for p in parts)

    def _round_key(self, round: int, *parts: object) -> str:
        return round_key(self._prefix, round, *parts)

    def _nodes(self, round: int) -> str:
        """The register of round ``round``'s joiners."""
        return nodes_key(self._prefix, round)

    def _sweep(self, through: int) -> None:
        """Delete the keys of every round up to ``through`` not deleted yet (see the module
        docstring); a few store operations, once per round, on node rank 0."""
        if through < 0 or through <= self._swept:
            return
        key = self._key("swept")
        item = self.store.get(key)
        start = int(item.value) + 1 if item is not None else 0
        for round in range(start, through + 1):
            self.store.delete_prefix(self._round_key(round) + "/")
        if through >= start:
            self.store.compare_and_set(key, item.version if item else 0, str(through).encode())
        self._swept = through

    # -- state -------------------------------------------------------------------------------
    def read_state(self) -> tuple[JobState, int]:
        """The job state and its version (0 before anyone wrote it)."""
        return self._state_of(self.store.get(state_key(self._prefix)))

    def _state_of(self, item: Versioned | None) -> tuple[JobState, int]:
        """The job state read as ``item`` and its version; remembers the latest version read
        (where `finished_without_this_node` looks back from)."""
        if item is None:
            return JobState(), 0
        self._state_seen = max(self._state_seen, item.version)
        return JobState.from_json(item.value), item.version

    def finished_without_this_node(self) -> str | None:
        """The reason the job succeeded, when its keys vanished from a store that outlives the
        agents because the others finished without this node (it was out of the last round:
        stopping its workers took longer than the round took); None when the store cannot
        tell (no history, compacted) or the job did not succeed. Read from the store's
        history of the job state (`Store.last_value`) since the version this node last read.
        """
        raw = self.store.last_value(state_key(self._prefix), self._state_seen)
        if raw is None:
            return None
        try:
            state = JobState.from_json(raw)
        except RendezvousError:
            return None
        return state.reason if state.status == SUCCEEDED else None

    @staticmethod
    def _raise_if_ended(state: JobState) -> None:
        if state.status == SUCCEEDED:
            raise JobFinished(state.reason)
        if state.status == FAILED:
            raise JobFailed(state.round, state.reason)

    # -- joining -----------------------------------------------------------------------------
    def next_round(self) -> RendezvousInfo:
        """Join the next round and block until it completes with this node as a member.

        Spares (nodes beyond MAX) wait here until a later round has room. Raises
        `RendezvousTimeoutError` when fewer than MIN nodes join within ``join_timeout`` of
        the round opening, `JobFinished` when the job ended with success while waiting.
        """
        self._heartbeat.start()
        s = self.settings
        while True:
            self._heartbeat.check()
            # one read for the state and the round we expect it to be in (the next one)
            guess = self.info.round + 1 if self.info is not None else 0
            (state, version), closed, _ = self._read_round(guess, with_master=False)
            self._raise_if_ended(state)
            target = state.round
            if target != guess:
                closed = self.store.get(self._round_key(target, "closed"))
            if closed is not None:
                target += 1  # that round is running without us: queue for the next one
            known: tuple[JobState, int] | None = None
            if self._joined is None or self._joined[0] != target:
                seq = self.store.register(self._nodes(target), self.me.node_id, self.me.to_json())
                # the quorum key starts the others' last call; with MIN = MAX there is none,
                # and the MAX-th joiner writes it once it closed the round (see _try_close)
                if seq == s.min_nodes and s.min_nodes < s.max_nodes:
                    self.store.set_once(self._round_key(target, "quorum"), b"1")
                self._joined = (target, seq)
                if closed is None:
                    known = (state, version)  # read just now: the first pass need not read
            members = self._wait_for_close(target, known)
            if members is None:
                continue  # the job moved past that round meanwhile
            members, state, master = members
            if any(m.node_id == self.me.node_id for m in members):
                info = self._complete(target, members, state, master)
                if info is not None:
                    return info
                continue
            if self._spare_noted != target:
                self._spare_noted = target
                log.warning(
                    "meshrun: round %d is full (%d nodes, MAX=%d); this node waits as a spare",
                    target, len(members), self.settings.max_nodes,
                )

    def _read_round(
        self, round: int, with_master: bool = True
    ) -> tuple[tuple[JobState, int], Versioned | None, Versioned | None]:
        """The job state with its version, and round ``round``'s ``closed`` and (unless not
        ``with_master``) ``master`` keys: one read (node rank 0 has mostly published the
        master address by the time the others see the close: `_likely_rank0`)."""
        keys = [state_key(self._prefix), self._round_key(round, "closed")]
        item, closed, *master = self.store.get_many(
            keys + [self._round_key(round, "master")] if with_master else keys)
        return self._state_of(item), closed, master[0] if master else None

    def _wait_for_close(
        self, target: int, known: tuple[JobState, int] | None = None
    ) -> tuple[list[NodeDesc], JobState, Versioned | None] | None:
        """Wait until round ``target`` is closed (closing it ourselves when it is time); returns
        its members, the job state read with them and the master key when it was read with
        them, or None when the job moved past it without us (join the current round instead).
        ``known``: the state this node read just before joining, when ``closed`` was absent
        then (the first pass reads nothing)."""
        s = self.settings
        closed_key = self._round_key(target, "closed")
        deadline: float | None = None
        last_call_at: float | None = None
        step_in_at: float | None = None
        state = known[0] if known is not None else JobState()

        def members(item: Versioned, master: Versioned | None = None):
            return decode_members(item.value), state, master

        while True:
            if known is not None:
                (state, version), known = known, None
                joined = self._joined[1]  # at least this many have joined: no count needed
            else:
                (state, version), closed, master = self._read_round(target)
                if closed is not None:
                    return members(closed, master)
                joined = None
            self._raise_if_ended(state)
            if state.round > target:
                return None
            if state.round < target:
                # A round runs; we wait for it to end (no join timeout while a job runs), and
                # watch one of its members: if every member died, only we can tell.
                self._watch_running_round(state.round)
                lost = self._heartbeat.lost_neighbour
                if lost is not None:
                    self.request_restart(node_lost(lost), round=state.round)
                    continue
                self.store.wait_for_change(
                    state_key(self._prefix), version, min(_IDLE_WAIT, s.keep_alive_interval)
                )
                self._heartbeat.check()
                continue
            now = self._clock()
            if deadline is None:
                deadline = now + s.join_timeout
            if joined is None:
                joined = self.store.count(self._nodes(target))
            if joined >= s.min_nodes and last_call_at is None:
                last_call_at = now + (s.first_last_call_timeout if target == 0
                                      else s.last_call_timeout)  # fmt: skip
            count = close_decision(joined, s.min_nodes, s.max_nodes, now, last_call_at)
            if count:
                # One node closes the round (it reads the joiners: O(N)); the others wait for it,
                # and step in only when it has not closed within dead_after (it may have died).
                if self._is_closer(joined, count) or (step_in_at is not None and now >= step_in_at):
                    if not self._try_close(target, count, joined, last_call_at):
                        # counted entries that fail the secret's check: wait for real joiners,
                        # within the join timeout still (a forger, or a node with another
                        # secret, must not keep this node waiting for ever)
                        if now >= deadline:
                            raise RendezvousTimeoutError(
                                f"join timeout: round {target} counted {joined} joiner(s), but "
                                "fewer carry the job's secret (a node started with a different "
                                "secret, or another program writing to the store), within "
                                f"join_timeout={s.join_timeout:g} s; give every node the same "
                                "secret_file or MESHRUN_RDZV_SECRET"
                            )
                        self.store.wait_for_change(closed_key, 0, s.keep_alive_interval)
                    continue
                step_in_at = step_in_at or now + s.dead_after
                closed = self.store.wait_for_change(closed_key, 0, max(0.0, step_in_at - now))
                if closed is not None:
                    return members(closed)
                continue
            if now >= deadline:
                raise RendezvousTimeoutError(
                    f"join timeout: {joined} node(s) joined round {target}, fewer than the "
                    f"minimum {s.min_nodes}, within join_timeout={s.join_timeout:g} s; start more "
                    "nodes, lower MIN in --nnodes, or raise --rdzv-conf join_timeout"
                )
            if joined < s.min_nodes:
                # one wait: for the quorum key (or the deadline). MIN = MAX: the closer writes
                # it once it closed (a small value to a thousand watchers; the membership is
                # read after it, not pushed to all at once: 1.5 s slower at 1024 nodes); in
                # pieces of dead_after, so a closer that died after joining is found by counting
                wait_key = self._round_key(target, "quorum")
                until = deadline if s.min_nodes < s.max_nodes else min(deadline, now + s.dead_after)
                if s.min_nodes == s.max_nodes and self._likely_rank0():
                    # the node that will host the workers' store waits for the membership
                    # itself: it publishes the master address before the others read the
                    # membership, so they find it there instead of each watching for it
                    wait_key = closed_key
            else:
                wait_key, until = closed_key, min(last_call_at, deadline)
            item = self.store.wait_for_change(wait_key, 0, min(_IDLE_WAIT, max(0.0, until - now)))
            if item is not None and wait_key == closed_key:
                return members(item)
            self._heartbeat.check()

    def _is_closer(self, joined: int, count: int) -> bool:
        """The node that closes a round: the MAX-th to join, or, at the end of the last call,
        the first to have joined."""
        seq = self._joined[1]
        return seq == count if joined >= self.settings.max_nodes else seq == 1

    def _likely_rank0(self) -> bool:
        """Whether this joiner will most likely be node rank 0 of the round it joined (the
        order of `assign_node_ranks`): ``--node-rank 0``, node rank 0 of the last round, or
        the first to join when it brings neither. A wrong guess costs time, never order."""
        me = self.me
        if me.node_rank_hint is not None or me.prev_rank is not None:
            return me.node_rank_hint == 0 or (me.node_rank_hint is None and me.prev_rank == 0)
        return self._joined[1] == 1

    def _watch_running_round(self, round: int) -> None:
        if self._watched_round == round:
            return
        closed = self.store.get(self._round_key(round, "closed"))
        if closed is not None:
            self._heartbeat.watch(decode_members(closed.value)[0].node_id)
            self._watched_round = round

    def _try_close(
        self, target: int, count: int, joined: int, last_call_at: float | None
    ) -> bool:
        """Close round ``target`` with the first ``count`` joiners (one compare-and-set).

        With a shared secret the store returns only authentic entries, so a count that a
        program without the secret moved (positions drawn for forged entries) can leave fewer
        than ``count``: then the entries after them are read too (up to ``joined``), and the
        round closes with the authentic ones only when they alone decide it (`close_decision`).
        Returns False when they do not yet (nothing written).
        """
        s = self.settings
        prefix = self._nodes(target)
        joiners = self.store.entries(prefix, count, s.read_timeout)
        if len(joiners) < count:
            if joined > count:
                joiners = self.store.entries(prefix, joined, s.read_timeout)
            count = close_decision(
                len(joiners), s.min_nodes, s.max_nodes, self._clock(), last_call_at
            )
            if not count:
                return False
            joiners = joiners[:count]
        members = assign_node_ranks([NodeDesc.from_json(raw) for raw in joiners])
        self.store.compare_and_set(self._round_key(target, "closed"), 0, encode_members(members))
        if self.settings.min_nodes == self.settings.max_nodes:  # wakes those who wait for it
            self.store.set_once(self._round_key(target, "quorum"), b"1")
        return True

    def _complete(
        self, target: int, members: list[NodeDesc], state: JobState,
        master: Versioned | None = None,
    ) -> RendezvousInfo | None:
        """This node's view of the closed round ``target`` (``state``: the job state read while
        the round was open: its restart count is the round's; ``master``: the master key when
        it was read with the membership); None when the round had to be abandoned (node rank
        0 died before publishing the workers' store)."""
        self._heartbeat.member()
        node_rank = next(i for i, m in enumerate(members) if m.node_id == self.me.node_id)
        master_key = self._round_key(target, "master")
        if node_rank == 0:
            addr, port = self._host_bootstrap()
            ours = f"{addr}:{port}".encode()
            stored = self.store.set_once(master_key, ours)
            if bytes(stored.value) != ours:  # only node rank 0 writes it: someone else did
                raise RendezvousError(
                    f"round {target}'s master address in the store is not this node's "
                    "(another program wrote it first, perhaps a value replayed from an earlier "
                    "run with the same --rdzv-id and secret); give each run its own --rdzv-id"
                )
        else:
            item = master or self._wait_for_master(target, members[0].node_id)
            if item is None:
                return None
            addr, _, port = item.value.decode(errors="replace").rpartition(":")
            if not addr or not port.isdigit() or not 0 < int(port) < 65536:
                raise RendezvousError(
                    f"a rendezvous value (the master address) is malformed: "
                    f"{bytes(item.value)[:60]!r}; another program is writing to the job's store")
        self.me = replace(self.me, prev_rank=node_rank)
        self._joined = None
        self.info = RendezvousInfo(
            run_id=self.settings.run_id,
            round=target,
            restart_count=state.restarts,
            node_rank=node_rank,
            nodes=tuple(members),
            master_addr=addr,
            master_port=int(port),
        )
        neighbour = members[(node_rank + 1) % len(members)]
        self._heartbeat.watch(neighbour.node_id if len(members) > 1 else None)
        return self.info

    def _wait_for_master(self, target: int, rank0: str):
        """Wait for node rank 0 to publish the workers' store; None if it died meanwhile (the
        round is then moved on, spending nothing) or another node moved the round on."""
        s = self.settings
        master_key = self._round_key(target, "master")
        item = self.store.get(master_key)  # mostly there already (see `_likely_rank0`)
        if item is not None:
            return item
        self._heartbeat.watch(rank0)
        deadline = self._clock() + s.read_timeout + s.dead_after
        while self._clock() < deadline:
            # pieces of dead_after: a lost node rank 0 cannot be told sooner, and a thousand
            # nodes waiting here must not poll the store every keep-alive interval
            item = self.store.wait_for_change(master_key, 0, s.dead_after)
            if item is not None:
                return item
            self._heartbeat.check()
            if self._heartbeat.lost_neighbour is not None:
                self.request_restart(node_lost(rank0), round=target)
                return None
            if self.read_state()[0].round != target:
                return None
        raise RendezvousError(
            f"round {target}: node rank 0 ({rank0}) did not publish the workers' store within "
            f"read_timeout={s.read_timeout:g} s"
        )

    # -- while workers run ---------------------------------------------------------------------
    def poll(self) -> Restart | None:
        """Check for a reason to leave the running round; called once per monitor tick.

        Returns the `Restart` (its text and its cause) when the group must restart into a new
        round (another node moved the round on, a node was lost, nodes wait to join), else
        None. Raises `JobFailed` when another node ended the job, `StoreLostError` when the
        store is gone.
        """
        info = self.info
        self._heartbeat.check()
        state, _ = self.read_state()
        if state.status == SUCCEEDED:
            return _finished(state)
        self._raise_if_ended(state)
        if state.round != info.round:
            return state.restart()
        lost = self._lost_member()
        if lost is not None:
            return self.request_restart(node_lost(lost))
        if info.node_rank == 0:
            self._sweep(info.round - 2)
        if info.num_nodes < self.settings.max_nodes:
            waiting = self.store.count(self._nodes(info.round + 1))
            if waiting > 0:
                return self.request_restart(joining(waiting))
        return None

    def request_restart(
        self, reason: str, *, failure: bool | None = None, round: int | None = None
    ) -> Restart:
        """Move the job past the current round (one compare-and-set; retried on races).

        With ``failure=True`` one restart of the job's budget is spent, or, when it is spent,
        the job is marked failed and `JobFailed` is raised. If another node already moved the
        round on, or the job already succeeded, nothing more is spent. Returns the reason of the
        restart. ``round`` defaults to the round this node is a member of (a waiting node names
        the running round). ``reason`` is a `Restart` (its cause decides ``failure`` when that is
        not given and is stored with the state, so every node learns it), or plain text.
        """
        round = self.info.round if round is None else round
        cause = cause_of(reason, failure=bool(failure))
        failure = cause.spent if failure is None else failure
        restart = Restart(str(reason), cause, node=getattr(reason, "node", ""),
                          joining=getattr(reason, "joining", 0))  # fmt: skip
        while True:
            state, version = self.read_state()
            if state.status == SUCCEEDED:
                return _finished(state)
            self._raise_if_ended(state)
            if state.round != round:
                return state.restart()
            new = next_state(
                state, failure=failure, reason=restart, max_restarts=self.settings.max_restarts
            )
            new = replace(new, reason=str(restart), cause=cause.value, node=restart.node,
                          joining=restart.joining)  # fmt: skip
            ok, _ = self.store.compare_and_set(state_key(self._prefix), version, new.to_json())
            if ok:
                self._raise_if_ended(new)
                return restart

    def stacks_request(self) -> str | None:
        """The id of the latest live-stacks request (``meshrun stacks``), or None. One read."""
        return self.stacks_request_id(self.store.get(stacks_request_key(self._prefix)))

    @staticmethod
    def stacks_request_id(item: Versioned | None) -> str | None:
        """The id in a value of the stacks request key (None: absent, or no id in it)."""
        if item is None:
            return None
        request = decode_json(item.value, "a stacks request")
        return request.get("id") if isinstance(request, dict) else None

    def watch_stacks_requests(self) -> KeyWatch:
        """A `KeyWatch` of the stacks request key on a store client of its own
        (`Store.watcher`: a watch on etcd, a blocking wait on TCPStore), started once and
        closed with this rendezvous: a request is seen when it is written, at a cost of one
        wait and one read per `WATCH_PIECE_S` while none comes (polling cost one read a second
        per node)."""
        if self._stacks_watch is None:
            self._stacks_watch = KeyWatch(
                self.store.watcher, stacks_request_key(self._prefix), shared=self.store
            ).start()
        return self._stacks_watch

    def publish_stacks(self, request_id: str, value: bytes) -> None:
        """Answer live-stacks request ``request_id`` with this node's ranks' stacks (opaque)."""
        key = stacks_answer_key(self._prefix, request_id, self.info.node_rank)
        self.store.set_once(key, value)

    def publish_step_times(self, value: bytes) -> None:
        """Publish this node's ranks' recent step times (an opaque value, for the straggler
        check and ``meshrun status``) for the current round; replaces its last value. One
        write (a compare-and-set on the version this node wrote last; a read first only
        where that failed, or on the round's first publication); only this node writes its
        key."""
        key = steps_key(self._prefix, self.info.round, self.info.node_rank)
        round, version = self._steps_written
        if round != self.info.round:
            current = self.store.get(key)
            version = current.version if current else 0
        ok, current = self.store.compare_and_set(key, version, value)
        if not ok:  # somebody else wrote it (or our last write's reply was lost): once more
            ok, current = self.store.compare_and_set(key, current.version if current else 0,
                                                     value)  # fmt: skip
        self._steps_written = (self.info.round, current.version) if ok and current else (-1, 0)

    def step_times(self, round: int | None = None) -> list[bytes]:
        """Every member's last published step times of ``round`` (default: this node's
        current round), one value per node that published; one read per member (and one of
        the round's members, for another round than this node's)."""
        round = self.info.round if round is None else round
        if self.info is not None and round == self.info.round:
            n = self.info.num_nodes
        else:
            closed = self.store.get(self._round_key(round, "closed"))
            n = len(decode_members(closed.value)) if closed is not None else 0
        keys = [steps_key(self._prefix, round, r) for r in range(n)]
        return [item.value for item in self._get_existing(keys)]

    def publish_failures(self, records: list[dict]) -> None:
        """Publish this node's worker failures of the current round (for the job report).

        Records are dicts with a ``global_rank``. A later call adds the ranks the earlier
        ones did not have (the agent publishes the first failures at once, and every rank that
        failed before its group was stopped when the job ends); a rank's first record stays.
        One store operation for the first call; only this node writes its key.
        """
        key = self._round_key(self.info.round, "failure", self.info.node_rank)
        stored, current = self.store.compare_and_set(key, 0, json.dumps(records).encode())
        if stored or current is None:
            return
        known = decode_json(current.value, "the failure records")
        ranks = {r["global_rank"] for r in known}
        new = [r for r in records if r["global_rank"] not in ranks]
        if new:
            self.store.compare_and_set(key, current.version, json.dumps(known + new).encode())

    def collect_failures(self, round: int) -> list[dict]:
        """Every member's published failures of ``round`` (the round the job failed in).

        A member of that round first counts itself as reported (after `publish_failures`) and
        waits, up to ``close_timeout``, for every member to do the same; a node that was not a
        member (a spare) only reads what is there.
        """
        closed = self.store.get(self._round_key(round, "closed"))
        n = len(decode_members(closed.value)) if closed is not None else 0
        if self.info is not None and self.info.round == round:
            reported = self._round_key(round, "reported") + "/"
            if self.store.register(reported, self.me.node_id, b"1") >= n:
                self.store.set_once(self._round_key(round, "allreported"), b"1")
            else:
                self.store.wait_for_change(
                    self._round_key(round, "allreported"), 0, self.settings.close_timeout
                )
        keys = [self._round_key(round, "failure", r) for r in range(n)]
        records: list[dict] = []
        for item in self._get_existing(keys):
            records.extend(decode_json(item.value, "a failure record"))
        return records

    def _get_existing(self, keys: list[str]) -> list:
        # TCPStore's multi-get blocks on missing keys: read the present ones one by one.
        return [item for item in (self.store.get(k) for k in keys) if item is not None]

    def exit_barrier(self, tick: float) -> Restart | None:
        """Wait until every member's workers succeeded in this round.

        Returns None when the whole job succeeded, or the reason to restart when the round was
        moved on meanwhile (a member failed or was lost). Keeps beating, so a finished node never
        looks lost.
        """
        info = self.info
        # Durable before waiting: a node lost from here on has done its part of the round.
        self.store.set_once(self._round_key(info.round, "succeeded", self.me.node_id), b"1")
        done = self.store.register(self._round_key(info.round, "done") + "/", self.me.node_id, b"1")
        alldone = self._round_key(info.round, "alldone")
        if done >= info.num_nodes and self._all_succeeded():
            self._finish_job()
            return None
        recheck_at = self._clock() + self.settings.dead_after
        while True:
            if self.store.wait_for_change(alldone, 0, tick) is not None:
                return None
            self._heartbeat.check()
            if info.node_rank == 0 and self._clock() >= recheck_at:
                # the count (a counter another program can move) may never reach N; the sealed
                # succeeded keys decide: node rank 0 looks at them every dead_after seconds
                recheck_at = self._clock() + self.settings.dead_after
                if self._all_succeeded(warn=False):
                    self._finish_job()
                    return None
            state, _ = self.read_state()
            if state.status == SUCCEEDED:
                return None
            self._raise_if_ended(state)
            if state.round != info.round:
                return state.restart()
            lost = self._lost_member()
            if lost is not None:
                reason = self.request_restart(node_lost(lost))
                return None if self.read_state()[0].status == SUCCEEDED else reason

    def _all_succeeded(self, warn: bool = True) -> bool:
        """Whether every member of this round wrote its ``succeeded`` key: the count of the
        exit barrier (a counter) could have been moved by another program; these keys are
        values, sealed with the job's secret where there is one. One multi-get on the node that
        counted last (once per job); reads up to the first missing key on node rank 0 while
        it waits (every dead_after seconds: the count may have been moved down)."""
        info = self.info
        keys = [self._round_key(info.round, "succeeded", m.node_id) for m in info.nodes]
        if warn:  # the count says all are there: one multi-get
            if all(item is not None for item in self.store.get_many(keys)):
                return True
        else:  # one by one (TCPStore's multi-get blocks on a gap), up to the first missing
            if all(self.store.get(k) is not None for k in keys):
                return True
        if warn:
            log.warning(
                "meshrun: the exit barrier counts every member as done, but not every member's "
                "workers succeeded: another program moved the count; waiting for the members"
            )
        return False

    def _lost_member(self) -> str | None:
        """The lost neighbour of this running round, unless its workers had all succeeded (it
        wrote ``succeeded`` before its exit barrier): its part is done, so the round goes on
        without it (the job finishes once the others' workers succeed) and this node watches
        the next member on the ring instead."""
        lost = self._heartbeat.lost_neighbour
        if lost is None:
            return None
        if self.store.get(self._round_key(self.info.round, "succeeded", lost)) is None:
            return lost
        ids = [m.node_id for m in self.info.nodes]
        following = ids[(ids.index(lost) + 1) % len(ids)] if lost in ids else None
        log.warning("meshrun: node %s lost after its workers succeeded; the round goes on", lost)
        self._heartbeat.watch(None if following == self.me.node_id else following)
        return None

    def _finish_job(self) -> None:
        info = self.info
        while True:
            state, version = self.read_state()
            if state.status != RUNNING or state.round != info.round:
                break
            done = replace(state, status=SUCCEEDED, reason="job finished")
            if self.store.compare_and_set(state_key(self._prefix), version, done.to_json())[0]:
                break
        self.store.set_once(self._round_key(info.round, "alldone"), b"1")

    def leave(self) -> None:
        """Say that this node has read the job's outcome and goes.

        The store host (c10d) waits for every node to say so before it stops serving; on a
        store that outlives the agents (etcd), the last node out deletes the job's keys.
        """
        round = self.read_state()[0].round
        left = self.store.register(self._round_key(round, "left") + "/", self.me.node_id, b"1")
        if self.store.outlives_agents and left >= self._expected_leavers(round):
            self.store.delete_prefix(self._prefix)

    def _expected_leavers(self, round: int) -> int:
        """Members of ``round`` plus the nodes waiting for the round after it."""
        closed = self.store.get(self._round_key(round, "closed"))
        members = len(decode_members(closed.value)) if closed is not None else 0
        return members + self.store.count(self._nodes(round + 1))

    def wait_for_others_to_leave(self) -> None:
        """On the node that hosts the store: keep serving until every member and spare has
        read the outcome (success, or the failure records), bounded by ``close_timeout``."""
        round = self.read_state()[0].round
        expected = self._expected_leavers(round)
        deadline = self._clock() + self.settings.close_timeout
        key = self._round_key(round, "left") + "/"
        while self._clock() < deadline:
            if self.store.count(key) >= expected:
                return
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the heartbeat thread and the stacks requests' watch."""
        self._heartbeat.stop()
        if self._stacks_watch is not None:
            self._stacks_watch.close()


class _Heartbeat:
    """Beats for this node and watches one neighbour, on its own thread and connection.

    The main thread may be busy for a whole grace period stopping workers; the heartbeat must
    not pause then, or a slow restart would look like a lost node.
    """

    def __init__(self, store: Store, node_id: str, settings: RendezvousSettings):
        self._store = store
        self._node_id = node_id
        self._settings = settings
        self._neighbour: str | None = None
        self._liveness = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._wake = threading.Event()  # a tick now: stop, or the first beat of a member
        self._beating = False
        self._lock = threading.Lock()
        self.lost_neighbour: str | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        """Start the thread. Where the store marks joiners (`Liveness.joining`: etcd), this
        node beats only from `member` on: at a thousand nodes, keep-alives while they all
        joined were half of etcd's requests, and nobody asks about a joiner."""
        if self._thread is not None:
            return
        self._liveness = self._store.liveness(self._node_id, self._settings.dead_after)
        if not self._liveness.joining():
            self._liveness.beat()
            self._beating = True
        self._thread = threading.Thread(target=self._run, name="meshrun-heartbeat", daemon=True)
        self._thread.start()

    def member(self) -> None:
        """This node is a member of a round: beat from now on (the first beat at once, on the
        heartbeat's thread: the others give a marked joiner ``joining_grace`` to start)."""
        if not self._beating:
            self._beating = True
            self._wake.set()

    def watch(self, node_id: str | None) -> None:
        with self._lock:
            self._neighbour = node_id
            self.lost_neighbour = None

    def check(self) -> None:
        """Re-raise, on the caller's thread, a store failure the heartbeat thread saw."""
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        interval = self._settings.keep_alive_interval
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            if self._stopped:
                return
            try:
                if self._beating:
                    self._liveness.beat()
                with self._lock:
                    neighbour = self._neighbour
                if neighbour is not None and not self._liveness.is_alive(neighbour):
                    with self._lock:
                        if self._neighbour == neighbour:
                            self.lost_neighbour = neighbour
            except StoreLostError as e:
                self.error = e
                return
            except Exception as e:  # noqa: BLE001 - any store trouble ends the rendezvous
                self.error = StoreLostError(f"rendezvous store lost: {e}")
                return

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._liveness is not None:
            self._liveness.close()
