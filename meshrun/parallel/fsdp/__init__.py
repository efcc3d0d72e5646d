"""`fully_shard`: fully sharded data parallelism (ZeRO-3) on c10d collectives, named as FSDP2.

Every rank trains on its own slice of the global batch, as with ``ddp``, but holds only 1/N of
each parameter, of its gradient and of the optimizer state. A unit (one `fully_shard` call,
typically one transformer block, and the root for what is left) all-gathers its parameters
just before its forward and frees them after; its backward gathers them again and
reduce-scatters the gradients, so each rank receives the average gradient of its own rows:

    forward(unit):   W = all_gather(shard_0, ..., shard_{N-1})          (one per unit)
    backward(unit):  W = all_gather(...) again (ZeRO-3);  dW_r = mean over ranks of dW[rows of r]
                     by one reduce_scatter per unit;   shard_r.grad += dW_r
    optimizer:       steps on the shards (fp32 masters), locally, no communication

Files, one concern each (after torch/distributed/fsdp/_fully_shard/):

- api.py: `fully_shard`, `release` (its undo, for in-place changes of world),
  `FSDPModule` (``set_requires_gradient_sync``, ``register_comm_hook``,
  ``set_reshard_after_forward``), `MixedPrecisionPolicy`.
- layout.py: per-parameter dim-0 sharding (``torch.chunk`` rows, padded internally), packing
  for the all-gather / reduce-scatter.
- unit.py: a unit's state, its hooks, the autograd Functions `AllGatherParams` (forward:
  gather; backward: reduce-scatter) and `UnshardBeforeBackward`, prefetch, and the root that
  finishes the backward. Its docstring is the design note.
- state_dict.py: sharded state dicts (DTensors of the unsplit shape, DCP-loadable, from the
  parameters' `meshrun.parallel.placement` records); `full_state_dict` (rank 0, CPU, one
  parameter at a time) lives in `meshrun.parallel.state_dict`.
- clip.py: `clip_grad_norm_` by the global norm over the shards.
- offload.py: `CPUOffloadPolicy`: shards, gradients and optimizer state in host memory.
- copies.py: neighbour copies (each rank keeps a rank's rows of another node), so that
  `meshrun.parallel.elastic` recovers from one node's loss in memory.

Limits: parameters are sharded from a materialised module (no meta-device init); the unit's
forward must be where its parameters are used (a parameter shared across calls is refused);
a parameter unused in a backward gets a zero gradient (not None); optimizer state dicts are
per-rank (plain tensors), not DTensors.
"""

from meshrun.parallel.fsdp.api import FSDPModule, MixedPrecisionPolicy, fully_shard, release
from meshrun.parallel.fsdp.clip import clip_grad_norm_
from meshrun.parallel.fsdp.offload import CPUOffloadPolicy, OffloadPolicy
from meshrun.parallel.state_dict import full_state_dict

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "clip_grad_norm_", "full_state_dict", "fully_shard", "release"]
