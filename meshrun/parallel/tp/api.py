"""`parallelize` (apply a plan of styles to a model) and `full_tensor`: the public entry points
of tensor parallelism; the package docstring (`meshrun.parallel.tp`) has the math."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from meshrun import _torch
from meshrun.parallel import placement
from meshrun.parallel._comm import broadcast_from_first_
from meshrun.parallel.mesh import Mesh
from meshrun.parallel.tp.random import RNGTracker
from meshrun.parallel.tp.styles import (
    _TP,
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    ShardSpec,
)

__all__ = ["full_tensor", "parallelize"]


# -------------------------------------------------------------------------------------------
# public API


def parallelize(module: nn.Module, group_or_mesh: dist.ProcessGroup | Mesh | None,
                plan: Mapping[str, ParallelStyle], *,
                rng_tracker: RNGTracker | None = None) -> nn.Module:
    """Apply a tensor-parallel ``plan`` to ``module`` in place; return the same module.

    Args:
        module: the full model, on its device, built the same way on every rank (parameters
            and buffers are broadcast from rank 0 of the group first, then sharded).
        group_or_mesh: the TP process group; or a `Mesh` (its ``"tp"`` axis, or its only
            axis); or None for the whole world.
        plan: submodule name -> style. ``"*"`` matches one name component; ``""`` is
            ``module`` itself. Every key must match at least one submodule.
        rng_tracker: the `RNGTracker` for sharded dropout (default: a new one, seeded from
            ``torch.initial_seed()`` of TP rank 0); keep a reference to use ``fork()`` in
            model code.

    Returns:
        ``module``, with planned parameters replaced by local shards (same names) and
        ``module.tp_rng_tracker`` set.

    Raises:
        RuntimeError: the default process group is not initialised, or ``module`` was
            already parallelized.
        KeyError: the mesh has several axes and none named ``"tp"``.
        ValueError: a plan key matches no submodule, a submodule matched by two keys, a style
            applied to a module type it does not support, a dimension the TP degree does not
            divide (vocabularies excepted: padded), a tied parameter shared with a module
            outside the plan or sharded differently by two styles, or dropout in a model whose
            default random state differs across the TP ranks.
        TypeError: a plan value is not a style.
    """
    if not dist.is_initialized():
        raise RuntimeError("parallelize: the default process group is not initialised; "
                           "call meshrun.parallel.init() first")
    if getattr(module, "tp_rng_tracker", None) is not None:
        raise RuntimeError("parallelize: this module was already parallelized")
    group = _resolve_group(group_or_mesh)
    tp = _TP(group, dist.get_world_size(group), dist.get_rank(group), None)
    targets = _match(module, plan)
    tp.vocab_tied = _tied_to_vocab_embedding(targets)
    specs = {name: style._shard_specs(mod, name, tp) for name, (mod, style) in targets.items()}
    _check_tied(module, targets, specs)
    broadcast_from_first_([*module.parameters(), *module.buffers()], group)  # rank 0's
    _check_dropout_rng(module, targets, group)
    tp.rng = rng_tracker if rng_tracker is not None else RNGTracker(group)
    shards: dict[int, nn.Parameter] = {}  # id(full parameter) -> local shard (tied: once)
    for name, (mod, style) in targets.items():
        for pname, spec in specs[name].items():
            full = getattr(mod, pname)
            if id(full) not in shards:
                shards[id(full)] = _make_shard(full, spec, tp)
            setattr(mod, pname, shards[id(full)])
        style._apply(mod, name, tp)
        mod._meshrun_tp_style = style
        _register_state_dict_hooks(mod, list(specs[name]))
    module.tp_rng_tracker = tp.rng
    return module


def full_tensor(param: torch.Tensor, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The full (unsharded) value of a parameter sharded by `parallelize`, on every rank.

    Args:
        param: a parameter of a parallelized module (a local shard, or replicated), possibly
            also cut by `fully_shard`.
        tensor: a tensor shaped like ``param`` to gather instead, e.g. ``param.grad``
            (default: ``param`` itself).

    Returns:
        The full tensor (padding removed, fused chunks put back in order), detached; for a
        replicated parameter, ``tensor`` itself. One all-gather per group that cuts it (its
        `meshrun.parallel.placement` record: the TP group, then the FSDP group).

    Mirrors ``DTensor.full_tensor()``.
    """
    value = param if tensor is None else tensor
    return placement.full_tensor(placement.of(param), value)


# -------------------------------------------------------------------------------------------
# helpers: plan matching, tied parameters, sharding


def _resolve_group(group_or_mesh):
    if isinstance(group_or_mesh, Mesh):
        axes = group_or_mesh.axes
        if len(axes) == 1:
            return group_or_mesh.group(axes[0])
        if "tp" not in axes:
            raise KeyError(f"parallelize: the mesh has axes {', '.join(axes)} and none is "
                           f"named 'tp'; pass mesh.group(<axis>)")
        return group_or_mesh.group("tp")
    return group_or_mesh


