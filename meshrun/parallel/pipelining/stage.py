"""`PipelineStage`: one stage of a pipeline on this rank; `split_into_stages`: make the stages.

A stage is a module that maps the previous stage's output (or the batch, for stage 0) to its
own output (or the model's output, for the last stage); the loss is computed by the schedule on
the last stage. The manual route, as torchtitan does it: the user (or `split_into_stages`)
builds the stage modules; there is no tracer, so any model whose body is a list of blocks can
be split, whatever Python its blocks run.

Between stages travel tensors only: a stage returns a tensor or a tuple of tensors, and the
next stage is called with them as positional arguments. Floating-point tensors carry gradients
back; integer tensors (token ids, masks) travel forward only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import placement as placement_record
from meshrun.parallel._comm import group_device
from meshrun.parallel.pipelining.actions import LOOP, stage_rank

TensorOrTuple = torch.Tensor | tuple[torch.Tensor, ...]


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``, run by this rank of the pipeline ``group``.

    Stage ``s`` belongs on pipeline rank ``s % group_size`` (loop placement), or zig-zags down
    and up the ranks (``placement="v"``, for `ScheduleZBV`: rank r holds stages r and
    2p - 1 - r); with more stages than ranks a rank builds one `PipelineStage` per stage it
    holds.

    Args:
        submodule: the stage's layers, already on ``device``. Its forward takes the previous
            stage's outputs as positional tensors (stage 0: the microbatch's arguments).
        stage_index: 0 <= stage_index < num_stages.
        num_stages: total stages; a multiple of the group size.
        group: the pipeline process group (default: the whole world; a world of one when no
            process group is initialised).
        device: where received tensors are put (default: the submodule's first parameter's
            device, else cpu).
        input_args: optional example of the stage's inputs for one microbatch (a tensor or a
            tuple; only shapes and dtypes matter). When given, the first activation received
            each step is checked against it, and a mismatch is a RuntimeError naming both
            stages instead of a failure deep inside the stage's forward.
        placement: ``"loop"`` (default) or ``"v"``: which rank each stage lives on (see
            `meshrun.parallel.pipelining.actions`).

    Raises:
        ValueError: stage_index out of range, num_stages not a multiple of the group size, or
            the stage does not belong on this rank (the message names the rank it belongs on),
            or an unknown placement.

    Mirrors ``torch.distributed.pipelining.PipelineStage(submodule, stage_index, num_stages,
    device, input_args=None, group=None)``; here ``group`` is the fourth argument and
    ``device`` a keyword, since on CPU and with one device per rank it is implied.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 group: dist.ProcessGroup | None = None, *,
                 device: torch.device | str | None = None,
                 input_args: TensorOrTuple | None = None, placement: str = LOOP):
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: need 0 <= stage_index < num_stages (got "
                             f"stage_index={stage_index}, num_stages={num_stages})")
        if dist.is_initialized():
            group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
        elif group is None:
            group_rank, group_size = 0, 1
        else:
            raise RuntimeError("PipelineStage: a group was given but no process group is "
                               "initialised; call meshrun.parallel.init() first")
        if num_stages % group_size:
            raise ValueError(f"PipelineStage: num_stages ({num_stages}) must be a multiple of "
                             f"the pipeline group size ({group_size})")
        home = stage_rank(stage_index, group_size, placement)
        if home != group_rank:
            rule = f"stage % {group_size}" if placement == LOOP else f"{placement} placement"
            raise ValueError(f"PipelineStage: stage {stage_index} belongs on pipeline rank "
                             f"{home} ({rule}), but this is pipeline rank {group_rank}")
        if device is None:  # the parameters' device; without any, the group's (nccl: CUDA)
            first = next(submodule.parameters(), None)
            device = first.device if first is not None else group_device(group)
        self.submodule = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.group_rank = group_rank
        self.group_size = group_size
        self.placement = placement
        self.device = torch.device(device)
        self.input_meta = None if input_args is None else tensor_meta(as_tuple(input_args))
        for p in submodule.parameters():  # ownership, in each parameter's placement record
            placement_record.record(p, placement_record.of(p).owned_by(stage_index))

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward_one(self, microbatch: int, args: tuple, kwargs: dict) -> TensorOrTuple:
        """Run the submodule on one microbatch; an error names the stage and the inputs."""
        try:
            return self.submodule(*args, **kwargs)
        except Exception as e:
            shapes = ", ".join(_describe(a) for a in args)
            source = "the batch" if self.is_first else f"stage {self.stage_index - 1}"
            raise RuntimeError(
                f"pipeline stage {self.stage_index} (pipeline rank {self.group_rank}): forward "
                f"of microbatch {microbatch} failed on inputs [{shapes}] from {source}: "
                f"{type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return (f"PipelineStage({type(self.submodule).__name__}, stage {self.stage_index} of "
                f"{self.num_stages}, pipeline rank {self.group_rank} of {self.group_size})")


class StageModule(nn.Module):
    """A contiguous slice of a model: optional ``first`` module, some blocks, optional ``last``.

    ``forward(x) = last(blocks[-1](...blocks[0](first(x))))``. Blocks keep their index in the
    original body as their name (``blocks.2.attn.weight`` stays ``blocks.2.attn.weight``), so
    parameter names of the stages are those of the unsplit model under ``blocks.``.
    """

    def __init__(self, blocks: dict[int, nn.Module], first: nn.Module | None = None,
                 last: nn.Module | None = None):
        super().__init__()
        self.first = first
        self.blocks = nn.ModuleDict({str(i): b for i, b in blocks.items()})
        self.last = last

    def forward(self, *args):
        x = self.first(*args) if self.first is not None else _unpack(args)
        for block in self.blocks.values():
            x = block(*x) if isinstance(x, tuple) else block(x)
        if self.last is not None:
            x = self.last(*x) if isinstance(x, tuple) else self.last(x)
        return x


def split_into_stages(blocks: Sequence[nn.Module], num_stages: int, *,
                      first: nn.Module | None = None, last: nn.Module | None = None,
                      costs: Sequence[float] | Callable[[nn.Module], float] | None = None
                      ) -> list[StageModule]:
    """Split a model body (a list of blocks) into ``num_stages`` balanced contiguous stages.

    Stage 0 also runs ``first`` (the embedding), the last stage also runs ``last`` (the final
    norm and head). The blocks are partitioned into contiguous runs that minimise the largest
    stage cost (exact dynamic programme over the O(L^2 S) split points, L blocks, S stages);
    with equal costs and L divisible by S every stage gets L / S blocks.

    Args:
        blocks: the body, e.g. ``model.layers`` (an ``nn.ModuleList``/``nn.Sequential``).
        num_stages: how many stages, 1 <= num_stages <= len(blocks).
        first: module run before the first block, on stage 0 (shared, not copied).
        last: module run after the last block, on the last stage (shared, not copied).
        costs: per-block cost (any unit, e.g. FLOPs or measured seconds), as a sequence or a
            function of the block; default 1 per block. ``first``/``last`` are not counted.

    Returns:
        ``num_stages`` `StageModule` objects that share the given modules (no copy): build the
        model once, split it, and keep the stages this rank holds.

    Raises:
        ValueError: fewer blocks than stages, or a costs sequence of the wrong length.

    The manual split of torchtitan's ``pipeline_module_split``; the balancing is the classic
    linear partition problem.
    """
    blocks = list(blocks)
    if not 1 <= num_stages <= len(blocks):
        raise ValueError(f"split_into_stages: need 1 <= num_stages <= number of blocks (got "
                         f"num_stages={num_stages}, {len(blocks)} blocks)")
    if costs is None:
        weights = [1.0] * len(blocks)
    elif callable(costs):
        weights = [float(costs(b)) for b in blocks]
    else:
        weights = [float(c) for c in costs]
        if len(weights) != len(blocks):
            raise ValueError(f"split_into_stages: {len(weights)} costs for {len(blocks)} blocks")
    bounds = _partition(weights, num_stages)
    stages = []
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        stages.append(StageModule({i: blocks[i] for i in range(lo, hi)},
                                  first if s == 0 else None,
                                  last if s == num_stages - 1 else None))
    return stages


# -------------------------------------------------------------------------------------------
# helpers


def _partition(weights: list[float], k: int) -> list[int]:
    """Boundaries [0, b1, ..., L] of k non-empty contiguous parts minimising the largest sum.

    Ties go to the split that puts more blocks on later stages (stage 0 also runs the
    embedding and sends first, so it is the one to keep light)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[j][i]: first i blocks in j parts
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for c in range(j - 1, i):
                if best[j - 1][c] == inf:
                    continue
                value = max(best[j - 1][c], prefix[i] - prefix[c])
                if value < best[j][i] - 1e-12 * (1 + abs(value)):  # <: earliest cut wins ties
                    best[j][i], cut[j][i] = value, c
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    return bounds[::-1]


def as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def tensor_meta(tensors: Sequence[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def _unpack(args: tuple):
    return args[0] if len(args) == 1 else args


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return type(value).__name__
