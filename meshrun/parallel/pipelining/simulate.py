"""`simulate`: the timeline, bubble and activation memory of a pipeline order, from costs alone.

Runs in one process with no process group. Each rank runs its actions in order; an action
starts when its rank is free and the actions it depends on have finished (plus a message delay
when they ran on another rank), exactly the waits of the runtime (see `validate`).

Bubble: the fraction of the ranks' time spent idle,
``bubble = 1 - sum(busy_r) / (p * makespan)``. With equal stage costs (forward t_f, backward
t_b per full stage) and no message delay the known results are (Huang et al., GPipe, 2019;
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", 2021):

- GPipe and 1F1B: makespan ``(m + p - 1)(t_f + t_b)``, bubble ``(p - 1) / (m + p - 1)``.
- Interleaved 1F1B with v chunks per rank (each chunk costs 1/v of a stage): makespan
  ``m (t_f + t_b) + (p - 1)(t_f + t_b) / v``, bubble ``(p - 1) / (v m + p - 1)``.
- Split backward (zero-bubble; Qi et al., ICLR 2024): a full backward ``t_b`` splits into B
  (input gradient, ``t_b - t_w``) and W (weight gradient, ``t_w``). ZB-H1 (F, B, W of a stage
  costing ``t_f, t_B, t_w``, ``t_w <= t_f``): makespan ``m (t_f + t_B + t_w) + (p - 1)(t_f +
  t_B - t_w)``; with all three equal the bubble time is a third of 1F1B's. ZB-V (chunk costs
  all equal to t): makespan ``(6 m + p - 1) t``; with a chunk's B dearer than its F,
  ``2 m (t_f + t_B + t_w) + (p - 1) t_B``. See `zero_bubble_formula`.

Activation memory: a microbatch's activations live on a stage from its forward to its
backward (to its W when the backward is split: W still needs the layer inputs);
``peak_activations[r]`` is the most microbatch-stages alive at once on rank r (GPipe: m;
1F1B and ZB-H1: at most p; with v chunks the count is in chunk units).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshrun.parallel.pipelining.actions import BACKWARD, FORWARD, WEIGHT, Action, Order
from meshrun.parallel.pipelining.validate import run_order

Cost = float | Sequence[float]  # one value for every stage, or one per stage


@dataclass(frozen=True)
class Simulation:
    """What `simulate` found.

    Attributes:
        makespan: time from the first action's start to the last action's finish (cost units,
            e.g. seconds if the costs are seconds).
        busy: rank -> total time spent computing.
        bubble_fraction: ``1 - sum(busy) / (num_ranks * makespan)``, in [0, 1).
        peak_activations: rank -> most microbatch-stages whose forward has run and whose
            backward has not, at any point of that rank's order.
        times: action -> (start, finish).
    """

    makespan: float
    busy: dict[int, float]
    bubble_fraction: float
    peak_activations: dict[int, int]
    times: dict[Action, tuple[float, float]]


def simulate(order: Order, num_stages: int | None = None, *, forward: Cost = 1.0,
             backward: Cost = 2.0, weight: Cost | None = None, comm: float = 0.0,
             cost: Callable[[Action], float] | None = None) -> Simulation:
    """Simulate one step of ``order``; return its timeline, bubble and activation peaks.

    Args:
        order: pipeline rank -> list of `Action` (a validated order; see `validate_schedule`).
        num_stages: total stages (default: the largest stage index in ``order`` plus one).
        forward: cost of one microbatch's forward, for every stage or per stage (sequence
            indexed by stage). Any time unit; the bubble fraction is unitless.
        backward: the same for the whole backward (default 2: a backward is about two
            forwards).
        weight: the part of ``backward`` that is the weight gradient (default: half of it).
            Where the order splits a stage's backward, its W costs ``weight`` and its B
            ``backward - weight``; an unsplit B costs ``backward``.
        comm: delay of each message between two ranks, same unit.
        cost: overrides ``forward``/``backward``/``weight``: ``cost(action) -> float``.

    Raises:
        ScheduleError: the order deadlocks (see `validate_schedule` for the full checks).
        ValueError: a per-stage cost sequence shorter than ``num_stages``, or a weight cost
            above the backward's.
    """
    if num_stages is None:
        num_stages = 1 + max(a.stage for actions in order.values() for a in actions)
    if cost is None:
        fwd, bwd = _per_stage(forward, num_stages, "forward"), _per_stage(backward, num_stages,
                                                                          "backward")
        wgt = ([b / 2 for b in bwd] if weight is None
               else _per_stage(weight, num_stages, "weight"))
        if any(w > b for w, b in zip(wgt, bwd, strict=False)):
            raise ValueError(f"simulate: the weight gradient is part of the backward, so weight "
                             f"<= backward (got weight {wgt[:num_stages]}, backward "
                             f"{bwd[:num_stages]})")
        split = split_stages(order)

        def cost(action: Action) -> float:
            s = action.stage
            if action.kind == FORWARD:
                return fwd[s]
            if action.kind == WEIGHT:
                return wgt[s]
            return bwd[s] - wgt[s] if s in split else bwd[s]

    times = run_order(order, num_stages, (cost, lambda src, dst: comm))
    makespan = max((f for _, f in times.values()), default=0.0)
    busy = {r: sum(times[a][1] - times[a][0] for a in actions) for r, actions in order.items()}
    bubble = 1.0 - sum(busy.values()) / (len(order) * makespan) if makespan else 0.0
    return Simulation(makespan, busy, bubble, peak_activations(order), times)


def split_stages(order: Order) -> set[int]:
    """The stages whose backward ``order`` splits into B and W (those with W actions)."""
    return {a.stage for actions in order.values() for a in actions if a.kind == WEIGHT}


def peak_activations(order: Order) -> dict[int, int]:
    """Rank -> the most microbatch-stages alive (forward run; backward, or W where the
    backward is split, not yet) at once."""
    split = split_stages(order)
    peaks = {}
    for r, actions in order.items():
        alive = peak = 0
        for a in actions:
            if a.kind == FORWARD:
                alive += 1
            elif a.kind == WEIGHT or (a.kind == BACKWARD and a.stage not in split):
                alive -= 1
            peak = max(peak, alive)
        peaks[r] = peak
    return peaks


def bubble_formula(num_ranks: int, n_microbatches: int, chunks_per_rank: int = 1) -> float:
    """The textbook bubble fraction ``(p - 1) / (v m + p - 1)`` (v = 1: GPipe and 1F1B).
    Raises ValueError unless p, m and v are positive integers."""
    p, m, v = _counts("bubble_formula", num_ranks=num_ranks, n_microbatches=n_microbatches,
                      chunks_per_rank=chunks_per_rank)
    return (p - 1) / (v * m + p - 1)


def zero_bubble_formula(schedule: str, num_ranks: int, n_microbatches: int, *,
                        forward: float = 1.0, backward_input: float = 1.0,
                        weight: float = 1.0) -> float:
    """The bubble fraction of ZB-H1 or ZB-V from the costs of one F, B (input gradient) and W.

    Args:
        schedule: ``"zbh1"`` or ``"zbv"``.
        num_ranks, n_microbatches: p and m; the formulas are those of the full steady state,
            which needs m >= p (ZB-H1) or m >= 2p - 1 (ZB-V).
        forward, backward_input, weight: t_F, t_B, t_W of one stage (ZB-H1) or one chunk
            (ZB-V), any unit, any real numbers >= 0.

    ZB-H1: each rank works ``m (t_F + t_B + t_W)`` and idles ``(p - 1) max(t_F, t_B, t_F +
    t_B - t_W)``. Qi et al. (ICLR 2024, section 2.1) give ``(p - 1)(t_F + t_B - t_W)``, for
    ``t_W <= t_F``: a W fills part of each rank's wait. Where W costs at least the cheaper of
    F and B it fills no more than that, and the idle time stays at ``(p - 1) max(t_F, t_B)``
    (the max is the simulator's finding, not the paper's). Exact for any costs and m >= p:
    checked against `simulate` with seeded random costs in
    ``tests/parallel/test_pp_schedules.py``.

    ZB-V (section 6 gives only ``t_F = t_B = t_W``, and rounds the bubble to zero): each rank
    works ``2 m (t_F + t_B + t_W)`` and idles ``(p - 1) max(t_F, t_B)``. The idle time is what
    rank p - 1, the bottom of the V (stages p - 1 and p), cannot avoid: its first forward
    waits for p - 1 chunk forwards, ``(p - 1) t_F``; after its 2p warm-up forwards (busy until
    ``(3p - 1) t_F``) its first backward, stage p's B of microbatch 0, waits for that
    microbatch's forward through all 2p chunks and its B back through the p - 1 chunks above,
    ``2p t_F + (p - 1) t_B``: ``(p - 1)(t_B - t_F)`` more when ``t_B > t_F``. So this is a
    lower bound for any chunk costs, and the V's steady state then keeps that rank busy to the
    end, which makes it exact (the makespan is ``2 m (t_F + t_B + t_W) + (p - 1) max(t_F,
    t_B)``) when ``t_F <= t_B`` and ``t_B / 2 <= t_W <= t_B`` (any ``t_W >= t_B / 2`` for
    p = 2): checked against `simulate` with seeded random costs in
    ``tests/parallel/test_pp_schedules.py``. Outside that region other ranks wait too (a B
    cheaper than its F, too little W to fill the V's gaps, or a W much dearer than its B)
    and the formula is below the simulator's bubble.

    Raises:
        ValueError: another schedule name; p or m not a positive integer, or m below the
            steady state's minimum; a cost that is negative, not finite or not a real
            number, or all three zero.
    """
    p, m = _counts("zero_bubble_formula", num_ranks=num_ranks, n_microbatches=n_microbatches)
    f, b, w = (_cost(name, value) for name, value in (
        ("forward", forward), ("backward_input", backward_input), ("weight", weight)))
    if f + b + w == 0:
        raise ValueError("zero_bubble_formula: forward, backward_input and weight are all 0; "
                         "give the measured cost of at least one")
    if schedule not in ("zbh1", "zbv"):
        raise ValueError(f"zero_bubble_formula: schedule must be 'zbh1' or 'zbv' (got "
                         f"{schedule!r})")
    try:
        if schedule == "zbh1":
            least, idle, work = p, (p - 1) * max(f, b, f + b - w), m * (f + b + w)
        else:
            least, idle, work = 2 * p - 1, (p - 1) * max(f, b), 2 * m * (f + b + w)
    except OverflowError:  # p or m too large for a float
        least, idle, work = 1, math.inf, math.inf
    if m < least:
        raise ValueError(f"zero_bubble_formula: {schedule} with {p} ranks needs at least "
                         f"{least} microbatches for the steady state the formula describes "
                         f"(got {m}); `simulate` the schedule instead")
    if not math.isfinite(work + idle):
        raise ValueError(f"zero_bubble_formula: costs too large to add up ({f!r}, {b!r}, "
                         f"{w!r}); give them in a larger unit")
    return idle / (work + idle)


def _counts(where: str, **counts) -> list[int]:
    """Each count as an int (numpy and torch integers too); ValueError unless positive."""
    values = []
    for name, value in counts.items():
        try:
            if isinstance(value, bool):
                raise TypeError
            number = operator.index(value)
        except TypeError:
            number = None
        if number is None or number < 1:
            raise ValueError(f"{where}: {name} must be a positive integer (got {value!r})")
        values.append(number)
    return values


def _cost(name: str, value) -> float:
    """``value`` as a float (numpy and torch scalars too); ValueError unless finite, >= 0."""
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"zero_bubble_formula: {name} must be a finite cost >= 0 "
                         f"(got {value!r})")
    return number


def _per_stage(value: Cost, num_stages: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_stages
    values = [float(v) for v in value]
    if len(values) < num_stages:
        raise ValueError(f"simulate: {what} costs give {len(values)} values for {num_stages} "
                         f"stages; give one per stage or a single number")
    return values
