"""State dicts of `fully_shard` modules: sharded by default, full on demand.

Sharded (``module.state_dict()``): the keys are the module's own (fully_shard renames nothing);
a parameter's value is a ``DTensor`` of the unsplit shape whose local tensor is this rank's
shard (a view, no copy, no communication), built from the parameter's placement record
(`meshrun.parallel.placement.to_dtensor`): ``Shard(0)`` on a 1-D ``DeviceMesh`` of the unit's
group, or ``(Shard(d), Shard(0))`` on a 2-D ``(tp, fsdp)`` mesh when `parallelize` cut dim d
first. Uneven sizes follow ``torch.chunk``, as DTensor does, so ``torch.distributed.checkpoint``
(DCP) saves them and loads them into any other sharding (other world size, other strategy, or
a full tensor through ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``).
Buffers are plain tensors (replicated). ``dcp.load`` writes into the DTensors' local tensors,
i.e. straight into the shards.

``load_state_dict`` (pre-hook per unit) accepts, for each parameter: such a DTensor (its local
tensor is copied in), a DTensor of another layout (gathered, then cut), or a full tensor of
the unsplit shape (this rank's rows are copied in: e.g. every rank ``torch.load(path,
mmap=True)`` of a `full_state_dict` file).

Full: `full_state_dict` (`meshrun.parallel.state_dict`), one parameter at a time onto rank 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from meshrun.parallel import placement
from meshrun.parallel.state_dict import full_state_dict

if TYPE_CHECKING:
    from meshrun.parallel.fsdp.unit import Unit

__all__ = ["full_state_dict", "register_state_dict_hooks"]


def register_state_dict_hooks(module: nn.Module, unit: Unit) -> list:
    """Make ``module.state_dict()`` return DTensors and ``load_state_dict`` accept them;
    returns the hooks' handles."""
    return placement.register_state_dict_hooks(
        module, [(fqn, p) for p, fqns in zip(unit.params, unit.fqns, strict=True) for fqn in fqns])
