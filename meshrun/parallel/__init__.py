"""meshrun.parallel: the worker-side library (docs/design.md §4).

Imported by training scripts, never by the launcher. Each strategy is a function applied to a
model with an explicit process group or mesh; there are no module-level global groups.

- `init()` -> `ParallelContext`: join the process group described by the torchrun env.
- `Mesh`: named N-D mesh of ranks, one process group per axis.
- `ddp()`: data parallelism with bucketed, overlapped gradient all-reduce;
  ``model.register_comm_hook`` with `comm_hooks` (fp16/bf16 compression, PowerSGD).
- `agree_num_batches()`: uneven inputs; every rank runs the minimum number of batches.
- `fully_shard()` + `MixedPrecisionPolicy`, `clip_grad_norm_()`: FSDP (ZeRO-3), parameters
  sharded on dim 0, named as torch's FSDP2; ``offload_policy=CPUOffloadPolicy()`` keeps
  shards, gradients and optimizer state on the host.
- `placement`: one record per parameter (global shape, the pieces this rank holds, which group
  cuts which dim, the owning pipeline stage); the strategies write it, everything else reads
  it. So ``model.state_dict()`` holds DTensors of the unsplit shapes (TP, FSDP, TP x FSDP:
  torch DCP saves the unsplit model) and `full_state_dict()` gathers full tensors onto the
  first rank, at any layout.
- `checkpoint_activations()`: recompute a module's activations in backward (full, or
  selective: keep matmul and attention outputs), composable with every strategy.
- `gradient_sync()`: switch gradient synchronisation off for the first backwards of an
  accumulation, under FSDP or DDP alike.
- `checkpoint` (``save``, ``load``, ``latest``, ``model_state``, ``optimizer_state``):
  distributed checkpoints that reshard on load (`placement` says which blocks a rank holds).
- `elastic.steps()`: a training loop that survives a lost or joining node in place (the
  survivors change world and retry the step; opt-in with the ``meshrun`` agent, see
  docs/faults.md "Recovery in place").
- `heartbeat()`: progress for ``meshrun --hang-timeout`` (the strategies call it every step);
  `busy()`: long work that is not a step (an evaluation; checkpoint save and load use it).
- `parallelize()` + `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`, ...: tensor and
  sequence parallelism (Megatron); `vocab_parallel_cross_entropy()`; `RNGTracker`.
- `PipelineStage`, `split_into_stages()`, `ScheduleGPipe`, `Schedule1F1B`,
  `ScheduleInterleaved1F1B`, the zero-bubble `ScheduleZBH1` and `ScheduleZBV`, `pipeline()`:
  pipeline parallelism; schedules are validated action
  lists (`meshrun.parallel.pipelining` also has the validator and the simulator).
- `ring_attention()`, `ulysses_attention()`, `shard_sequence()`, `position_ids()`: context
  parallelism (attention over a sequence sharded across a "cp" axis; `meshrun.parallel.cp`).
"""

from meshrun.parallel.activation_checkpoint import checkpoint_activations
from meshrun.parallel.context import ParallelContext, init
from meshrun.parallel.cp import (
    position_ids,
    ring_attention,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from meshrun.parallel.ddp import agree_num_batches, ddp
from meshrun.parallel.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    clip_grad_norm_,
    full_state_dict,
    fully_shard,
)
from meshrun.parallel.grad_sync import gradient_sync
from meshrun.parallel.heartbeat import busy, heartbeat
from meshrun.parallel.mesh import Mesh
from meshrun.parallel.pipelining import (
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBH1,
    ScheduleZBV,
    pipeline,
    split_into_stages,
)
from meshrun.parallel.tp import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RNGTracker,
    RowwiseParallel,
    SequenceParallel,
    ShardedDropout,
    full_tensor,
    parallelize,
    vocab_parallel_cross_entropy,
)

__all__ = ["ColwiseParallel", "Mesh", "ParallelContext", "PrepareModuleInput",
           "PrepareModuleOutput", "RNGTracker", "RowwiseParallel", "SequenceParallel",
           "ShardedDropout", "agree_num_batches", "ddp", "full_tensor", "heartbeat", "init",
           "parallelize", "vocab_parallel_cross_entropy"]
__all__ += ["busy", "checkpoint_activations", "gradient_sync"]
__all__ += ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "clip_grad_norm_", "full_state_dict",
            "fully_shard"]
__all__ += ["PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleGPipe",
            "ScheduleInterleaved1F1B", "ScheduleZBH1", "ScheduleZBV", "pipeline",
            "split_into_stages"]
__all__ += ["position_ids", "ring_attention", "shard_sequence", "ulysses_attention",
            "unshard_sequence"]
