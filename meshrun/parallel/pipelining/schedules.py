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
=========================  ==========================  ===============  ==================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch import nn

from meshrun.parallel.pipelining.orders import (
    gpipe_order,
    interleaved_1f1b_order,
    one_f_one_b_order,
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


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved1f1b": ScheduleInterleaved1F1B}


def pipeline(stage_modules: Sequence[nn.Module], group: dist.ProcessGroup | None = None, *,
             schedule: str = "1f1b", n_microbatches: int, loss_fn: Callable | None = None,
             device=None) -> PipelineSchedule:
    """Build this rank's stages from the list of all stage modules and return the schedule.

    Args:
        stage_modules: every stage's module, in order (e.g. from `split_into_stages`); this
            rank keeps stages ``rank, rank + p, ...`` of the pipeline ``group``.
        group: the pipeline process group (e.g. ``mesh.group("pp")``; default: the world).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved1f1b"`` (case-insensitive).
        n_microbatches, loss_fn: see `PipelineSchedule`.
        device: see `PipelineStage`.

    Returns:
        The schedule; ``schedule.stages[i].submodule`` are this rank's modules (give their
        parameters to the optimizer).

    Raises:
        ValueError: unknown schedule name, a stage count the schedule cannot place
            (GPipe and 1F1B: one stage per rank; interleaved: a multiple of the group size),
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
    check_no_shared_parameters(stage_modules, size)
    stages = [PipelineStage(stage_modules[s], s, num_stages, group, device=device)
              for s in range(rank, num_stages, size)]
    if name == "interleaved1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn)
    if len(stages) != 1:
        raise ValueError(f"pipeline: schedule {schedule!r} runs one stage per rank, but there "
                         f"are {num_stages} stages on {size} ranks; use 'interleaved1f1b' or "
                         f"{size} stages")
    return SCHEDULES[name](stages[0], n_microbatches, loss_fn)


def check_no_shared_parameters(stage_modules: Sequence[nn.Module], num_ranks: int) -> None:
    """Refuse a parameter that stages on different pipeline ranks share.

    Each rank would train its own copy and the copies would drift apart silently. The usual
    case is an input embedding tied to the output layer (first and last stage). Keeping such
    a pair tied would need their gradients summed across the two ranks every step, which
    meshrun's pipeline does not do yet; untie them (give the output layer its own weight)
    or keep both stages on one rank. Stage ``s`` runs on rank ``s % num_ranks``.

    Raises:
        ValueError: naming both places of the first shared parameter found.
    """
    owner: dict[int, tuple[int, str]] = {}
    for s, module in enumerate(stage_modules):
        for name, p in module.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (s, name))
            if first[0] % num_ranks != s % num_ranks:
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
