"""The public surface: `fully_shard`, `FSDPModule`, `MixedPrecisionPolicy` (torch FSDP2's names)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshrun import _torch
from meshrun.parallel import placement
from meshrun.parallel.fsdp.offload import OffloadPolicy
from meshrun.parallel.fsdp.state_dict import register_state_dict_hooks
from meshrun.parallel.fsdp.unit import Unit


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of compute and communication; the sharded parameters keep their own dtype.

    Attributes:
        param_dtype: dtype of the unsharded parameters: the all-gather and the forward/backward
            run in it (e.g. ``torch.bfloat16``). None: the parameters' own dtype.
        reduce_dtype: dtype of the gradient reduce-scatter (and of gradient accumulation
            without sync). None: ``param_dtype``. ``torch.float32`` with a bf16 ``param_dtype``
            sums the ranks' bf16 gradients in fp32.
        output_dtype: cast the unit's floating-point outputs to it (None: leave them).
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.

    The sharded parameter (fp32 for an fp32 model) is the optimizer's master copy: updates are
    never rounded to ``param_dtype`` (bf16 masters stop learning once the update falls below
    bf16's resolution). Mirrors ``torch.distributed.fsdp.MixedPrecisionPolicy``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class FSDPModule:
    """Mixed into the class of every module passed to `fully_shard` (``isinstance`` works).

    Mirrors ``torch.distributed.fsdp.FSDPModule``: runtime knobs are ``set_*`` methods.
    """

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Gradient accumulation: with False, backward communicates nothing and keeps the
        unsharded gradients (one unsharded-size buffer per unit, in ``reduce_dtype``); the next
        backward with True adds them in and reduce-scatters once. ``recurse``: also every
        `fully_shard` unit below this module."""
        for unit in self._fsdp_units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        """True: free the unsharded parameters after forward and all-gather again in backward
        (ZeRO-3, least memory); False: keep them until the unit's backward (ZeRO-2, one
        all-gather less per unit). The root unit is never resharded after forward."""
        for unit in self._fsdp_units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """True (the default): the end of each backward (each autograd call) frees the
        unsharded parameters of every unit that a backward left unsharded. False: keep them
        until each forward's own backward has produced the unit's gradients (where they are
        freed anyway). Mirrors FSDP2's method of that name; ``recurse``: also every
        `fully_shard` unit below this module. The pipeline's split backward does not change
        it (it uses `set_split_backward`)."""
        for unit in self._fsdp_units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_split_backward(self, split_backward: bool, *, recurse: bool = True) -> None:
        """True while backwards run split into separate autograd calls for the input
        gradient and the weight gradient (the zero-bubble pipeline schedules' B then W): the
        end of an autograd call then keeps the unsharded parameters, which the weight pass
        still reads (autograd unpacks every tensor a node saved), as
        ``set_reshard_after_backward(False)`` would, without changing that setting; each
        forward's are freed once its own gradients are in (in its W). It costs one
        unsharded copy of the unit per microbatch between its B and its W. The pipeline
        turns it on at a stage's first B and off after its last W (or a failed step);
        ``recurse``: also every `fully_shard` unit below this module."""
        for unit in self._fsdp_units(recurse):
            unit.split_backward = split_backward

    @contextlib.contextmanager
    def backward_in_parts(self):
        """The autograd calls made inside are the parts of one backward (a zero-bubble
        pipeline's W runs one autograd call per group of layers): the reduce-scatters they
        issue are one backward's buckets, indexed on across the parts, and only the very
        last is finished at the block's end, marked ``is_last()``, so an HSDP comm hook that
        counts steps (PowerSGD) counts one, as for an unsplit backward. A part that raises
        abandons the backward (its reduce-scatters are waited for and dropped). Enter it on
        the root (the outermost `fully_shard` module), after its first forward; not nested.

        Raises:
            RuntimeError: the root has not run forward yet, or the block is nested.

        torch's pipelining gets the same effect by running FSDP2's post-backward itself
        after the last W; here the root keeps its one end-of-backward."""
        root = self._fsdp_unit.root
        if root is None:
            raise RuntimeError("backward_in_parts: the module has not run forward yet")
        if root.parts:
            raise RuntimeError("backward_in_parts: already inside one (not nested)")
        root.parts = 1
        try:
            yield
        except BaseException:
            root.parts = 0
            root.abandon_backward()
            raise
        root.parts = 0
        root.finish_parts()

    def discard_unsynced_gradients(self, *, recurse: bool = True) -> None:
        """Drop the gradients that backwards without sync
        (``set_requires_gradient_sync(False)``) accumulated and no synchronised backward has
        reduced yet (one unsharded buffer per unit; ``optimizer.zero_grad()`` does not reach
        them, they are not ``.grad``). For a step that failed midway: the pipeline calls it,
        so that the next step does not add the failed one's gradients to its own. Local,
        no communication; ``recurse``: also every `fully_shard` unit below this module."""
        for unit in self._fsdp_units(recurse):
            unit.grad_accum = None

    def register_comm_hook(self, state: object, hook) -> None:
        """HSDP: average each unit's shard gradient over the replicas with
        ``hook(state, bucket)`` instead of the plain all-reduce; for this module's unit and
        every unit below it. Call it on the root (the outermost `fully_shard` module), as
        torch's FSDP requires: the first forward (or this call, after it) refuses a hook on
        part of the units. Register before the first backward.

        The replica all-reduce is DDP's over ``mesh.group("dp_replicate")``, so it takes DDP's
        hooks and their contract (`meshrun.parallel.comm_hooks`): ``bucket.buffer()`` is the
        unit's flat reduced shard, averaged over ``dp_shard`` but not yet over the replicas
        (in ``reduce_dtype``); ``bucket.gradients()`` its per-parameter rows, named by
        ``bucket.parameter_names()`` from this module (empty rows and frozen parameters left
        out); one bucket per unit and backward, in the order the reduce-scatters finish (the
        same on every rank), ``is_last()`` on the backward's last. Built-in hooks:
        ``register_comm_hook(mesh.group("dp_replicate"), fp16_compress_hook)`` (or
        ``bf16_compress_hook``, ``allreduce_hook``), and
        ``register_comm_hook(PowerSGDState(mesh.group("dp_replicate"), ...), powerSGD_hook)``
        (its state keyed by these names, saved by `meshrun.parallel.checkpoint`). The
        reduce-scatter within ``dp_shard`` is not hooked (compress it with
        ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``).

        Args:
            state: passed to every call as is: the replica group for the stateless hooks, a
                `comm_hooks.PowerSGDState` on the replica group for PowerSGD.
            hook: ``hook(state, bucket: GradBucket)`` returning the replica-averaged bucket:
                a Tensor, or a ``torch.futures.Future`` / `comm_hooks.Pending` of one.

        Raises:
            TypeError: ``hook`` is not callable.
            ValueError: a unit here is not HSDP (it has no replica all-reduce to hook: give
                ``fully_shard`` a ``("dp_replicate", "dp_shard")`` mesh), or ``state`` is (or
                holds, as ``state.process_group``) a process group other than the replica
                group (None names the whole world); or the hook covers only part of the
                units under the root (here once the root has run, else at its first forward:
                ``is_last()`` would not mark the last bucket of every step).
            RuntimeError: a hook is already registered on one of the units.

        torch has no hook for HSDP: FSDP1's ``register_comm_hook`` replaces the
        reduce-scatter and refuses hybrid sharding; FSDP2's ``set_all_reduce_hook`` runs after
        the all-reduce, not instead of it. This is DDP's ``register_comm_hook`` applied to the
        replica all-reduce.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable as hook(state, bucket) "
                            f"(got {type(hook).__name__})")
        units = [u for u in self._fsdp_units(recurse=True) if u.params]
        for unit in units:
            where = unit.fqns[0][0] if unit.fqns else type(unit.module).__name__
            if unit.replicate_group is None:
                raise ValueError(f"register_comm_hook: the fully_shard unit holding {where!r} "
                                 f"is not HSDP, so it has no replica all-reduce to hook; shard "
                                 f"with mesh=Mesh({{'dp_replicate': R, 'dp_shard': S}}) (ddp's "
                                 f"own register_comm_hook covers unsharded data parallelism)")
            if unit.replica_hook is not None:
                raise RuntimeError(f"register_comm_hook: the unit holding {where!r} already "
                                   f"has a hook; one hook per unit (torch's rule)")
        group = state if state is None or isinstance(state, dist.ProcessGroup) \
            else getattr(state, "process_group", _NO_GROUP)
        if group is not _NO_GROUP and units and _ranks(group) != _ranks(units[0].replicate_group):
            raise ValueError(f"register_comm_hook: the hook's group has ranks {_ranks(group)}, "
                             f"but this rank's replica group is "
                             f"{_ranks(units[0].replicate_group)}; pass "
                             f"mesh.group('dp_replicate') (as the state, or as PowerSGDState's "
                             f"process_group)")
        root = units[0].root if units else None
        if root is not None and {id(u) for u in root.units if u.params} != {id(u) for u in units}:
            raise ValueError("register_comm_hook: call it on the root (the outermost "
                             "fully_shard module, the one whose forward runs first): a hook on "
                             "part of the model may never see the backward's last bucket "
                             "(is_last()), so PowerSGD would never start; torch's FSDP has the "
                             "same rule")
        pair = (state, hook)  # one object for all: the first forward checks they share it
        for unit in units:
            unit.replica_hook = pair

    def _fsdp_units(self, recurse: bool) -> list[Unit]:
        modules = self.modules() if recurse else [self]
        return [m._fsdp_unit for m in modules if isinstance(m, FSDPModule)]


_NO_GROUP = object()  # a hook state that names no process group


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


_FSDP_CLASSES: dict[type, type] = {}


def fully_shard(module: nn.Module, group: dist.ProcessGroup | None = None, *,
                mesh=None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy: OffloadPolicy | None = None) -> nn.Module:
    """Shard ``module``'s parameters on dim 0 across ``group``; return the same module.

    Apply bottom-up: to each block first, then to the root. A call manages the parameters of
    ``module`` that no earlier call manages (its sharded submodules are skipped): each parameter
    of shape ``(d0, *rest)`` becomes, in place (same ``nn.Parameter`` object), this rank's
    ``torch.chunk`` rows ``(ceil(d0/N) or fewer, *rest)``; uneven sizes are padded internally
    only. Per forward and backward, the unit issues one all-gather before its forward, one
    more before its backward if resharded, and one reduce-scatter of its gradients (averaged
    over the group) when its backward finishes; ``shard.grad`` holds the result after
    ``backward()``. Build the optimizer on ``module.parameters()`` (before or after).
    Unlike FSDP2, parameters stay plain tensors (the local rows), not DTensors, so any torch
    optimizer steps on them as is; clip with `clip_grad_norm_` (it reduces the norm across
    ranks). Memory per rank: 1/N of parameters, gradients and optimizer state, plus the
    unsharded parameters of the units currently unsharded (one or two with ZeRO-3).

    ``module.state_dict()`` then holds ``DTensor`` s of the unsplit shape with ``Shard(0)``
    placement (``(Shard(d), Shard(0))`` on a 2-D ``(tp, fsdp)`` mesh over a `parallelize` d
    cut; no communication; ``torch.distributed.checkpoint`` can save and reshard them), and
    ``load_state_dict`` accepts those or full tensors; `full_state_dict` gathers onto rank 0.
    The parameter's `meshrun.parallel.placement` record gets the dim-0 cut over ``group``.

    Args:
        module: the block or model, on its device, with the same values on every rank (rank 0
            of ``group`` broadcasts its values, as ``ddp`` does). One dtype per call.
        group: process group to shard over (default: the whole world); e.g. ``mesh.group("dp")``.
        mesh: instead of ``group``, a `Mesh`: 1-D (shard over its axis), or 2-D with axes
            ``("dp_replicate", "dp_shard")`` for HSDP (hybrid sharding, as FSDP2 with a 2-D
            mesh): shard over ``dp_shard``, replicate over ``dp_replicate``; the gradients
            are reduce-scattered within the shard group, then all-reduced across replicas.
        reshard_after_forward: True: ZeRO-3; False: ZeRO-2 (see
            `FSDPModule.set_reshard_after_forward`).
        mp_policy: `MixedPrecisionPolicy` (default: none, everything in the parameters' dtype).
        offload_policy: `CPUOffloadPolicy` keeps this unit's shards, their gradients and the
            optimizer state in host memory, copied to the device before each all-gather and
            back after each reduce-scatter (`meshrun.parallel.fsdp.offload`); the optimizer
            then steps on the host. Default (None or `OffloadPolicy()`): no offload.

    Returns:
        ``module``, its class now a subclass of `FSDPModule`.

    Raises:
        RuntimeError: the default process group is not initialised, or ``module`` was already
            passed to ``fully_shard``.
        TypeError: ``offload_policy`` is not an `OffloadPolicy`.
        ValueError: both ``group`` and ``mesh``; a mesh of other axes; a parameter is already
            managed by another ``fully_shard`` call (shared
            between two calls, or calls made top-down); a 0-dim parameter; parameters of
            more than one dtype in one call. The message names the parameter and the fix.

    Mirrors ``torch.distributed.fsdp.fully_shard`` (FSDP2; Zhao et al., "PyTorch FSDP", VLDB
    2023) and ZeRO stage 3 (Rajbhandari et al., "ZeRO", SC 2020).
    """
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: the default process group is not initialised; "
                           "call meshrun.parallel.init() first")
    if isinstance(module, FSDPModule):
        raise RuntimeError(f"fully_shard: this {type(module).__name__} was already passed to "
                           f"fully_shard")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be CPUOffloadPolicy(...) or "
                        f"OffloadPolicy() (got {type(offload_policy).__name__})")
    group, replicate_group = _groups(group, mesh)
    params, aliases, fqns = _collect(module)
    before = [placement.of(p) for p in params]  # TP's record, or whole: read before the cut
    unit = Unit(module, group, params, aliases, fqns, reshard_after_forward, mp_policy,
                replicate_group=replicate_group, offload_policy=offload_policy)
    for p, was in zip(params, before, strict=True):
        p._fsdp_unit = unit
        placement.record(p, was.narrow(placement.Cut("fsdp", group, 0, unit.world_size,
                                                     unit.rank, replicas=unit.replicas)))
    module._fsdp_unit = unit  # a plain attribute: not a submodule, not in state_dict
    cls = type(module)
    unit.undo = _Undo(cls, before, [
        module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True, prepend=True),
        module.register_forward_hook(unit.post_forward, always_call=True),  # also on errors
        *register_state_dict_hooks(module, unit)])
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _FSDP_CLASSES[cls]
    return module


@dataclass
class _Undo:
    """What `release` needs to undo one `fully_shard` call."""

    cls: type  # the module's class before
    placements: list  # each parameter's placement record before the cut
    handles: list  # the module hooks the call registered


def release(module: nn.Module) -> list[nn.Parameter]:
    """Undo `fully_shard` on ``module`` and every sharded module below it: remove the hooks,
    restore the classes and the parameters' placement records, and drop the units (with them
    their process groups). Each parameter keeps its local rows (``.data``, shape
    ``(rows_r, *rest)``, a view of the dropped unit's shard) until the caller gives it a full
    tensor again (``p.data = full``), as `meshrun.parallel.elastic` does when the world
    changes in place: the old world's groups are gone, the module and its optimizer live on,
    and `fully_shard` is then applied again over the new group. Local, no communication.

    Returns:
        The parameters that were sharded, in the order of ``module.named_parameters()``.
    """
    released = []
    for m in list(module.modules()):
        unit = getattr(m, "_fsdp_unit", None)
        if unit is None:
            continue
        unit._install(unit.params)  # the sharded Parameter objects, not a forward's tensors
        for handle in unit.undo.handles:
            handle.remove()
        for p, was in zip(unit.params, unit.undo.placements, strict=True):
            del p._fsdp_unit
            p.grad = None
            placement.restore(p, was)
            released.append(p)
        m.__class__ = unit.undo.cls
        del m._fsdp_unit
        # the last forward's unsharded tensors hold the autograd graph that holds each
        # parameter's gradient accumulator, made for its shard's shape: drop them, or a
        # parameter given its full tensor again fails its next backward on that shape
        unit.full, unit.gather, unit.grad_accum, unit.root = None, None, None, None
    order = {id(p): i for i, p in enumerate(module.parameters())}
    return sorted(released, key=lambda p: order.get(id(p), len(order)))


def _groups(group, mesh):
    """(shard group, replicate group or None) from ``fully_shard``'s ``group`` / ``mesh``."""
    if mesh is None:
        return group, None
    if group is not None:
        raise ValueError("fully_shard: give group= or mesh=, not both")
    axes = tuple(mesh.axes)
    if len(axes) == 1:
        return mesh.group(axes[0]), None
    if axes == ("dp_replicate", "dp_shard"):
        return mesh.group("dp_shard"), mesh.group("dp_replicate")
    raise ValueError(f"fully_shard: mesh= takes one axis, or the two axes ('dp_replicate', "
                     f"'dp_shard') for HSDP, in that order (got {axes}); for another mesh "
                     f"pass group=mesh.group(<axis>)")


def _collect(module: nn.Module):
    """The parameters this call manages, each once, with every (module, attribute) naming it."""
    params: list[nn.Parameter] = []
    aliases: list[list[tuple[nn.Module, str]]] = []
    fqns: list[list[str]] = []  # names relative to ``module``, first one first
    index: dict[int, int] = {}
    for prefix, mod in _region(module, ""):
        for attr, p in _torch.parameter_slots(mod).items():
            if p is None:
                continue
            fqn = prefix + attr
            owner = getattr(p, "_fsdp_unit", None)
            if owner is not None:
                raise ValueError(_shared_message(module, fqn, p, owner))
            if id(p) in index:  # tied inside this call: one owner, several names
                aliases[index[id(p)]].append((mod, attr))
                fqns[index[id(p)]].append(fqn)
                continue
            if p.dim() == 0:
                raise ValueError(f"fully_shard: parameter {fqn!r} is 0-dim and cannot be sharded "
                                 f"on dim 0; make it a 1-element tensor (shape (1,))")
            if params and p.dtype != params[0].dtype:
                raise ValueError(f"fully_shard: parameter {fqn!r} is {p.dtype} but {fqns[0][0]!r} "
                                 f"is {params[0].dtype}; one fully_shard call takes one dtype: "
                                 f"convert the module (module.to(dtype)) or shard them in "
                                 f"separate calls")
            index[id(p)] = len(params)
            params.append(p)
            aliases.append([(mod, attr)])
            fqns.append([fqn])
    return params, aliases, fqns


def _region(module: nn.Module, prefix: str):
    """``module`` and its descendants, in registration order, minus sharded subtrees."""
    yield prefix, module
    for name, child in module.named_children():
        if not isinstance(child, FSDPModule):
            yield from _region(child, f"{prefix}{name}.")


def _shared_message(module: nn.Module, fqn: str, p: nn.Parameter, owner: Unit) -> str:
    other = owner.fqns[next(i for i, q in enumerate(owner.params) if q is p)][0]
    where = next((name for name, m in module.named_modules() if m is owner.module), None)
    if where is not None:
        return (f"fully_shard: parameter {fqn!r} is the same tensor as '{where}.{other}', which "
                f"the separate fully_shard call on {where!r} already shards; a parameter "
                f"shared by two modules must be sharded by one call: shard both modules in one "
                f"call (do not fully_shard {where!r} on its own; its parent's call will manage "
                f"it)")
    return (f"fully_shard: parameter {fqn!r} is already sharded by the fully_shard call on a "
            f"{type(owner.module).__name__} (as {other!r}); apply fully_shard bottom-up "
            f"(each block first, then the root), and shard a shared parameter in one call")
