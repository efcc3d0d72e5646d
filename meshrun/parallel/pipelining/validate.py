"""`validate_schedule`: reject a pipeline order that could hang or would compute the wrong thing.

Runs in one process, with no process group: the order of every rank is plain data (the same on
every rank, since each builds it from the same arguments), so each rank validates the whole
table before its first step and all ranks reach the same verdict.

Checks, in this order (the first failure raises `ScheduleError` naming ranks and actions):

1. Shape of the table: ranks are 0..p-1, ``num_stages`` is a multiple of p, every action's
   stage and microbatch are in range and the stage sits on its rank under the placement
   (``stage % p`` for "loop"; see `actions` for "v").
2. Completeness: every (stage, F/B, microbatch) appears exactly once (a missing microbatch,
   or a duplicate, is an error); a stage with split backwards has a W for every microbatch,
   once (a stage with none runs full backwards). Forward-only orders (``backward=False``)
   have no B or W actions.
3. Causality on a rank: ``B(s, m)`` comes after ``F(s, m)`` (a backward before its forward),
   and ``W(s, m)`` after ``B(s, m)``.
4. Microbatch order: each stage runs its forwards in microbatch order 0, 1, ..., and its
   backwards (and its W's) in microbatch order too (the schedule may not reorder
   microbatches).
5. Deadlock freedom: the runtime never blocks on a send (isend, waited at the end of the step),
   so the only waits are receives. Executing all ranks' lists with "an action runs once the
   actions it depends on have run" (see `actions.dependencies`) must finish; if at some point
   no rank can move, the order deadlocks and the message lists where each rank is stuck.
6. Channel order: the messages from one rank to another (activations forward, gradients
   backward) are received in the order they are sent, so matching by order (NCCL) and by
   tag (gloo, which the runtime uses) agree. With the "v" placement the two directions are
   checked as separate channels: ZB-V's ends interleave activations and gradients
   differently (rank 0 sends stage 1's third activation before stage 2's first gradient,
   rank 1 needs them the other way round), which tag matching handles and per-peer order
   matching cannot, so the runtime runs "v" orders on gloo only.
"""

from __future__ import annotations

from collections import Counter

from meshrun.parallel.pipelining.actions import (
    BACKWARD,
    FORWARD,
    LOOP,
    WEIGHT,
    Action,
    Order,
    dependencies,
    stage_rank,
)


class ScheduleError(ValueError):
    """A pipeline order that `validate_schedule` rejects; the message says which rule and where."""


def validate_schedule(order: Order, num_stages: int, n_microbatches: int, *,
                      backward: bool = True, placement: str = LOOP) -> None:
    """Check that ``order`` runs every stage on every microbatch without deadlock.

    Args:
        order: pipeline rank -> list of `Action`, for every rank of the pipeline group.
        num_stages: total number of stages (a multiple of the number of ranks).
        n_microbatches: microbatches per step (>= 1).
        backward: False for a forward-only (eval) order: then no B or W actions are allowed.
        placement: ``"loop"`` or ``"v"``: which rank each stage lives on (see `actions`).

    Raises:
        ScheduleError: the first rule of the module docstring that ``order`` breaks.
        ValueError: an unknown placement.

    The same checks, with a clearer report, that torch.distributed.pipelining applies to the
    action tables of its ``_PipelineScheduleRuntime`` (``_validate_schedule``).
    """
    num_ranks = len(order)
    if sorted(order) != list(range(num_ranks)) or num_ranks == 0:
        raise ScheduleError(f"the order must have one list per rank 0..p-1 (got ranks "
                            f"{sorted(order)})")
    if num_stages < 1 or num_stages % num_ranks:
        raise ScheduleError(f"num_stages must be a positive multiple of the {num_ranks} ranks "
                            f"(got {num_stages})")
    if n_microbatches < 1:
        raise ScheduleError(f"n_microbatches must be >= 1 (got {n_microbatches})")
    stage_rank(0, num_ranks, placement)  # an unknown placement is a ValueError
    _check_placement(order, num_stages, n_microbatches, backward, placement)
    _check_complete(order, num_stages, n_microbatches, backward)
    _check_causal(order)
    _check_microbatch_order(order, num_stages)
    run_order(order, num_stages)
    _check_channels(order, num_stages, per_direction=placement != LOOP)


