"""`steps()`: a training loop that survives the loss of a node without leaving the process.

When a node dies, the survivors' next collective fails (gloo: "Connection reset by peer").
Under a plain loop the worker exits, its agent restarts it, and the new process imports
torch, joins a new process group and reads a checkpoint. Under `steps()` the worker stays:

1. the step's collective fails because a peer vanished (`peer_lost`): the step is abandoned
   (nothing of it was applied: see "the rule" below), the RNG state is put back, the world
   is left so that its connections close at once (`_teardown`: peers blocked on this rank
   fail and follow instead of waiting for their collective timeout), and ``ddp`` is undone
   on the live modules (`meshrun.parallel.ddp.unwrap`);
2. it waits for its agent's offer of the next round (`meshrun.in_place`; the agent completes
   the rendezvous without stopping it), takes the round's RANK / WORLD_SIZE / MASTER_ADDR /
   MASTER_PORT / MESHRUN_ROUND into ``os.environ``, confirms, and joins the new world
   (`meshrun.parallel.context.rejoin`); a round that breaks before it forms (another node
   lost meanwhile: its agent closes the round's store) is left for the next offer;
3. ``build()`` (the script's own: the mesh and the strategies, exactly as at the start) runs
   again on the live modules, then the ranks agree on the state (`_agree`): every rank says
   how many steps it has done; if they differ, the rank that did most (the lowest such rank)
   broadcasts everything in ``state``; with data parallelism every survivor holds the whole
   model and optimizer state, so no disk is read; a model sharded with ``fully_shard`` is
   first rebuilt whole from the survivors' neighbour copies (`meshrun.parallel.fsdp.copies`:
   each rank keeps a rank's rows of another node, refreshed every ``copy_every`` steps), and
   ``build()`` shards it again;
4. the step is tried again, now with the new world's data split (the script's global batch
   rule decides what each rank reads), so no step is lost and none is repeated.

The rule for the body of a step (``with attempt:``): its effects on the state (the optimizer
step, the data position) come after its last collective. Then a step either completed on a
rank (all its collectives returned) or left that rank's state untouched. Ranks may still
differ by one step (a rank's last all-reduce can return while a peer's fails): step 3's
agreement settles that.

A step is done when its ``with`` block is left: under ``fully_shard`` its end exchanges the
neighbour copies of the state it produced (every ``copy_every`` steps), waits for them and
confirms with one small all-reduce that every rank has them. A node lost before the copies
are everywhere makes the step fail and be tried again; a node lost after finds the step's
result in memory. A loss during that end is decided by the restore, the same on every rank
(`_Loop.finish_step`): ``attempt.done`` is true when the step's copies were restored. A
script that reports a step after its ``with`` block (``if attempt.done: print(...)``)
therefore reports every step once and never one that is trained again, whatever the moment
of the loss (``copy_every`` 1); a report inside the block can be of a step that is then
tried again.

When nodes join, no collective fails: `steps()` looks for the agent's offer (one small file
read) before each step and changes world there, at a step boundary; its teardown makes any
peer blocked on it fail and follow. The joiners' fresh workers run ``build()`` and the
agreement like the others and so receive the state from the ranks that stayed, by broadcast,
not from the disk.

The agent hands a new world only on a membership change (a node lost, nodes joining) and
when every worker of its node opted in (`steps()` opts in when it starts); otherwise, and
when this rank does not confirm in time, the agent stops and restarts the workers as
without in-place recovery. A worker restarted so runs ``build()`` and the agreement too, so
it gets the state of the ranks that stayed. Exceptions that are not a vanished peer
propagate as usual.

The pattern of a loop that yields attempts to be used as ``with`` blocks is tenacity's
(``for attempt in Retrying(): with attempt: ...``); the agreement after a change of world is
the idea of torchft's quorum (pytorch/torchft), here without a separate lighthouse: the
agent's rendezvous is the quorum.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, MutableMapping

import torch
import torch.distributed as dist
from torch import nn

from meshrun import _torch, in_place, worker_signals
from meshrun.parallel._sockets import note_world_sockets, shut_down_world_sockets, tcp_connections
from meshrun.parallel.fsdp.copies import Copies, NotCovered, _stateful
from meshrun.peer_lost import PEER_LOST

__all__ = ["Attempt", "peer_lost", "steps"]


def peer_lost(error: BaseException) -> bool:
    """Whether ``error`` reads like a collective that failed because a peer process vanished,
    or a blocked peer aborted its groups (see `_teardown`), or joining a round failed as its
    store closed (its agent moved on): `meshrun.peer_lost.PEER_LOST` in its message or in the
    message of its cause (a timeout counts: a cut cable closes no connection)."""
    while error is not None:
        if isinstance(error, RuntimeError) and PEER_LOST.search(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


class Attempt:
    """One try of one step: use it as ``with attempt:`` around the step's body.

    Attributes:
        step: the index of the step this attempt trains (0-based: ``state["step"]`` before it).
        world: what ``build()`` returned for the current world (the mesh, the parallelized
            model); take it from here on every attempt, it changes with the world.
        changes: how many times this process changed world in place so far.
        done: the step completed (its body returned and its copies are out): read it after
            the ``with`` block.
    """

    def __init__(self, step: int, world: object, changes: int, finish: Callable[[], bool]):
        self.step = step
        self.world = world
        self.changes = changes
        self.entered = False
        self.done = False
        self.ended = False  # the body returned and the loop's end of the step ran
        self.error: BaseException | None = None
        self._finish = finish  # the loop's end of a step whose body returned: done?

    def __enter__(self) -> Attempt:
        self.entered = True
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None:
            self.done = self._finish()  # (False: a peer vanished there; the world changed)
            self.ended = True
            return False
        if peer_lost(error):
            self.error = error
            return True  # swallowed: the loop waits for the new world and tries again
        return False


def steps(
    state: MutableMapping, total: int, *, build: Callable[[], object],
    resume: Callable[[], None] | None = None, wait_timeout: float = 60.0,
    copy_every: int = 1,
) -> Iterator[Attempt]:
    """Yield one `Attempt` per step from ``state["step"]`` (0 if absent) to ``total``.

    Call it after ``meshrun.parallel.init()``. ``build()`` is called first, and again after
    each change of world, on the live modules; make it create the mesh and apply the
    strategies (``ddp`` over the mesh's data-parallel group) as at the start, and return what
    the step needs of them (`Attempt.world`). Keep no process group of your own across steps:
    the old world's connections close only when nothing holds its groups. ``state`` holds
    what the ranks must agree on: ``nn.Module`` values (parameters and buffers),
    ``torch.optim.Optimizer`` values (their ``state_dict``) and picklable values (a data
    position); `steps` keeps ``state["step"]``, the number of steps done, itself.

    Args:
        state: as above; read, and written when this rank takes another rank's state.
        total: the step count to reach.
        build: the script's mesh and strategies for the current world.
        resume: called on every rank together (collectives allowed: a checkpoint's
            `meshrun.parallel.checkpoint.load`) after the ranks agree on the state, whenever
            none of them has done a step: a fresh group (the job's start, or the agent
            restarted the workers) may then load ``state`` from a checkpoint, ``"step"``
            included. A worker that joins ranks which have trained does not read the disk:
            it takes their state.
        wait_timeout: seconds to wait for the agent's offer of a new world after a peer
            vanished; then a RuntimeError saying so is raised, from the collective's error
            (the agent restarts the group as usual).
        copy_every: a model sharded with ``fully_shard`` (over the whole world): refresh
            the neighbour copies every this many steps, at the step's end (and before a
            new world's first step; `meshrun.parallel.fsdp.copies`: each rank keeps its
            own rows and those of a rank on another node, so one node's loss is recovered
            from memory). 1: no done step is trained again after a loss; N: up to N - 1 are
            (the same data, the same result), for 1/N of the copies' cost; 0: none (a lost
            node's rows come from the last checkpoint: ``resume``). Unused without
            ``fully_shard``.

    Raises:
        RuntimeError: no new world came within ``wait_timeout`` of a peer vanishing (its
            cause: the collective's error; that error itself when the process was not
            started by a meshrun agent); an attempt that was not entered with ``with``.
        Any exception of the step's body that is not a vanished peer (`peer_lost`).
    """
    state.setdefault("step", 0)
    loop = _Loop(state, build, resume, wait_timeout, Copies(copy_every))
    in_place.opt_in()
    loop.enter_world()
    while state["step"] < total:
        if in_place.offer_after(loop.round) is not None:  # a node joins: no collective failed
            loop.change_world(None)
            continue
        # fully_shard: a new world's first copies, before its first step trains (a loss in
        # that step would find only the old world's); each step's end: `finish_step`
        try:
            loop.copies.exchange(state, loop.round)
        except RuntimeError as e:
            if not peer_lost(e):
                raise
            loop.change_world(e)
            continue
        rng = torch.get_rng_state()
        watch = _OfferWatch(loop.round) if in_place.channel() is not None else None
        attempt = Attempt(state["step"], loop.built, loop.changes,
                          finish=functools.partial(loop.finish_step, total, watch))
        try:
            yield attempt
        finally:
            if watch is not None:
                watch.stop()
        if attempt.ended:  # `finish_step` counted it, or changed world and restored the
            continue  # state it found (the step is then done, or is tried again)
        if not attempt.entered:
            raise RuntimeError("meshrun.parallel.elastic.steps: use each attempt as "
                               "`with attempt:` around the step's body")
        torch.set_rng_state(rng)  # the step is tried again from its own start
        error, attempt = attempt.error, None  # the attempt's world is the old one's
        loop.change_world(error)


class _OfferWatch:
    """While a step runs: the agent's offer of a new world that the step does not end within
    a grace (a quarter of the offer's deadline, at most `GRACE_S`) means this rank is blocked
    in a collective on a peer that went silent (a cut link: no reset ever arrives, the
    collective would wait for its timeout). Then the world's connections are shut down
    (`shut_down_world_sockets`), so the collective fails now as if the peer had vanished and
    the loop changes world. A step that ends in time (a node joins; healthy peers) takes the
    offer at its boundary, as without the watch; a step longer than the grace is cut short and
    retried in the new world, which costs that step, never its result. One thread per step,
    a small file read every `INTERVAL_S`."""

    INTERVAL_S = 0.05
    GRACE_S = 2.0

    def __init__(self, round: int):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(round,), daemon=True,
                                        name="meshrun-elastic-offer-watch")
        worker_signals.start_thread(self._thread)  # every signal blocked: the script's

    def _run(self, round: int) -> None:
        seen_at = grace = None
        while not self._stop.wait(self.INTERVAL_S):
            offer = in_place.offer_after(round)
            if offer is None:
                continue
            if seen_at is None:
                seen_at, grace = time.monotonic(), self.GRACE_S
                deadline = offer.get("deadline_s")
                if isinstance(deadline, (int, float)):
                    grace = min(grace, deadline / 4)
            elif time.monotonic() - seen_at >= grace:
                shut_down_world_sockets()
                return

    def stop(self) -> None:
        """End the watch; returns once its thread has (nothing is shut down after)."""
        self._stop.set()
        self._thread.join()


class _Loop:
    """The state of one `steps` loop: which round this process is in, and how it changes."""

    def __init__(self, state: MutableMapping, build: Callable[[], object],
                 resume: Callable[[], None] | None, wait_timeout: float, copies: Copies):
        self.state, self.build, self.wait_timeout = state, build, wait_timeout
        self.resume, self.copies = resume, copies
        self.round = int(os.environ.get("MESHRUN_ROUND", 0))
        self.changes = 0
        self.built: object = None

    def enter_world(self) -> None:
        """Restore a fully sharded model from the copies, ``build()``, agree on the state,
        and ``resume()`` where nobody has trained yet (every rank then knows the same step
        count: all call it or none); a peer vanishing meanwhile changes world (which enters
        the next one)."""
        try:
            holdings = [None] * dist.get_world_size()
            dist.all_gather_object(holdings, self.copies.holdings(self.state))
            restored = self._restore(holdings)
            before = tcp_connections()
            self.built = self.build()
            note_world_sockets(before)  # the connections of the mesh's groups
            self.copies.after_build()
            if not restored:
                _agree(self.state, [h["step"] for h in holdings])
            if self.resume is not None and self.state["step"] == 0:
                self.resume()
                if restored == "checkpoint" and self.state["step"] == 0:
                    raise RuntimeError("meshrun.parallel.elastic: the neighbour copies do not "
                                       "cover the lost ranks and resume() found no checkpoint")
        except RuntimeError as e:
            if not peer_lost(e):
                raise
            self.change_world(e)

    def finish_step(self, total: int, watch: _OfferWatch | None) -> bool:
        """The end of a step whose body returned: count it, then (``fully_shard``, a refresh
        step) exchange the copies of the state it produced, wait for them and confirm that
        every rank has them (`Copies.confirm`), so that a done step is in a peer's memory;
        after the last step, a barrier: no rank leaves the loop (and exits 0) while a peer
        may still be lost in place (its agent would restart the whole group). Returns
        whether the step is done. A peer that vanishes meanwhile changes world here, and the
        restore decides, the same on every rank: the step is done if every survivor held its
        copies (the exchange completed everywhere, the confirmation did not), else the state
        before it is restored and the step is tried again. Deciding after the restore keeps
        a rank from reporting a step that is trained again, or from skipping the report of
        one that was restored as done."""
        step = self.state["step"]
        self.state["step"] += 1
        try:
            self.copies.exchange(self.state, self.round)
            if self.state["step"] >= total:
                dist.barrier()
        except RuntimeError as e:
            if not peer_lost(e):
                raise
            if watch is not None:  # its round is over: it must not shut the next one down
                watch.stop()
            self.change_world(e)
            return self.state["step"] > step
        return True

    def _restore(self, holdings: list[dict]) -> str | None:
        """A fully sharded model: its state from the survivors' copies ("memory"), else
        step 0 for a checkpoint's load ("checkpoint"); None: not fully sharded."""
        try:
            used = self.copies.restore(self.state, holdings)
        except NotCovered as e:
            if self.resume is None:
                raise RuntimeError(f"meshrun.parallel.elastic: {e}, and steps() has no "
                                   f"resume= to load a checkpoint") from None
            self.state["step"] = 0  # every rank: resume() loads the last checkpoint
            used = f"{e}: falling back to the last checkpoint"
            if dist.get_rank() == 0:
                print(f"meshrun.parallel.elastic: {used}", file=sys.stderr, flush=True)
            return "checkpoint"
        if used is not None and dist.get_rank() == 0:
            print(f"meshrun.parallel.elastic: restored {used}", file=sys.stderr, flush=True)
        return None if used is None else "memory"

    def change_world(self, error: BaseException | None) -> None:
        """Leave the world (broken by ``error``, or None: the agent offered a new one at a
        step boundary, a node joins), take the agent's next round, and enter it."""
        from meshrun.parallel.context import rejoin

        t0 = time.monotonic()
        if error is None:  # nodes join at a step boundary: every owner's rows are current
            self.copies.keep_own(self.state, self.round)
        while True:
            self.built = None  # what build() returned holds the old world's groups
            _teardown(self.state, error)
            offer = self._wait_for_offer(error)
            os.environ.update({k: str(v) for k, v in offer["env"].items()})
            self.round = offer["round"]
            in_place.confirm(self.round)
            try:
                ctx = rejoin()
                break
            except RuntimeError as e:  # the round broke before it formed: another node was
                if not peer_lost(e):  # lost meanwhile (its agent closed the round's store);
                    raise  # the agent's next offer follows
                error = e
        self.changes += 1
        why = (f"a peer vanished ({_first_line(error)})" if error is not None
               else "the agent handed a new world")
        print(f"meshrun.parallel.elastic: {why}; rank {ctx.rank} of world size "
              f"{ctx.world_size} in round {self.round}, in place "
              f"({time.monotonic() - t0:.2f} s)", file=sys.stderr, flush=True)
        self.enter_world()

    def _wait_for_offer(self, error: BaseException | None) -> dict:
        deadline = time.monotonic() + self.wait_timeout
        while True:
            offer = in_place.offer_after(self.round)
            if offer is not None:
                return offer
            if in_place.channel() is None or time.monotonic() >= deadline:
                if error is None:
                    raise RuntimeError("meshrun.parallel.elastic: the agent's offer of a new "
                                       "world went away")
                if in_place.channel() is None:  # not under a meshrun agent
                    raise error
                raise RuntimeError(f"meshrun.parallel.elastic: no new world from the agent "
                                   f"within {self.wait_timeout:g} s (wait_timeout) of a peer "
                                   f"vanishing: {_first_line(error)}") from error
            time.sleep(0.02)


def _teardown(state: MutableMapping, error: BaseException | None = None) -> None:
    """Leave the world so that its connections close now: a peer blocked on this rank then
    fails at once (and changes world too) instead of waiting for the collective timeout.

    gloo closes a pair's socket only when its group is freed (``abort`` and ``shutdown`` do
    not, in torch 2.13), and an async collective still in flight on a live peer (ddp's other
    buckets) keeps it alive in gloo's threads until its timeout. So the world's TCP
    connections are shut down first (``shutdown(2)``: the peer reads EOF, the work in
    flight fails): those that appeared while this process joined the world and while
    ``build()`` made its groups (`meshrun.parallel._sockets`). Then every reference to the
    groups goes: ``ddp`` is undone on the modules in
    ``state`` and ``fully_shard`` released (`meshrun.parallel.fsdp.release`: each parameter
    keeps its rows until `Copies.restore`), every `Mesh` is released, the frames of
    ``error``'s traceback are cleared, and the groups are aborted (NCCL: frees the
    communicators) and destroyed."""
    from meshrun.parallel.ddp import unwrap
    from meshrun.parallel.fsdp import release
    from meshrun.parallel.mesh import release_all

    shut_down_world_sockets()

    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    for value in state.values():
        if isinstance(value, nn.Module):
            for module in value.modules():
                unwrap(module)
            release(value)
    release_all()
    if dist.is_initialized():
        for group in _torch.all_process_groups():  # every group of this process
            try:
                group.abort()
            except (RuntimeError, NotImplementedError, AttributeError):
                pass  # destroy and the collection below close its connections
        dist.destroy_process_group()
    gc.collect()


def _agree(state: MutableMapping, counts: list[int] | None = None) -> None:
    """Make every rank's ``state`` that of the rank with the most steps done (the lowest such
    rank; ``counts``: every rank's steps done, all-gathered here when None): a broadcast of
    the whole state only when they differ (replicas that did the same steps hold the same
    values)."""
    if counts is None:
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, int(state["step"]))
    if len(set(counts)) == 1:
        return
    src = counts.index(max(counts))
    if dist.get_rank() == 0:
        print(f"meshrun.parallel.elastic: ranks had done {sorted(set(counts))} steps; every "
              f"rank takes rank {src}'s state (step {counts[src]})", file=sys.stderr,
              flush=True)
    for key in sorted(state, key=str):
        value = state[key]
        if isinstance(value, nn.Module):
            for t in [*value.parameters(), *value.buffers()]:
                dist.broadcast(t.data, src=src)
        elif isinstance(value, torch.optim.Optimizer) or _stateful(value):
            box = [value.state_dict()]  # loaded in place: a scheduler stays bound to the
            dist.broadcast_object_list(box, src=src)  # live optimizer
            value.load_state_dict(box[0])
        else:
            box = [value]
            dist.broadcast_object_list(box, src=src)
            state[key] = box[0]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().split("\n", 1)[0]
    return text if len(text) <= 160 else text[:157] + "..."
