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
"""

from __future__ import annotations

from meshrun.parallel.pipelining.actions import BACKWARD, FORWARD, Action, Order


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


def forward_only(order: Order) -> Order:
    """The forwards of ``order``, in the same order (an eval step; cannot deadlock if
    ``order`` cannot, since forwards never wait on backwards)."""
    return {r: [a for a in actions if a.kind == FORWARD] for r, actions in order.items()}


def _check(num_ranks: int, n_microbatches: int) -> None:
    if num_ranks < 1 or n_microbatches < 1:
        raise ValueError(f"pipeline order: need >= 1 rank and >= 1 microbatch (got "
                         f"{num_ranks} ranks, {n_microbatches} microbatches)")
