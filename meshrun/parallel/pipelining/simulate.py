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

Activation memory: a microbatch's activations live on a stage from its forward to its
backward; ``peak_activations[r]`` is the most microbatch-stages alive at once on rank r
(GPipe: m; 1F1B: p - r, at most p; with v chunks the count is in chunk units).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshrun.parallel.pipelining.actions import FORWARD, Action, Order
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
             backward: Cost = 2.0, comm: float = 0.0,
             cost: Callable[[Action], float] | None = None) -> Simulation:
    """Simulate one step of ``order``; return its timeline, bubble and activation peaks.

    Args:
        order: pipeline rank -> list of `Action` (a validated order; see `validate_schedule`).
        num_stages: total stages (default: the largest stage index in ``order`` plus one).
        forward: cost of one microbatch's forward, for every stage or per stage (sequence
            indexed by stage). Any time unit; the bubble fraction is unitless.
        backward: the same for backward (default 2: a backward is about two forwards).
        comm: delay of each message between two ranks, same unit.
        cost: overrides ``forward``/``backward``: ``cost(action) -> float``.

    Raises:
        ScheduleError: the order deadlocks (see `validate_schedule` for the full checks).
        ValueError: a per-stage cost sequence shorter than ``num_stages``.
    """
    if num_stages is None:
        num_stages = 1 + max(a.stage for actions in order.values() for a in actions)
    if cost is None:
        fwd, bwd = _per_stage(forward, num_stages, "forward"), _per_stage(backward, num_stages,
                                                                          "backward")

        def cost(action: Action) -> float:
            return (fwd if action.kind == FORWARD else bwd)[action.stage]

    times = run_order(order, num_stages, (cost, lambda src, dst: comm))
    makespan = max((f for _, f in times.values()), default=0.0)
    busy = {r: sum(times[a][1] - times[a][0] for a in actions) for r, actions in order.items()}
    bubble = 1.0 - sum(busy.values()) / (len(order) * makespan) if makespan else 0.0
    return Simulation(makespan, busy, bubble, peak_activations(order), times)


def peak_activations(order: Order) -> dict[int, int]:
    """Rank -> the most microbatch-stages alive (forward run, backward not yet) at once."""
    peaks = {}
    for r, actions in order.items():
        alive = peak = 0
        for a in actions:
            alive += 1 if a.kind == FORWARD else -1
            peak = max(peak, alive)
        peaks[r] = peak
    return peaks


def bubble_formula(num_ranks: int, n_microbatches: int, chunks_per_rank: int = 1) -> float:
    """The textbook bubble fraction ``(p - 1) / (v m + p - 1)`` (v = 1: GPipe and 1F1B)."""
    p, m, v = num_ranks, n_microbatches, chunks_per_rank
    return (p - 1) / (v * m + p - 1)


def _per_stage(value: Cost, num_stages: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_stages
    values = [float(v) for v in value]
    if len(values) < num_stages:
        raise ValueError(f"simulate: {what} costs give {len(values)} values for {num_stages} "
                         f"stages; give one per stage or a single number")
    return values
