"""The action lists of the built-in schedules: one list per pipeline rank, plain data.

With p ranks, m microbatches, and stage s on rank ``s % p`` (see `actions`):

- GPipe (Huang et al., 2019): every rank runs all m forwards, then all m backwards.
  Simple; holds the activations of all m microbatches at once.
- 1F1B (PipeDream-Flush; Narayanan et al., 2021): rank r runs ``w = min(p - r - 1, m)``
  warm-up forwards, then alternates one forward and one backward (steady state) for the
  remaining ``m - w`` microbatches, then runs the last ``w`` backwards (cool-down). Same
  bubble as GPipe, but a rank holds at most ``p - r`` microbatches of activations, not m.
- Interleaved 1F1B (Megatron-LM's virtual pipeline, Narayanan et al., 2021): each rank holds
  v chunks (stages r, r + p, ..., r + (v-1)p). The ``v m`` forward units of a rank run in
  rounds of p microbatches per chunk: unit k is chunk ``(k // p) % v`` on microbatch
  ``(k // (p v)) p + k % p``; backward units go through the chunks in reverse. Rank r warms
  up with ``(p - r - 1) * 2 + (v - 1) p`` forwards (capped at ``v m``), then 1F1B, then
  cool-down. Needs m to be a multiple of p. The bubble shrinks by v: ``(p-1)/(v m + p - 1)``.

Zero-bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward is split
into B (input gradient: the previous stage waits for it) and W (weight gradient: nobody
waits), and W is moved into what would be bubble.

- ZB-H1: 1F1B's warm-up and steady state with B split from W, and rank r postponing its
  first r W's (it runs W(i - r) after B(i)), so that every rank has p microbatches in flight
  at its peak, as 1F1B's rank 0 has, and B travels back up the pipeline without waiting for
  a W. The postponed W's run in the cool-down, where 1F1B idles. With costs F = B = W the
  bubble time is ``(p - 1) F`` instead of 1F1B's ``3 (p - 1) F``: a third.
- ZB-V: two chunks per rank placed in a V (rank r holds stages r and 2p - 1 - r; see
  `actions`), so each rank holds both the early and the late part of a microbatch's path.
  Rank r warms up with ``2(p - r) - 1`` forwards of chunk 0, then r pairs (chunk-1 forward,
  chunk-0 forward), then ``p - r`` rounds of chunk 1's F, B, W; the steady state runs
  F, B, W of chunk 0 then of chunk 1 per microbatch; the cool-down runs the remaining B's
  (r pairs, then chunk 0's B each with a postponed W) and then the W's left. The phase
  counts are the paper's (section 6); they assume at least 2p - 1 microbatches, and with
  fewer the missing microbatches are left out. With chunk costs F = B = W the only idle time
  is filling the pipe with one chunk forward per rank: bubble ``(p - 1) / (6 m + p - 1)``, the
  least any schedule can have (rank p - 1 starts after p - 1 chunk forwards), while each rank
  holds at most 2p chunk microbatches: p full stages, 1F1B's peak.
"""

from __future__ import annotations

from meshrun.parallel.pipelining.actions import (
    BACKWARD,
    FORWARD,
    V_SHAPE,
    WEIGHT,
    Action,
    Order,
    stage_rank,
)


def gpipe_order(num_ranks: int, n_microbatches: int) -> Order:
    """GPipe: all forwards, then all backwards; one stage per rank (stage r on rank r)."""
    _check(num_ranks, n_microbatches)
    return {r: [Action(r, FORWARD, m) for m in range(n_microbatches)]
            + [Action(r, BACKWARD, m) for m in range(n_microbatches)]
            for r in range(num_ranks)}


def one_f_one_b_order(num_ranks: int, n_microbatches: int) -> Order:
    """1F1B: warm-up forwards, one-forward-one-backward steady state, cool-down backwards."""
    _check(num_ranks, n_microbatches)
    order = {}
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, n_microbatches)
        actions = [Action(r, FORWARD, m) for m in range(warmup)]
        for i in range(n_microbatches - warmup):
            actions += [Action(r, FORWARD, warmup + i), Action(r, BACKWARD, i)]
        actions += [Action(r, BACKWARD, m) for m in range(n_microbatches - warmup,
                                                          n_microbatches)]
        order[r] = actions
    return order