def ranks_of_stages(order: Order) -> dict[int, int]:
    """Stage -> the rank whose list runs it (the placement an order implies)."""
    return {a.stage: r for r, actions in order.items() for a in actions}


def run_order(order: Order, num_stages: int, cost=None) -> dict[Action, tuple[float, float]]:
    """Execute ``order`` as the runtime would (ranks sequential, waits only on dependencies).

    ``cost(action) -> float`` gives each action's duration (default 1), and ``cost`` may also
    be a pair ``(cost, comm)`` where ``comm(src_rank, dst_rank) -> float`` is the delay of a
    message. Returns action -> (start, finish). Raises ScheduleError on deadlock.
    """
    if isinstance(cost, tuple):
        cost, comm = cost
    else:
        comm = None
    cost = cost or (lambda action: 1.0)
    rank_of = ranks_of_stages(order)
    position = {r: 0 for r in order}
    free_at = {r: 0.0 for r in order}
    times: dict[Action, tuple[float, float]] = {}
    remaining = sum(len(actions) for actions in order.values())
    while remaining:
        moved = False
        for r in order:
            while position[r] < len(order[r]):
                action = order[r][position[r]]
                if _unfinished(action, num_stages, times):
                    break
                ready = free_at[r]
                for d in dependencies(action, num_stages):
                    if d in times:
                        src = rank_of[d.stage]
                        delay = comm(src, r) if comm and src != r else 0.0
                        ready = max(ready, times[d][1] + delay)
                finish = ready + cost(action)
                times[action] = (ready, finish)
                free_at[r] = finish
                position[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise ScheduleError("the order deadlocks: " + _stuck(order, position, num_stages,
                                                                   times))
    return times


def _unfinished(action, num_stages, times) -> list[Action]:
    """Dependencies of ``action`` that have not run yet."""
    return [d for d in dependencies(action, num_stages) if d not in times]


def _stuck(order, position, num_stages, times) -> str:
    rank_of = ranks_of_stages(order)
    parts = []
    for r in sorted(order):
        if position[r] >= len(order[r]):
            continue
        action = order[r][position[r]]
        waits = _unfinished(action, num_stages, times)
        where = ", ".join(f"{d} (rank {rank_of.get(d.stage, '?')})" for d in waits)
        parts.append(f"rank {r} waits at {action} for {where}")
    return "; ".join(parts) + " (each of these comes later in its own rank's order)"


def _check_placement(order, num_stages, n_microbatches, backward, placement):
    num_ranks = len(order)
    for r, actions in order.items():
        for a in actions:
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r}: {a!r} is not an Action")
            if a.stage >= num_stages:
                raise ScheduleError(f"rank {r}: {a} names stage {a.stage}, but there are only "
                                    f"{num_stages} stages")
            if a.microbatch >= n_microbatches:
                raise ScheduleError(f"rank {r}: {a} names microbatch {a.microbatch}, but there "
                                    f"are only {n_microbatches} microbatches")
            home = stage_rank(a.stage, num_ranks, placement)
            if home != r:
                rule = f"stage % {num_ranks}" if placement == LOOP else f"{placement} placement"
                raise ScheduleError(f"rank {r}: {a} runs stage {a.stage}, which lives on rank "
                                    f"{home} ({rule})")
            if a.kind != FORWARD and not backward:
                raise ScheduleError(f"rank {r}: {a} is a backward in a forward-only order")