def _match(module: nn.Module, plan) -> dict[str, tuple[nn.Module, ParallelStyle]]:
    modules = dict(module.named_modules())
    targets: dict[str, tuple[nn.Module, ParallelStyle]] = {}
    owner: dict[str, str] = {}
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize: plan[{key!r}] must be a style such as "
                            f"ColwiseParallel() (got {type(style).__name__})")
        pattern = key.split(".") if key else []
        names = [n for n in modules if _matches(n.split(".") if n else [], pattern)]
        if not names:
            raise ValueError(f"parallelize: plan key {key!r} matches no submodule of "
                             f"{type(module).__name__}")
        for n in names:
            if n in targets:
                raise ValueError(f"parallelize: submodule {n!r} is matched by two plan keys, "
                                 f"{owner[n]!r} and {key!r}")
            targets[n], owner[n] = (modules[n], style), key
    return targets


def _matches(parts: list[str], pattern: list[str]) -> bool:
    return len(parts) == len(pattern) and all(
        fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern, strict=True))


def _tied_to_vocab_embedding(targets) -> frozenset:
    """Names of Linears under ColwiseParallel whose weight is a vocab-parallel embedding's:
    they are output layers over the same (padded) vocabulary."""
    vocab = {id(m.weight) for m, style in targets.values()
             if isinstance(m, nn.Embedding) and isinstance(style, RowwiseParallel)}
    return frozenset(name for name, (m, style) in targets.items()
                     if isinstance(m, nn.Linear) and isinstance(style, ColwiseParallel)
                     and id(m.weight) in vocab)


def _check_tied(module, targets, specs) -> None:
    """A parameter shared by several modules: all of them planned, all sharded alike."""
    users: dict[int, list[tuple[str, str]]] = {}
    for mname, mod in module.named_modules(remove_duplicate=False):
        for pname, p in _torch.parameter_slots(mod).items():
            if p is not None and (mname, pname) not in users.setdefault(id(p), []):
                users[id(p)].append((mname, pname))
    for owners in users.values():
        if len(owners) < 2:
            continue
        sharded = [(m, p) for m, p in owners if m in specs and p in specs[m]]
        if not sharded:
            continue
        names = " and ".join(f"{m}.{p}" for m, p in owners)
        outside = [(m, p) for m, p in owners if (m, p) not in sharded]
        if outside:
            raise ValueError(f"parallelize: {names} are one tied parameter, but "
                             f"{', '.join(f'{m}.{p}' for m, p in outside)} is not sharded by "
                             f"the plan; plan every module that uses it (e.g. RowwiseParallel "
                             f"on the embedding and ColwiseParallel on the output layer), or "
                             f"untie them")
        distinct = {specs[m][p] for m, p in sharded}
        if len(distinct) > 1:
            how = "; ".join(f"{m}.{p}: {type(targets[m][1]).__name__} shards dim "
                            f"{specs[m][p].dim}" for m, p in sharded)
            raise ValueError(f"parallelize: {names} are one tied parameter, sharded "
                             f"differently ({how}); an embedding tied to the output layer "
                             f"needs RowwiseParallel on the embedding and ColwiseParallel on "
                             f"the output layer (both shard the vocabulary)")


def _make_shard(full: nn.Parameter, spec: ShardSpec, tp: _TP) -> nn.Parameter:
    with torch.no_grad():
        t = full.detach().movedim(spec.dim, 0)
        if spec.padded != spec.size:
            t = torch.cat([t, t.new_zeros(spec.padded - spec.size, *t.shape[1:])])
        n = spec.padded // (tp.size * spec.chunks)
        t = t.reshape(spec.chunks, tp.size, n, *t.shape[1:])[:, tp.rank]
        local = t.reshape(spec.chunks * n, *t.shape[2:]).movedim(0, spec.dim)
        local = local.clone(memory_format=torch.contiguous_format)  # own storage, not a view
    shard = nn.Parameter(local, requires_grad=full.requires_grad)
    shard._meshrun_tp_spec = spec  # read by the styles (styles.py) only
    cut = placement.Cut("tp", tp.group, spec.dim, tp.size, tp.rank, spec.chunks, spec.padded)
    placement.record(shard, placement.of(full).narrow(cut))
    return shard


def _register_state_dict_hooks(module: nn.Module, names: list[str]) -> None:
    """``state_dict()`` of the sharded parameters: DTensors of the global shape; and
    ``load_state_dict`` takes those, full tensors, or local shards (`placement`)."""
    slots = _torch.parameter_slots(module)
    placement.register_state_dict_hooks(module, [(n, slots[n]) for n in names])


def _check_dropout_rng(module: nn.Module, targets, group) -> None:
    """Replicated dropout needs the same default stream on every TP rank."""
    has_dropout = any(isinstance(m, _torch.dropout_base()) and m.p > 0
                      for m in module.modules())
    if not has_dropout or dist.get_world_size(group) == 1:
        return
    state = torch.get_rng_state()
    digest = torch.tensor([int(torch.sum(state.long() * torch.arange(1, state.numel() + 1)))],
                          dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        digest = digest.cuda()
    digests = [torch.zeros_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(digests, digest, group=group)
    if any(int(d) != int(digests[0]) for d in digests):
        raise ValueError("parallelize: the model has dropout but the default random state "
                         "differs across the TP ranks, so dropout on replicated activations "
                         "would diverge; call torch.manual_seed(<same seed>) on every rank "
                         "before parallelize")