def interleaved_1f1b_order(num_ranks: int, n_microbatches: int, chunks_per_rank: int) -> Order:
    """Interleaved 1F1B over ``chunks_per_rank`` stages per rank (stage ``c * p + r``).

    Raises ValueError when ``n_microbatches`` is not a multiple of ``num_ranks``.
    """
    _check(num_ranks, n_microbatches)
    p, m, v = num_ranks, n_microbatches, chunks_per_rank
    if v < 1:
        raise ValueError(f"interleaved 1F1B: chunks_per_rank must be >= 1 (got {v})")
    if m % p:
        raise ValueError(f"interleaved 1F1B: n_microbatches ({m}) must be a multiple of the "
                         f"number of pipeline ranks ({p})")
    total = m * v

    def unit(k: int, r: int, kind: str) -> Action:
        chunk = (k // p) % v
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        return Action(chunk * p + r, kind, (k // (p * v)) * p + k % p)

    order = {}
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        actions = [unit(k, r, FORWARD) for k in range(warmup)]
        for i in range(total - warmup):
            actions += [unit(warmup + i, r, FORWARD), unit(i, r, BACKWARD)]
        actions += [unit(k, r, BACKWARD) for k in range(total - warmup, total)]
        order[r] = actions
    return order


def zb_h1_order(num_ranks: int, n_microbatches: int) -> Order:
    """ZB-H1: 1F1B with B split from W and rank r's first r W's postponed (stage r on rank r).

    Rank r: ``w = min(p - r - 1, m)`` warm-up forwards; then, for each remaining microbatch,
    F, B and (once r B's are ahead) the oldest pending W; then the cool-down B's, each followed
    by a pending W; then the W's left. Peak activations: p microbatches on every rank (a
    microbatch lives from its F to its W).
    """
    _check(num_ranks, n_microbatches)
    p, m = num_ranks, n_microbatches
    order = {}
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action(r, FORWARD, i) for i in range(warmup)]
        weights = 0  # W's run so far: W(0 .. weights-1)
        for i in range(m):  # B(i), with F(warmup + i) before it while forwards are left
            if warmup + i < m:
                actions.append(Action(r, FORWARD, warmup + i))
            actions.append(Action(r, BACKWARD, i))
            if i >= r:  # r W's stay postponed until the cool-down has room for them
                actions.append(Action(r, WEIGHT, weights))
                weights += 1
        actions += [Action(r, WEIGHT, i) for i in range(weights, m)]
        order[r] = actions
    return order


def zbv_order(num_ranks: int, n_microbatches: int) -> Order:
    """ZB-V over 2p stages in a V: rank r runs stages r (chunk 0) and 2p - 1 - r (chunk 1).

    See the module docstring for the phases. Raises ValueError for fewer than 1 rank or
    microbatch.
    """
    _check(num_ranks, n_microbatches)
    p, m = num_ranks, n_microbatches
    n = max(2 * p - 1, m)  # the phase counts below fill the V with at least 2p - 1
    order = {}
    for r in range(p):
        chunk0, chunk1 = r, 2 * p - 1 - r
        assert stage_rank(chunk1, p, V_SHAPE) == r
        count = {(kind, s): 0 for kind in (FORWARD, BACKWARD, WEIGHT) for s in (chunk0, chunk1)}
        actions = []

        def run(kind, stage, actions=actions, count=count):
            actions.append(Action(stage, kind, count[(kind, stage)]))
            count[(kind, stage)] += 1

        for _ in range(2 * (p - r) - 1):
            run(FORWARD, chunk0)
        for _ in range(r):
            run(FORWARD, chunk1)
            run(FORWARD, chunk0)
        for _ in range(p - r):
            for kind in (FORWARD, BACKWARD, WEIGHT):
                run(kind, chunk1)
        while count[(FORWARD, chunk1)] < n:  # steady state
            if count[(FORWARD, chunk0)] < n:
                run(FORWARD, chunk0)
            run(BACKWARD, chunk0)
            run(WEIGHT, chunk0)
            for kind in (FORWARD, BACKWARD, WEIGHT):
                run(kind, chunk1)
        for _ in range(r):
            run(BACKWARD, chunk0)
            run(BACKWARD, chunk1)
        for _ in range(p - r):
            run(BACKWARD, chunk0)
            run(WEIGHT, chunk0)
        for stage in (chunk1, chunk0):
            while count[(WEIGHT, stage)] < count[(BACKWARD, stage)]:
                run(WEIGHT, stage)
        order[r] = [a for a in actions if a.microbatch < m]
    return order


def forward_only(order: Order) -> Order:
    """The forwards of ``order``, in the same order (an eval step; cannot deadlock if
    ``order`` cannot, since forwards never wait on backwards)."""
    return {r: [a for a in actions if a.kind == FORWARD] for r, actions in order.items()}


def _check(num_ranks: int, n_microbatches: int) -> None:
    if num_ranks < 1 or n_microbatches < 1:
        raise ValueError(f"pipeline order: need >= 1 rank and >= 1 microbatch (got "
                         f"{num_ranks} ranks, {n_microbatches} microbatches)")