def _check_complete(order, num_stages, n_microbatches, backward):
    seen = Counter(a for actions in order.values() for a in actions)
    for a, count in seen.items():
        if count > 1:
            raise ScheduleError(f"{a} appears {count} times (each action must run once)")
    kinds = (FORWARD, BACKWARD) if backward else (FORWARD,)
    for s in range(num_stages):
        for kind in kinds:
            missing = [m for m in range(n_microbatches) if Action(s, kind, m) not in seen]
            if missing:
                what = "forward" if kind == FORWARD else "backward"
                raise ScheduleError(f"stage {s} never runs the {what} of microbatch(es) "
                                    f"{', '.join(map(str, missing))} (missing microbatch)")
        weights = [m for m in range(n_microbatches) if Action(s, WEIGHT, m) in seen]
        if weights and len(weights) != n_microbatches:
            missing = sorted(set(range(n_microbatches)) - set(weights))
            raise ScheduleError(f"stage {s} splits the backward of microbatch(es) "
                                f"{', '.join(map(str, weights))} (W) but not of "
                                f"{', '.join(map(str, missing))}: give every microbatch of a "
                                f"stage a W, or none (missing W)")


def _check_causal(order):
    for r, actions in order.items():
        done = set()
        for a in actions:
            if a.kind == BACKWARD and Action(a.stage, FORWARD, a.microbatch) not in done:
                raise ScheduleError(f"rank {r}: {a} is a backward before its forward "
                                    f"{Action(a.stage, FORWARD, a.microbatch)}")
            if a.kind == WEIGHT and Action(a.stage, BACKWARD, a.microbatch) not in done:
                raise ScheduleError(f"rank {r}: {a} is a weight gradient before its backward "
                                    f"{Action(a.stage, BACKWARD, a.microbatch)}")
            done.add(a)


def _check_microbatch_order(order, num_stages):
    for r, actions in order.items():
        last: dict[tuple[int, str], int] = {}
        for a in actions:
            key = (a.stage, a.kind)
            if key in last and a.microbatch < last[key]:
                what = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "W"}[a.kind]
                raise ScheduleError(f"rank {r}: stage {a.stage} runs the {what} of microbatch "
                                    f"{a.microbatch} after microbatch {last[key]} (microbatches "
                                    f"must run in order on each stage)")
            last[key] = a.microbatch


def _check_channels(order, num_stages, per_direction=False):
    rank_of = ranks_of_stages(order)
    sent: dict[tuple[int, int], list[str]] = {}
    received: dict[tuple[int, int], list[str]] = {}
    for r, actions in order.items():
        for a in actions:
            if a.kind == WEIGHT:
                continue  # local: nothing sent, nothing received
            if a.kind == FORWARD:
                out_stage, in_stage = a.stage + 1, a.stage - 1  # activation out / in
            else:
                out_stage, in_stage = a.stage - 1, a.stage + 1  # input grad out / output grad in
            channel = a.kind if per_direction else ""
            if 0 <= out_stage < num_stages and rank_of[out_stage] != r:
                message = f"{a.kind}:{out_stage}:{a.microbatch}"
                sent.setdefault((r, rank_of[out_stage], channel), []).append(message)
            if 0 <= in_stage < num_stages and rank_of[in_stage] != r:
                message = f"{a.kind}:{a.stage}:{a.microbatch}"
                received.setdefault((rank_of[in_stage], r, channel), []).append(message)
    for src, dst, channel in sorted(set(sent) | set(received)):
        out, into = sent.get((src, dst, channel), []), received.get((src, dst, channel), [])
        for i, (x, y) in enumerate(zip(out, into, strict=False)):
            if x != y:
                raise ScheduleError(
                    f"rank {src} sends {_describe(x)} as its message #{i} to rank {dst}, but "
                    f"rank {dst} expects {_describe(y)} there (messages between two ranks must "
                    f"be received in the order they are sent)")


def _describe(message: str) -> str:
    kind, stage, microbatch = message.split(":")
    what = "the activation" if kind == FORWARD else "the gradient"
    return f"{what} for stage {stage}, microbatch {microbatch}"
