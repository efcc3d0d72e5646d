"""One `fully_shard` call = one unit: its shard, its hooks, and the two autograd Functions.

Note: the unit and autograd.

- Sharded state: the unit's parameters are the user's own ``nn.Parameter`` objects, their
  ``.data`` pointed at views of one flat fp32 (original dtype) shard (see layout.py). The
  optimizer therefore steps on the local shards, in place, and an optimizer built before
  `fully_shard` still holds the right objects.
- Forward (pre-hook): `AllGatherParams` takes the shards as inputs and returns new unsharded
  tensors (all-gathered, in ``param_dtype``); they are put into the modules' ``_parameters``
  for the duration of the forward, then the sharded ``Parameter`` objects are put back.
  Gradients reach the unsharded tensors through ordinary autograd; `AllGatherParams.backward`
  runs once, when every use of every unsharded tensor of the unit has produced its gradient,
  and issues the unit's single reduce-scatter there. It returns no gradient to the shards: the
  reduce-scatter is asynchronous, and the unit adds its result to ``shard.grad`` when it
  completes (at the latest in the end-of-backward callback), so communication overlaps the
  backward of the units before it.
- ZeRO-3 (``reshard_after_forward=True``): after the forward the unsharded tensors keep their
  identity (autograd saved them) but their storage is resized to 0 bytes. `UnshardBeforeBackward`
  (identity on the unit's outputs) fires when the gradient of the outputs arrives, i.e. before
  any backward op of the unit reads a saved parameter; it re-gathers into the same storage,
  through ``.data`` so the version counters that autograd checks do not move, and installs
  them on the modules until the unit's gradients are in (so a recompute under activation
  checkpointing sees them, as in FSDP2, where parameters are unsharded during backward). ZeRO-2
  (``False``): the storage stays until the unit's reduce-scatter. The root unit (the outermost,
  found at the first forward) is never resharded after forward: its backward starts at once.
- Prefetch: the root records the order in which units run forward. In the next forward, when
  unit i starts, the all-gather of unit i+1 is issued before unit i's own is waited on, so it
  runs (on gloo's thread) while unit i computes; in backward, unit i's pre-backward issues the
  gather of the unit that ran before it. Every rank issues collectives in the same order, which
  gloo requires (the order is a function of the model and the recorded forward).
- HSDP (``fully_shard(module, mesh=Mesh({"dp_replicate": R, "dp_shard": S}))``): the unit
  shards over the ``dp_shard`` group and is replicated over ``dp_replicate``; after the
  reduce-scatter within the shard group, the shard's gradient is all-reduced over the
  replicas (the mean over all R x S ranks), so memory is that of FSDP over S and only 1/S of
  the gradient crosses the replica groups (across nodes, when a shard group is one node).
  That all-reduce is DDP's over the replicas, and takes DDP's communication hooks
  (`FSDPModule.register_comm_hook`): each unit's reduced shard is one `comm_hooks.GradBucket`
  (buckets in the order the reduce-scatters finish, the same on every rank), so fp16/bf16
  compression or PowerSGD shrink what crosses the replica groups.
- Split backward (zero-bubble pipelines run a microbatch's B, the input gradient, and W, the
  weight gradients, as separate autograd calls): the end of B must not free the unsharded
  tensors W still reads (autograd unpacks every tensor a node saved, the weight included,
  even where W computes only dW), so the pipeline sets ``set_split_backward(True)`` from a
  stage's first B to its last W (the user's ``set_reshard_after_backward`` is left as it
  is); each microbatch's tensors are then freed by its own `AllGatherParams` backward, in
  its W (the unit's one reduce-scatter, or accumulation without sync, is there). A W is one
  autograd call per group of layers (a unit's layers share its gather): the last W runs
  inside `FSDPModule.backward_in_parts`, so its reduce-scatters are one backward's buckets
  (one sequence of indices, ``is_last()`` once: a stateful comm hook such as PowerSGD
  counts one step).
- No sync (`set_requires_gradient_sync(False)`): backward adds the packed unsharded gradients
  into a buffer the size of the unsharded unit and communicates nothing; the next synchronised
  backward adds its gradients to that buffer and reduce-scatters it (gradient accumulation
  costs one unsharded gradient buffer per unit, as in FSDP2).
- CPU offload (``offload_policy=CPUOffloadPolicy()``, offload.py): the flat shard lives in
  host memory (so do ``shard.grad`` and the optimizer state); each gather starts from a
  device copy of it, and each finished reduce-scatter's rows are copied to the host before
  they are added to ``shard.grad``.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from meshrun import _torch
from meshrun._torch import tree_flatten, tree_map, tree_unflatten
from meshrun.parallel import comm_hooks
from meshrun.parallel._comm import (
    all_gather_flat,
    all_reduce_,
    reduce_scatter_flat,
    wait,
)
from meshrun.parallel.data_check import InputCheck, watch_samplers
from meshrun.parallel.fsdp import offload
from meshrun.parallel.fsdp.layout import ShardLayout
from meshrun.parallel.heartbeat import heartbeat


class AllGatherParams(torch.autograd.Function):
    """Forward: the unit's unsharded parameters. Backward: reduce-scatter their gradients."""

    @staticmethod
    def forward(ctx, unit: Unit, *shards: torch.Tensor):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # unused parameters: no zeros of full size
        full = unit.finish_gather()
        ctx.full = [weakref.ref(t) for t in full]  # weak: the outputs point back at this node
        frozen = [t for t, p in zip(full, unit.params, strict=True) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(full)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward(list(grads))
        for ref in ctx.full:  # nothing reads the unsharded parameters after this point
            _free(ref())
        return (None, *(None for _ in grads))


class UnshardBeforeBackward(torch.autograd.Function):
    """Forward: identity on a unit's outputs. Backward: re-gather the unit's parameters."""

    @staticmethod
    def forward(ctx, unit: Unit, full: list[torch.Tensor], *outputs: torch.Tensor):
        ctx.unit, ctx.full = unit, full
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.pre_backward(ctx.full)
        return (None, None, *grads)


class Root:
    """State shared by the units under one root: forward order, pending reduce-scatters."""

    def __init__(self, owner: Unit, units: list[Unit]):
        self.owner, self.units = owner, units
        self.order: list[Unit] = []  # units in the order their forward started, this pass
        self.previous: list[Unit] = []  # ... in the previous forward (forward prefetch)
        self.pending: list[tuple[Unit, dist.Work, torch.Tensor, torch.Tensor]] = []
        self.buckets = 0  # reduce-scatters finished this backward (HSDP hooks' bucket index)
        self.in_forward = False
        self.in_backward = False
        self.parts = 0  # > 0: inside `FSDPModule.backward_in_parts` (one backward, many calls)
        self.input_check = InputCheck(owner.group)  # `meshrun.parallel.data_check`
        watch_samplers()  # ... which knows DistributedSampler's padding

    def begin_forward(self) -> None:
        if self.in_backward:  # a backward that raised never reached finish_backward: forget it
            self.abandon_backward()
        if self.order:
            self.previous = self.order
        self.order = []
        self.in_forward = True

    def end_forward(self) -> None:
        self.in_forward = False
        for unit in self.units:  # a prefetch the forward did not consume: finish, drop
            unit.drop_gather()

    def forward_prefetch(self, unit: Unit) -> None:
        """Unit ``unit`` is the i-th to run: issue the gather of the i+1-th of last time."""
        i = len(self.order) - 1
        if i + 1 < len(self.previous) and self.previous[i] is unit:
            self.previous[i + 1].issue_gather()

    def backward_prefetch(self, unit: Unit) -> None:
        """Issue the gather of the unit that ran forward before ``unit`` (if it was resharded)."""
        if unit is self.owner:
            candidates = self.order[1:]
            target = candidates[-1] if candidates else None
        else:
            i = _last_index(self.order, unit)
            target = self.order[i - 1] if i is not None and i > 1 else None
        if target is not None and target.needs_gather():
            target.issue_gather()

    def ensure_callback(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            _torch.queue_backward_callback(self.finish_backward)

    def add_pending(self, entry) -> None:
        # one reduce-scatter in flight while the next unit's backward runs: finishing the older
        # one first bounds the packed-gradient buffers alive to two units
        while self.pending:
            self._finish(self.pending.pop(0), last=False)
        self.pending.append(entry)

    def abandon_backward(self) -> None:
        """Forget a backward that raised: wait for its reduce-scatters, drop their results."""
        for _unit, work, _output, _packed in self.pending:
            wait(work)
        self.pending = []
        self.in_backward = False
        self.buckets = 0

    def finish_backward(self) -> None:
        """End of an autograd call: finish reduce-scatters, drop stray prefetches, free
        unsharded parameters. Inside `backward_in_parts` the call is one part of a
        backward: the newest reduce-scatter stays in flight (the next part's first one, or
        `finish_parts`, finishes it), so only the whole backward's last bucket is marked
        last and bucket indices run on across the parts."""
        try:
            keep = 1 if self.parts else 0
            while len(self.pending) > keep:  # the last one finished: the backward's last bucket
                self._finish(self.pending.pop(0), last=len(self.pending) == 0)
            for unit in self.units:
                unit.drop_gather()
                unit._install(unit.params)  # a unit whose backward did not run to its end
                if (unit.full is not None and unit.reshard_after_backward
                        and not unit.split_backward):
                    for t in unit.full:
                        _free(t)
        finally:
            self.in_backward = False
            if not self.parts:
                self.buckets = 0
        heartbeat()  # one backward done: progress for `meshrun --hang-timeout`

    def finish_parts(self) -> None:
        """The end of `backward_in_parts`: its last reduce-scatter is the last bucket."""
        try:
            while self.pending:
                self._finish(self.pending.pop(0), last=len(self.pending) == 0)
        finally:
            self.buckets = 0

    def _finish(self, entry, last: bool) -> None:
        unit, work, output, _packed = entry
        wait(work)
        if unit.replica_hook is not None:  # HSDP with a hook: it averages over the replicas
            unit.reduce_replicas(output, self.buckets, last)
        elif unit.replicate_group is not None:  # HSDP: sum the replicas' shard gradients
            all_reduce_(output, unit.replicate_group)
        self.buckets += 1
        unit.accumulate_shard_grads(output)


class Unit:
    """The state of one `fully_shard` call (see the module docstring)."""

    def __init__(self, module: nn.Module, group, params: list[nn.Parameter],
                 aliases: list[list[tuple[nn.Module, str]]], fqns: list[list[str]],
                 reshard_after_forward: bool, mp_policy, replicate_group=None,
                 offload_policy=None):
        self.module, self.group = module, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # HSDP: the shard is replicated over this group; its gradients are all-reduced there
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group else 1
        self.replica_hook: tuple[object, object] | None = None  # (state, hook), HSDP only
        self.bucket_prefix = ""  # the unit module's name under its root: bucket names
        self.params, self.aliases, self.fqns = params, aliases, fqns  # fqns: per alias
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self.reshard_after_backward = True  # False: the end of backward keeps them (see api)
        self.split_backward = False  # the pipeline's B/W switch: keep them too (see api)
        self.mp = mp_policy
        self.root: Root | None = None
        self.full: list[torch.Tensor] | None = None  # unsharded tensors of the latest forward
        self.gather: tuple[dist.Work, torch.Tensor, torch.Tensor] | None = None  # in flight
        self.grad_accum: torch.Tensor | None = None  # packed gradients of unsynced backwards
        self.layout = ShardLayout([p.shape for p in params], self.world_size, self.rank)
        self.dtype = params[0].dtype if params else torch.float32
        self.device = params[0].device if params else torch.device("cpu")
        self.param_dtype = mp_policy.param_dtype or self.dtype
        self.offload = offload_policy if isinstance(offload_policy, offload.CPUOffloadPolicy) \
            else None  # shards, their gradients and optimizer state on the host
        self.reduce_dtype = mp_policy.reduce_dtype or self.param_dtype
        self._shard_params()

    # -- sharding ---------------------------------------------------------------------------

    @torch.no_grad()
    def _shard_params(self) -> None:
        """Broadcast rank 0's values, keep this rank's rows, point each ``p.data`` at them."""
        full = [p.detach() for p in self.params]
        if full:
            flat = torch.cat([t.reshape(-1) for t in full])
            if self.replicate_group is not None:  # replica 0's values, then shard rank 0's
                dist.broadcast(flat, group=self.replicate_group, group_src=0)
            dist.broadcast(flat, group=self.group, group_src=0)
            full = list(torch.split(flat, [t.numel() for t in full]))
        if self.offload is not None:
            self.sharded = offload.host_empty(self.layout.shard_numel, self.dtype,
                                              self.offload.pin_memory)
        else:
            self.sharded = torch.zeros(self.layout.shard_numel, dtype=self.dtype,
                                       device=self.device)
        self.layout.shard(full, self.sharded)
        for i, p in enumerate(self.params):
            p.data = self.layout.local_view(self.sharded, i)
            p.grad = None
        self.shard_ptrs = [p.data_ptr() for p in self.params]

    def _check_shards(self) -> None:
        """The gather reads ``self.sharded``: every parameter must still be a view of it."""
        for p, ptr, fqns in zip(self.params, self.shard_ptrs, self.fqns, strict=True):
            if p.data_ptr() != ptr and p.numel():
                raise RuntimeError(
                    f"fully_shard: parameter {fqns[0]!r} no longer views its unit's shard (its "
                    f".data was replaced, e.g. by module.to(), .half() or "
                    f"load_state_dict(assign=True) after fully_shard); move or cast the module "
                    f"before fully_shard, and load state dicts without assign=True")

    # -- all-gather -------------------------------------------------------------------------

    def issue_gather(self) -> None:
        """Start the unit's all-gather (in ``param_dtype``) unless one is already in flight."""
        if self.gather is not None or not self.params:
            return
        self._check_shards()
        if self.offload is not None:  # host -> device, in param_dtype
            shard = offload.to_device(self.sharded, self.device, self.param_dtype)
        elif self.param_dtype == self.dtype:
            shard = self.sharded
        else:
            shard = self.sharded.to(self.param_dtype)
        out = torch.empty(self.world_size * self.layout.shard_numel, dtype=self.param_dtype,
                          device=self.device)
        self.gather = (all_gather_flat(out, shard, self.group), out, shard)

    def finish_gather(self, into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Wait for the gather (issuing it if needed); copy it into new or freed tensors."""
        self.issue_gather()
        if into is None:
            into = [torch.empty(s.shape, dtype=self.param_dtype, device=self.device)
                    for s in self.layout.slots]
        else:
            for t in into:
                t.untyped_storage().resize_(t.numel() * t.element_size())
        if self.gather is not None:
            work, out, _ = self.gather
            self.gather = None
            wait(work)
            with torch.no_grad():  # .data: a fresh version counter, autograd's stays as it was
                self.layout.unpack(out, [t.data for t in into])
        return into

    def drop_gather(self) -> None:
        if self.gather is not None:
            wait(self.gather[0])
            self.gather = None

    def needs_gather(self) -> bool:
        return self.full is not None and self.gather is None and any(_freed(t) for t in self.full)

    # -- forward ----------------------------------------------------------------------------

    def pre_forward(self, module, args, kwargs):
        root = self._lazy_init()
        if root.owner is self:
            root.begin_forward()
            root.input_check(args, kwargs)  # positional and keyword; before any gather
        if root.in_forward:  # else: a unit called on its own, outside its root's forward
            root.order.append(self)
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), self.mp.param_dtype)
        if self.params:
            self.issue_gather()  # own gather first: gloo runs collectives in issue order
            if root.in_forward:
                root.forward_prefetch(self)
            self.full = list(AllGatherParams.apply(self, *self.params))
            self._install(self.full)
        return args, kwargs

    def post_forward(self, module, args, output):
        if self.params:
            self._install(self.params)
        if not torch.is_grad_enabled():  # no backward will come: drop the unsharded tensors
            self.full = None
        elif self.full is not None:
            if self.reshard_after_forward and self.root.owner is not self:
                for t in self.full:
                    _free(t)
            output = self._register_pre_backward(output)
        if self.mp.output_dtype is not None:
            output = _cast_floating(output, self.mp.output_dtype)
        if self.root.owner is self:
            self.root.end_forward()
        return output

    def _register_pre_backward(self, output):
        leaves, spec = tree_flatten(output)
        index = [i for i, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad]
        if not index:
            return output
        wrapped = UnshardBeforeBackward.apply(self, self.full, *(leaves[i] for i in index))
        for i, t in zip(index, wrapped, strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _install(self, tensors) -> None:
        """Point every module attribute that names parameter i at ``tensors[i]``."""
        for aliases, t in zip(self.aliases, tensors, strict=True):
            for mod, attr in aliases:
                _torch.parameter_slots(mod)[attr] = t

    def _lazy_init(self) -> Root:
        if self.root is None:  # the first unit to run forward is the root of those below it
            units = [m._fsdp_unit for m in self.module.modules() if hasattr(m, "_fsdp_unit")]
            root = Root(self, units)
            for unit in units:
                unit.root = root
            for name, m in self.module.named_modules():
                if hasattr(m, "_fsdp_unit") and name:
                    m._fsdp_unit.bucket_prefix = name + "."
            check_hook_coverage(root)
        return self.root

    # -- backward ---------------------------------------------------------------------------

    def pre_backward(self, full: list[torch.Tensor]) -> None:
        """The unit's outputs got their gradient: make sure its parameters are unsharded."""
        self.root.ensure_callback()
        if any(_freed(t) for t in full):
            self.finish_gather(into=full)
        self._install(full)  # for the backward: activation checkpointing recomputes with them
        self.root.backward_prefetch(self)

    def post_backward(self, grads: list[torch.Tensor | None]) -> None:
        """All gradients of the unsharded parameters are in: reduce-scatter (or accumulate)."""
        self.root.ensure_callback()
        self._install(self.params)
        packed = self.grad_accum
        if packed is None:
            packed = torch.zeros(self.world_size * self.layout.shard_numel,
                                 dtype=self.reduce_dtype, device=self.device)
        with torch.no_grad():
            self.layout.pack(grads, packed)
        if not self.requires_gradient_sync:
            self.grad_accum = packed
            return
        self.grad_accum = None
        # the mean (gloo has no ReduceOp.AVG); a replica hook divides by the replicas itself
        packed.div_(self.world_size * (1 if self.replica_hook is not None else self.replicas))
        output = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
        self.root.add_pending((self, reduce_scatter_flat(output, packed, self.group), output, packed))

    @torch.no_grad()
    def reduce_replicas(self, output: torch.Tensor, index: int, last: bool) -> None:
        """HSDP with a hook: ``output`` (this shard group's mean gradient, flat) becomes the
        mean over the replicas too, by ``hook(state, bucket)``, in place."""
        state, hook = self.replica_hook
        keep = [i for i, p in enumerate(self.params)
                if p.requires_grad and self.layout.local_view(output, i).numel()]
        bucket = comm_hooks.GradBucket(
            index, output, [self.layout.local_view(output, i) for i in keep],
            [self.params[i] for i in keep], [self.bucket_prefix + self.fqns[i][0] for i in keep],
            last, shard_group=self.group)
        result = comm_hooks.resolve(hook(state, bucket), bucket)
        if result is not output:
            output.copy_(result.view_as(output))

    @torch.no_grad()
    def accumulate_shard_grads(self, output: torch.Tensor) -> None:
        """Add a finished reduce-scatter's rows to each shard's ``.grad`` (original dtype;
        offloaded: copied to the host first)."""
        if self.offload is not None:
            output = offload.to_host(output, self.dtype, self.offload.pin_memory)
        for i, p in enumerate(self.params):
            if not p.requires_grad:
                continue
            g = self.layout.local_view(output, i)
            if g.dtype != p.dtype:
                g = g.to(p.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g


# -------------------------------------------------------------------------------------------
# helpers


def check_hook_coverage(root: Root) -> None:
    """Every unit with parameters under ``root`` has the same replica hook, or none has one.

    A bucket's ``is_last()`` is the backward's last bucket, so a hook on some units only (a
    ``register_comm_hook`` on a unit below the root) may never see it: PowerSGD then never
    counts a step and never starts compressing, silently. torch's FSDP allows the hook on the
    root only, for the same reason.

    Raises:
        ValueError: the hooks differ between the root's units.
    """
    units = [u for u in root.units if u.params]
    first = units[0].replica_hook if units else None
    if any(u.replica_hook is not first for u in units):
        same = [u.bucket_prefix + u.fqns[0][0] for u in units if u.replica_hook is first]
        other = [u.bucket_prefix + u.fqns[0][0] for u in units if u.replica_hook is not first]
        raise ValueError(f"register_comm_hook: the units under one root must share one hook "
                         f"(call it on the root, the outermost fully_shard module): the units "
                         f"holding {same} and those holding {other} differ (is_last() marks "
                         f"the backward's last bucket: a hook on part of the model may never "
                         f"see it, so PowerSGD would never start)")


def _freed(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _free(t: torch.Tensor | None) -> None:
    if t is not None and t.untyped_storage().nbytes() > 0:
        t.untyped_storage().resize_(0)


def _last_index(items: list, item) -> int | None:
    for i in range(len(items) - 1, -1, -1):
        if items[i] is item:
            return i
    return None


def _cast_floating(tree, dtype: torch.dtype):
    def cast(t):
        return t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t

    return tree_map(cast, tree)
