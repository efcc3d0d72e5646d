"""The named schedules (as torch.distributed.pipelining names them) and `pipeline()`.

Each is a `PipelineSchedule` whose ``pipeline_order`` comes from `orders`: the runtime is the
same, only the action lists differ. Use `PipelineSchedule(stages, n, loss_fn, order=...)`
directly for a hand-written order; it is validated the same way.

=========================  ==========================  ===============  ==================
schedule                   stages per rank             bubble           activations/rank
=========================  ==========================  ===============  ==================
`ScheduleGPipe`            1                           (p-1)/(m+p-1)    m
`Schedule1F1B`             1                           (p-1)/(m+p-1)    p - r (<= p)
`ScheduleInterleaved1F1B`  v (stages r, r+p, ...)      (p-1)/(vm+p-1)   about p + (v-1)p/2
`ScheduleZBH1`             1                           (p-1)/(3m+p-1)   p
`ScheduleZBV`              2 (stages r, 2p-1-r)        (p-1)/(6m+p-1)   2p chunks (p stages)
=========================  ==========================  ===============  ==================

The zero-bubble bubbles assume equal F, B (input gradient) and W (weight gradient) costs
(see `simulate.zero_bubble_formula` for other costs); activations are counted from F to W.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch import nn

from meshrun.parallel.pipelining.actions import LOOP, V_SHAPE, stage_rank
from meshrun.parallel.pipelining.orders import (
    gpipe_order,
    interleaved_1f1b_order,
    one_f_one_b_order,
    zb_h1_order,
    zbv_order,
)
from meshrun.parallel.pipelining.runtime import PipelineSchedule
from meshrun.parallel.pipelining.stage import PipelineStage


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards (Huang et al., 2019).

    Args:
        stage: this rank's only `PipelineStage` (num_stages == pipeline group size).
        n_microbatches: microbatches per step.
        loss_fn: ``loss_fn(output, target)``, mean over the microbatch.
        scale_grads: see `PipelineSchedule`.

    Raises:
        ValueError: the stage is one of several on this rank (use ScheduleInterleaved1F1B).

    Mirrors ``torch.distributed.pipelining.ScheduleGPipe``.
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable | None = None, *, scale_grads: bool = True):
        _one_stage_per_rank(stage, "ScheduleGPipe")
        super().__init__([stage], n_microbatches, loss_fn, scale_grads=scale_grads,
                         order=gpipe_order(stage.group_size, n_microbatches))


class Schedule1F1B(PipelineSchedule):
    """1F1B (PipeDream-Flush): warm-up, one forward one backward, cool-down.

    Same arguments and errors as `ScheduleGPipe`; a rank holds at most p microbatches of
    activations instead of m. Mirrors ``torch.distributed.pipelining.Schedule1F1B``
    (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021).
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable | None = None, *, scale_grads: bool = True):
        _one_stage_per_rank(stage, "Schedule1F1B")
        super().__init__([stage], n_microbatches, loss_fn, scale_grads=scale_grads,
                         order=one_f_one_b_order(stage.group_size, n_microbatches))


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: v stages per rank, bubble ``(p-1)/(v m + p - 1)``.

    Args:
        stages: this rank's stages r, r + p, ..., r + (v-1)p (any order).
        n_microbatches: microbatches per step, a multiple of the pipeline group size p.
        loss_fn, scale_grads: see `PipelineSchedule`.

    Raises:
        ValueError: n_microbatches not a multiple of p, or stages that are not exactly this
            rank's v stages.

    Mirrors ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` (Megatron-LM's virtual
    pipeline; Narayanan et al., SC 2021).
    """

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, *, scale_grads: bool = True):
        stages = list(stages)
        if not stages:
            raise ValueError("ScheduleInterleaved1F1B: give this rank's stages")
        p = stages[0].group_size
        order = interleaved_1f1b_order(p, n_microbatches, stages[0].num_stages // p)
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=scale_grads, order=order)


class ScheduleZBH1(PipelineSchedule):
    """ZB-H1: 1F1B with the backward split into B and W, W's postponed into the bubble.

    Same arguments and errors as `ScheduleGPipe`. B (the input gradient) travels back up the
    pipeline without waiting for W (the weight gradient); rank r postpones its first r W's to
    the cool-down, where 1F1B idles. With equal F, B and W costs the bubble is a third of
    1F1B's, ``(p-1)/(3m+p-1)``, and every rank holds at most p microbatches of activations
    (1F1B's rank 0 does too). See `orders.zb_h1_order` and `split_backward`.

    Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (section 2.1). torch has no
    class of this name; its ``ScheduleInterleavedZeroBubble`` with one stage per rank is the
    nearest.
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable | None = None, *, scale_grads: bool = True):
        _one_stage_per_rank(stage, "ScheduleZBH1")
        super().__init__([stage], n_microbatches, loss_fn, scale_grads=scale_grads,
                         order=zb_h1_order(stage.group_size, n_microbatches))


class ScheduleZBV(PipelineSchedule):
    """ZB-V: two stages per rank in a V shape, the backward split into B and W.

    Args:
        stages: this rank's two stages r and 2p - 1 - r of 2p, built with
            ``PipelineStage(..., placement="v")`` (any order).
        n_microbatches: microbatches per step; at least 2p - 1 for the full steady state
            (fewer run, with more bubble).
        loss_fn, scale_grads: see `PipelineSchedule`.

    Raises:
        ValueError: not exactly this rank's two stages of 2p, or stages not built with the
            "v" placement.
        NotImplementedError: a backend other than gloo (see `PipelineSchedule`).

    Each rank holds the first and the last part of the model, so the loss is computed on
    rank 0, next to the input. With equal F, B and W costs per chunk the only idle time is
    the pipe filling with one chunk forward per rank: bubble ``(p-1)/(6m+p-1)``, which the
    paper rounds to zero, at 1F1B's peak activation memory (2p chunks = p stages).

    Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (section 6). Mirrors
    ``torch.distributed.pipelining.ScheduleZBVZeroBubble`` (same phases; torch's name).
    """

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, *, scale_grads: bool = True):
        stages = list(stages)
        if not stages or not all(isinstance(st, PipelineStage) for st in stages):
            raise ValueError("ScheduleZBV: give this rank's two PipelineStage objects")
        p, num_stages = stages[0].group_size, stages[0].num_stages
        if num_stages != 2 * p or len(stages) != 2:
            raise ValueError(f"ScheduleZBV: needs exactly 2 stages per rank, 2p = {2 * p} in "
                             f"all (got {len(stages)} stage(s) here of {num_stages})")
        if any(st.placement != V_SHAPE for st in stages):
            r = stages[0].group_rank
            raise ValueError(f"ScheduleZBV: build the stages with PipelineStage(..., "
                             f"placement='v') (rank {r} holds stages {r} and {2 * p - 1 - r})")
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=scale_grads,
                         order=zbv_order(p, n_microbatches))


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved1f1b": ScheduleInterleaved1F1B, "zbh1": ScheduleZBH1,
             "zbv": ScheduleZBV}
STAGES_PER_RANK = {"interleaved1f1b": None, "zbv": 2}  # the others: 1 (None: any)


def pipeline(stage_modules: Sequence[nn.Module], group: dist.ProcessGroup | None = None, *,
             schedule: str = "1f1b", n_microbatches: int, loss_fn: Callable | None = None,
             device=None) -> PipelineSchedule:
    """Build this rank's stages from the list of all stage modules and return the schedule.

    Args:
        stage_modules: every stage's module, in order (e.g. from `split_into_stages`); this
            rank keeps stages ``rank, rank + p, ...`` of the pipeline ``group``.
        group: the pipeline process group (e.g. ``mesh.group("pp")``; default: the world).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved1f1b"``, ``"zbh1"`` or ``"zbv"``
            (case-insensitive; ``-`` and ``_`` ignored). ``"zbv"`` needs 2p stages.
        n_microbatches, loss_fn: see `PipelineSchedule`.
        device: see `PipelineStage`.

    Returns:
        The schedule; ``schedule.stages[i].submodule`` are this rank's modules (give their
        parameters to the optimizer).

    Raises:
        ValueError: unknown schedule name, a stage count the schedule cannot place
            (GPipe, 1F1B and ZB-H1: one stage per rank; interleaved: a multiple of the group
            size; ZB-V: two per rank),
            or a parameter shared by stages on different ranks (see
            `check_no_shared_parameters`).
    """
    name = schedule.lower().replace("_", "").replace("-", "")
    if name not in SCHEDULES:
        raise ValueError(f"pipeline: unknown schedule {schedule!r} (choose from "
                         f"{', '.join(SCHEDULES)})")
    num_stages = len(stage_modules)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if num_stages % size:
        raise ValueError(f"pipeline: {num_stages} stages cannot be placed on {size} pipeline "
                         f"ranks (need a multiple)")
    per_rank = STAGES_PER_RANK.get(name, 1)
    if per_rank is not None and num_stages != per_rank * size:
        raise ValueError(f"pipeline: schedule {schedule!r} runs {per_rank} stage(s) per rank, "
                         f"but there are {num_stages} stages on {size} ranks; give "
                         f"{per_rank * size} stages (or use 'interleaved1f1b')")
    placement = V_SHAPE if name == "zbv" else LOOP
    check_no_shared_parameters(stage_modules, size, placement)
    stages = [PipelineStage(stage_modules[s], s, num_stages, group, device=device,
                            placement=placement)
              for s in range(num_stages) if stage_rank(s, size, placement) == rank]
    if per_rank == 1:
        return SCHEDULES[name](stages[0], n_microbatches, loss_fn)
    return SCHEDULES[name](stages, n_microbatches, loss_fn)


def check_no_shared_parameters(stage_modules: Sequence[nn.Module], num_ranks: int,
                               placement: str = LOOP) -> None:
    """Refuse a parameter that stages on different pipeline ranks share.

    Each rank would train its own copy and the copies would drift apart silently. The usual
    case is an input embedding tied to the output layer (first and last stage). Keeping such
    a pair tied would need their gradients summed across the two ranks every step, which
    meshrun's pipeline does not do yet; untie them (give the output layer its own weight)
    or keep both stages on one rank. Stage ``s`` runs on rank ``s % num_ranks`` (loop
    placement; with ``placement="v"``, see `actions`: there the first and last stage share
    rank 0, so an embedding tied to the head is allowed).

    Raises:
        ValueError: naming both places of the first shared parameter found.
    """
    owner: dict[int, tuple[int, str]] = {}
    for s, module in enumerate(stage_modules):
        for name, p in module.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (s, name))
            if (stage_rank(first[0], num_ranks, placement)
                    != stage_rank(s, num_ranks, placement)):
                raise ValueError(
                    f"pipeline: parameter {first[1]!r} of stage {first[0]} is also {name!r} of "
                    f"stage {s}, on another pipeline rank; each rank would train its own copy. "
                    f"Untie them (e.g. give the output layer its own weight) or place both "
                    f"stages on one rank")


def _one_stage_per_rank(stage: PipelineStage, name: str) -> None:
    if not isinstance(stage, PipelineStage):
        raise ValueError(f"{name}: expected one PipelineStage (got {type(stage).__name__}); "
                         f"for several stages per rank use ScheduleInterleaved1F1B")
    if stage.num_stages != stage.group_size:
        raise ValueError(f"{name}: runs one stage per rank, but there are {stage.num_stages} "
                         f"stages on {stage.group_size} ranks; use ScheduleInterleaved1F1B")
