"""State dicts of `fully_shard` modules: sharded by default, full on demand.

Sharded (``module.state_dict()``): the keys are the module's own (fully_shard renames nothing);
a parameter's value is a ``DTensor`` whose local tensor is this rank's shard (a view, no copy,
no communication), with placement ``Shard(0)`` on a 1-D ``DeviceMesh`` of the unit's group,
global shape and stride set. Uneven sizes follow ``torch.chunk``, as DTensor does, so
``torch.distributed.checkpoint`` (DCP) saves them and loads them into any other sharding
(other world size, other strategy, or a full tensor through
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``). Buffers are plain tensors
(replicated). ``dcp.load`` writes into the DTensors' local tensors, i.e. straight into the
shards.

``load_state_dict`` (pre-hook per unit) accepts, for each parameter: a ``Shard(0)`` DTensor
over the same group size (its local tensor is copied in), or a full tensor (this rank's rows
are copied in: e.g. every rank ``torch.load(path, mmap=True)`` of a `full_state_dict` file).

Full (`full_state_dict`): units are gathered one at a time onto rank 0 (one ``gather`` per
unit, never an all-gather), unpacked to CPU, and the device buffer is dropped before the next
unit, so no rank ever holds the whole model on the device and only rank 0 holds it on CPU.
Mirrors ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
cpu_offload=True))`` of ``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from meshrun.parallel.fsdp.unit import Unit


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, full tensors on CPU, on rank 0; ``{}`` on other ranks.

    A collective: call it on every rank of the units' group. Memory: rank 0 holds one unit's
    gathered shards at a time on the device (``N * shard_numel`` elements) plus the CPU result;
    other ranks hold nothing extra.

    Args:
        module: a module (usually the root) at or above `fully_shard` units. Keys are those of
            ``module.state_dict()``; parameters not managed by any unit and buffers are copied.

    Returns:
        On rank 0 of the units' group (the global rank 0 when the group is the world): an
        ordered dict of CPU tensors in the parameters' original dtype; elsewhere ``{}``.
    """
    units = [m._fsdp_unit for m in module.modules() if hasattr(m, "_fsdp_unit")]
    sharded = module.state_dict()
    keys: dict[tuple[int, int], list[str]] = {}  # (id(unit), index) -> state_dict keys
    for name, p in module.named_parameters(remove_duplicate=False):
        unit = getattr(p, "_fsdp_unit", None)
        if unit is not None:
            i = next(j for j, q in enumerate(unit.params) if q is p)
            keys.setdefault((id(unit), i), []).append(name)
    is_rank0 = (units[0].rank if units else dist.get_rank()) == 0
    full_by_key: dict[str, torch.Tensor] = {}
    for unit in units:  # the same order on every rank: module order
        full = unit.gather_to_rank0()
        for i, t in enumerate(full or []):
            for key in keys.get((id(unit), i), []):
                full_by_key[key] = t
    if not is_rank0:
        return {}
    return {key: full_by_key[key] if key in full_by_key else _to_cpu(value)
            for key, value in sharded.items()}


def register_state_dict_hooks(module: nn.Module, unit: Unit) -> None:
    """Make ``module.state_dict()`` return DTensors and ``load_state_dict`` accept them."""
    module.register_state_dict_post_hook(functools.partial(_to_dtensors, unit))
    module.register_load_state_dict_pre_hook(functools.partial(_to_local_shards, unit))


def device_mesh(unit: Unit) -> DeviceMesh:
    """The 1-D DeviceMesh of the unit's group (built once)."""
    if unit.device_mesh is None:
        group = unit.group if unit.group is not None else dist.group.WORLD
        unit.device_mesh = DeviceMesh.from_group(group, unit.device.type)
    return unit.device_mesh


def _keys(unit: Unit, prefix: str):
    for i, fqns in enumerate(unit.fqns):
        for fqn in fqns:
            yield i, prefix + fqn


def _to_dtensors(unit: Unit, module, state_dict, prefix, local_metadata) -> None:
    mesh = device_mesh(unit)
    for i, key in _keys(unit, prefix):
        if key in state_dict and not isinstance(state_dict[key], DTensor):
            shape = unit.layout.slots[i].shape
            state_dict[key] = DTensor.from_local(state_dict[key], mesh, [Shard(0)],
                                                 run_check=False, shape=shape,
                                                 stride=_contiguous_stride(shape))


def _to_local_shards(unit: Unit, module, state_dict, prefix, local_metadata, strict,
                     missing_keys, unexpected_keys, error_msgs) -> None:
    for i, key in _keys(unit, prefix):
        value = state_dict.get(key)
        if value is None:
            continue
        slot = unit.layout.slots[i]
        if isinstance(value, DTensor):
            if (tuple(value.placements) == (Shard(0),)
                    and value.device_mesh.size() == unit.world_size):
                state_dict[key] = value.to_local()
                continue
            value = value.full_tensor()  # another layout: gather it, then take our rows
        if value.shape == slot.shape:
            start = min(unit.rank * slot.rows, slot.shape[0])
            state_dict[key] = value.narrow(0, start, slot.rows_of(unit.rank))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _to_cpu(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):  # not ours: gathering it here would run on rank 0 only
        raise ValueError("full_state_dict: the module holds DTensors that fully_shard did not "
                         "make; gather them with torch.distributed.checkpoint.state_dict")
    return value.detach().to("cpu", copy=True)
