"""`ddp()`: data parallelism by bucketed gradient all-reduce overlapped with backward.

Every rank holds the whole model and trains on its own slice of the global batch; after each
backward the gradients are averaged over the group, so every rank takes the same optimizer
step. `ddp(model)` returns the *same* module (parameter names and state_dict keys unchanged)
with hooks installed, built only on c10d collectives (not torch's DistributedDataParallel).

Design (after torch's DDP reducer; Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020):

- Wrap time: parameters and buffers are broadcast from rank 0 of the group, so every rank
  starts from the same model.
- Buckets: parameters that require grad are packed, in reverse registration order (roughly
  the order backward produces their gradients), into flat buckets of about
  ``bucket_cap_mb`` MiB; the first bucket is small (``first_bucket_cap_mb``, 1 MiB as in
  torch) so communication starts early. A bucket closes once it reaches its cap, so it can
  exceed the cap by one tensor; a change of dtype or device also starts a new bucket.
  A *direct* parameter (contiguous, at least ``DIRECT_MIN_BYTES`` = 1 MiB) is a bucket by
  itself with no buffer: it is all-reduced in place in its own ``.grad``. Buckets are
  ordered by when they fill up (the position of their last parameter in that order).
- Backward: a ``register_post_accumulate_grad_hook`` on each parameter copies its gradient
  into its slot of the bucket buffer; a direct parameter's ``.grad`` (the tensor autograd
  made) is itself the buffer. When a bucket AND every bucket before it are full, each of them
  is handed to the comm hook (by default: divided by the group size, and its
  ``all_reduce(async_op=True)`` launched). Buckets
  therefore launch in a fixed order on every rank, which gloo needs (it matches collectives
  by issue order).
- End of backward: a callback queued on the autograd engine waits for every hook's result
  (in bucket order; it is copied into the bucket unless it is the bucket) and copies each
  bucket slot back into its parameter's ``.grad``. So ``.grad`` is always the tensor autograd
  made (never a view of a bucket), alive until the user's ``zero_grad``, as in torch's
  default DDP (``gradient_as_bucket_view=False``); only parameters below
  ``DIRECT_MIN_BYTES`` cost bucket memory on top of their gradients.
- Why not ``.grad`` as a view of the bucket (torch's ``gradient_as_bucket_view=True``, and
  this module's first design): then autograd's gradient tensor is freed in the middle of
  backward, right after its copy into the bucket. Under glibc malloc (whose mmap threshold
  rises to the size of the first such block freed, up to 32 MiB) gradient-sized blocks then
  come from the heap, later allocations of the same backward land in the holes they leave,
  and the freed heap stays resident: on benchmarks/ddp.py's MLP that design's peak RSS was
  above torch's default DDP, and dropped below it once ``MALLOC_MMAP_THRESHOLD_`` was fixed
  (the allocator, not live tensors). Small gradients freed mid-backward fragment the heap
  too, so none is freed. The benchmark's table in the README has this design's numbers.
- Rebuild: after the first synchronised backward, the buckets are rebuilt once in the order
  gradients actually arrived on rank 0 (broadcast, so every rank agrees).
- Buffers (``broadcast_buffers=True``): before each forward with grad enabled and outside
  `no_sync`, buffers are broadcast from rank 0, as torch does. Non-source ranks receive into a
  fresh tensor and swap ``buffer.data``, so no version counter is bumped and a buffer saved for
  backward by an earlier forward is not "modified by an inplace operation"
  (two forwards before one backward work; cf. pytorch/pytorch#175024).
- `module.no_sync()`: a context in which backward only accumulates into ``.grad``; the next
  synchronised backward all-reduces the accumulated gradients.
- Unused parameters: a parameter that got no gradient in a synchronised backward is an error
  naming it (RuntimeError at the end of backward), unless ``find_unused_parameters=True``:
  then its slot contributes zeros (or its accumulated ``.grad`` from `no_sync` steps), one
  extra all-reduce of a "used" bitmap per step finds parameters unused on *every* rank, and
  those keep ``.grad`` as it was (``None`` after ``zero_grad()``), exactly as torch does;
  a parameter used on some rank gets the group average (other ranks counted as zero).
- Uneven inputs: `agree_num_batches` (one all-reduce MIN at epoch start); every rank then runs
  that many batches and drops the rest, so no rank waits on a collective that never comes.
- Data check: at each of the first forwards with grad (up to 8, fewer once the ranks' inputs
  differ), the ranks compare a fingerprint of their positional and keyword tensor arguments
  (one all-gather each); inputs identical everywhere at all of them warn that the data were
  never sharded (`meshrun.parallel.data_check`; ``MESHRUN_DATA_CHECK=0`` switches it off).
- Communication hooks (`meshrun.parallel.comm_hooks`, torch's ``register_comm_hook``): what
  happens to a full bucket is a hook, called with the bucket's *local* gradients when the
  bucket launches and waited for at the end of backward, both in bucket order. The default
  divides by the group size and all-reduces (`allreduce_hook`); ``grad_compression="bf16"|
  "fp16"`` is `bf16_compress_hook` / `fp16_compress_hook` (all-reduced in that dtype, half the
  bytes, copied back into the fp32 bucket); ``module.register_comm_hook(state, hook)`` installs
  another (PowerSGD: `comm_hooks.powerSGD_hook`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshrun import _torch
from meshrun.parallel import comm_hooks
from meshrun.parallel._comm import broadcast_from_first_, group_device, launched, wait
from meshrun.parallel.data_check import InputCheck, watch_samplers
from meshrun.parallel.heartbeat import heartbeat

MiB = 1024 * 1024
#: A contiguous parameter of at least this many bytes is all-reduced in its own ``.grad``
#: (a bucket by itself: no bucket buffer, no copies); see the module docstring.
DIRECT_MIN_BYTES = 1 * MiB


def ddp(module: nn.Module, group: dist.ProcessGroup | None = None, *,
        bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0,
        find_unused_parameters: bool = False, broadcast_buffers: bool = True,
        grad_compression: str | None = None) -> nn.Module:
    """Make ``module`` data-parallel over ``group``; return the same module object.

    After ``loss.backward()`` every parameter's ``.grad`` holds the average over the group's
    ranks of the local gradients, in the tensor autograd produced (a parameter of at least
    ``DIRECT_MIN_BYTES`` is reduced there in place; smaller ones go through a flat bucket
    buffer and are copied back). Adds
    ``module.no_sync()``, a context manager that skips communication (gradient accumulation),
    and ``module.register_comm_hook(state, hook)`` (see `_Reducer.register_comm_hook`).

    Args:
        module: the model, already on its device. Its parameters and buffers are overwritten
            with rank 0's (of ``group``) at wrap time.
        group: process group to average over (default: the whole world).
        bucket_cap_mb: bucket size in MiB (2**20 bytes), as torch's ``bucket_cap_mb``.
        first_bucket_cap_mb: size of the first bucket to be reduced, MiB (torch: 1).
        find_unused_parameters: allow parameters that get no gradient in a backward (see the
            module docstring for the semantics; costs one extra small all-reduce per step).
        broadcast_buffers: broadcast buffers from rank 0 before each forward (torch's default).
        grad_compression: ``None``, ``"bf16"`` or ``"fp16"``: all-reduce dtype (a shorthand
            for ``register_comm_hook(group, bf16_compress_hook)`` / ``fp16_compress_hook``).

    Returns:
        ``module`` itself.

    Raises:
        RuntimeError: the default process group is not initialised, or the module was already
            passed to ``ddp``. At the end of a backward: parameters got no gradient and
            ``find_unused_parameters`` is False (the message names them), or a parameter got a
            gradient twice in one backward.
        ValueError: unknown ``grad_compression`` or a non-positive bucket cap.
    """
    if not dist.is_initialized():
        raise RuntimeError("ddp: the default process group is not initialised; "
                           "call meshrun.parallel.init() first")
    if getattr(module, "_meshrun_ddp", None) is not None:
        raise RuntimeError("ddp: this module is already data-parallel (ddp() was called on it)")
    if grad_compression is not None and grad_compression not in comm_hooks.COMPRESSION_HOOKS:
        raise ValueError(f"ddp: grad_compression must be None, 'bf16' or 'fp16' "
                         f"(got {grad_compression!r})")
    if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
        raise ValueError(f"ddp: bucket caps must be positive (got bucket_cap_mb={bucket_cap_mb}, "
                         f"first_bucket_cap_mb={first_bucket_cap_mb})")
    reducer = _Reducer(module, group, int(bucket_cap_mb * MiB), int(first_bucket_cap_mb * MiB),
                       find_unused_parameters, broadcast_buffers)
    if grad_compression is not None:
        reducer.hook = comm_hooks.COMPRESSION_HOOKS[grad_compression]
        reducer.hook_name = f"grad_compression={grad_compression!r}"
    module._meshrun_ddp = reducer  # a plain attribute: not a submodule, not in state_dict
    module.no_sync = reducer.no_sync
    module.register_comm_hook = reducer.register_comm_hook
    return module


def unwrap(module: nn.Module) -> bool:
    """Undo `ddp` on ``module``: remove its hooks, ``no_sync`` and ``register_comm_hook``.

    Parameters, their ``.grad`` and buffers are left as they are, so `ddp` can be applied
    again over another group: `meshrun.parallel.elastic` does this when the world changes
    in place (the old group is gone, the module and its optimizer live on). A communication
    hook registered on the module goes with it (register it again after the new `ddp`).

    Returns:
        True when ``module`` was data-parallel, False when there was nothing to undo.
    """
    reducer = getattr(module, "_meshrun_ddp", None)
    if reducer is None:
        return False
    for handle in reducer.handles:
        handle.remove()
    del module._meshrun_ddp, module.no_sync, module.register_comm_hook
    return True


def agree_num_batches(num_batches: int, group: dist.ProcessGroup | None = None) -> int:
    """Uneven inputs: return the smallest ``num_batches`` over the group's ranks.

    Call once per epoch, on every rank, before the loop; then run exactly that many batches
    (drop the rest), so every rank issues the same collectives and none hangs. One all-reduce
    (MIN) of one int64. Same effect as ``DistributedSampler(drop_last=True)`` when the
    per-rank counts are not known in advance; a simpler alternative to torch's ``Join``.
    """
    device = group_device(group)
    count = torch.tensor([num_batches], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
    return int(count.item())


# -------------------------------------------------------------------------------------------
# the reducer: buckets, hooks, and the end-of-backward callback


@dataclass
class _Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it."""

    params: list[int]  # indices into _Reducer.params
    offsets: list[int]  # element offset of each parameter in the buffer
    buffer: torch.Tensor | None  # 1-D, dtype/device of its parameters; direct: the .grad
    pending: int = 0  # gradients still to arrive in this backward
    result: object = None  # what the comm hook returned (a Future, a tensor, a Pending)
    hook_bucket: comm_hooks.GradBucket | None = None  # what the hook was given
    views: list[torch.Tensor] = field(default_factory=list)  # per-parameter views of buffer
    direct: bool = False  # one large parameter, all-reduced in its own .grad (no buffer)


class _Reducer:
    def __init__(self, module, group, bucket_cap, first_bucket_cap, find_unused,
                 broadcast_buffers):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.find_unused = find_unused
        self.hook, self.hook_state = comm_hooks.allreduce_hook, group
        self.hook_name: str | None = None  # what installed a hook other than the default
        self.bucket_cap, self.first_bucket_cap = bucket_cap, first_bucket_cap
        named = list(module.named_parameters())  # shared parameters appear once
        self.params = [p for _, p in named if p.requires_grad]
        self.names = [n for n, p in named if p.requires_grad]
        self.buffers = [b for b in module.buffers()] if broadcast_buffers else []
        self.sync = True  # False inside no_sync()
        self.rebuilt = False
        self.arrival_order: list[int] = []
        self.pending_groups: list[list[int]] | None = None  # a rebuild due at the next backward
        self.in_backward = False
        self.next_bucket = 0
        self.arrived = [False] * len(self.params)

        broadcast_from_first_(([p for _, p in named] + list(module.buffers())), group)
        self._build_buckets(self._assign(list(reversed(range(len(self.params))))))
        self.handles = [p.register_post_accumulate_grad_hook(lambda param, i=i: self._on_grad(i))
                        for i, p in enumerate(self.params)]  # fmt: skip
        self.input_check = InputCheck(group)  # the same-data check (`meshrun.parallel.data_check`)
        watch_samplers()  # ... which knows DistributedSampler's padding
        self.handles.append(module.register_forward_pre_hook(
            lambda mod, args, kwargs: self._before_forward(args, kwargs), with_kwargs=True))

    # -- public -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this context backward accumulates into ``.grad`` without communicating."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def register_comm_hook(self, state: object, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the default all-reduce
        (torch's ``DistributedDataParallel.register_comm_hook``; the contract is in
        `meshrun.parallel.comm_hooks`).

        Args:
            state: passed to every call as is (a process group for the stateless built-in
                hooks, a `comm_hooks.PowerSGDState` for `comm_hooks.powerSGD_hook`; a hook
                keeps what it carries between steps here).
            hook: ``hook(state, bucket: GradBucket)`` returning the bucket's averaged
                gradient: a Tensor, or a ``torch.futures.Future`` / `comm_hooks.Pending`
                whose ``wait()`` gives one.

        Raises:
            RuntimeError: a hook is already registered, or ``grad_compression`` was given to
                `ddp` (one hook per module, as torch: pass ``grad_compression=None`` and
                register ``fp16_compress_hook`` yourself to combine), or called during a
                backward.
            TypeError: ``hook`` is not callable.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable as hook(state, bucket) "
                            f"(got {type(hook).__name__})")
        if self.hook_name is not None:
            raise RuntimeError(f"register_comm_hook: this module already reduces with "
                               f"{self.hook_name}; one hook per module (torch's rule)")
        if self.in_backward:
            raise RuntimeError("register_comm_hook: called during a backward; register the "
                               "hook before training")
        self.hook, self.hook_state = hook, state
        self.hook_name = getattr(hook, "__qualname__", repr(hook))

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    # -- buckets ----------------------------------------------------------------------------

    def _direct(self, i: int) -> bool:
        p = self.params[i]
        return p.numel() * p.element_size() >= DIRECT_MIN_BYTES and p.is_contiguous()

    def _assign(self, order: list[int]) -> list[list[int]]:
        """Pack parameter indices, in ``order``, into buckets by size cap, dtype and device.

        A direct parameter is a bucket by itself; the others are packed as if it were not
        there. Buckets are ordered by the position in ``order`` of their last parameter (the
        order in which they fill up)."""
        done: list[tuple[int, list[int]]] = []  # (position of the last parameter, group)
        group: list[int] = []
        size, cap, last = 0, self.first_bucket_cap, -1
        for pos, i in enumerate(order):
            p = self.params[i]
            if self._direct(i):
                done.append((pos, [i]))
                continue
            if group and _key(self.params[group[-1]]) != _key(p):
                done.append((last, group))  # a new dtype/device starts a new bucket
                group, size, cap = [], 0, self.bucket_cap
            group.append(i)
            last = pos
            size += p.numel() * p.element_size()
            if size >= cap:  # close once full (may exceed the cap by one tensor, as torch)
                done.append((pos, group))
                group, size, cap = [], 0, self.bucket_cap
        if group:
            done.append((last, group))
        return [g for _, g in sorted(done, key=lambda d: d[0])]

    def _build_buckets(self, groups: list[list[int]]) -> None:
        """Allocate one flat buffer per group (none for a direct parameter)."""
        self.buckets = []  # drop references to old buffers before allocating new ones
        self.buckets = [self._make_bucket(g) for g in groups]
        self.location = {}
        for b, bucket in enumerate(self.buckets):
            for slot, i in enumerate(bucket.params):
                self.location[i] = (b, slot)
        self._reset()

    def _make_bucket(self, indices: list[int]) -> _Bucket:
        if len(indices) == 1 and self._direct(indices[0]):
            return _Bucket(indices, [0], None, direct=True)
        params = [self.params[i] for i in indices]
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        views = [buffer[o:o + p.numel()].view_as(p) for o, p in zip(offsets, params, strict=True)]
        return _Bucket(indices, offsets, buffer, views=views)

    def _reset(self) -> None:
        self.in_backward = False
        self.next_bucket = 0
        self.arrived = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.pending, bucket.result, bucket.hook_bucket = len(bucket.params), None, None
            if bucket.direct:
                bucket.buffer = None  # the .grad belongs to the parameter (and the optimizer)

    # -- backward ---------------------------------------------------------------------------

    def _on_grad(self, i: int) -> None:
        """Post-accumulate-grad hook of parameter i: its gradient for this backward is final."""
        if not self.in_backward:
            if self.pending_groups is not None:  # the rebuild decided at the last backward's end
                groups, self.pending_groups = self.pending_groups, None
                self._build_buckets(groups)
            self.in_backward = True
            _torch.queue_backward_callback(self._finalize)
        if not self.rebuilt and i not in self.arrival_order:
            self.arrival_order.append(i)
        if not self.sync:
            return
        if self.arrived[i]:
            raise RuntimeError(f"ddp: parameter {self.names[i]!r} got a gradient twice in one "
                               f"backward (reentrant checkpointing or a second backward through "
                               f"the same graph is not supported)")
        self.arrived[i] = True
        b, slot = self.location[i]
        bucket = self.buckets[b]
        self._into_slot(bucket, slot)
        bucket.pending -= 1
        if bucket.pending == 0:
            while (self.next_bucket < len(self.buckets)
                   and self.buckets[self.next_bucket].pending == 0):
                self._launch(self.next_bucket)
                self.next_bucket += 1

    def _into_slot(self, bucket: _Bucket, slot: int) -> bool:
        """Copy the parameter's .grad into its bucket slot (direct bucket: the .grad becomes
        the bucket's buffer, nothing is copied).

        Returns False when the parameter has no gradient (the slot is zeroed)."""
        p = self.params[bucket.params[slot]]
        if bucket.direct:
            return self._adopt(bucket, p)
        view = bucket.views[slot]
        if p.grad is None:
            view.zero_()
            return False
        view.copy_(p.grad)
        return True

    @torch.no_grad()
    def _copy_back(self, bucket: _Bucket) -> None:
        """After the all-reduce: the averaged slots back into the parameters' .grad."""
        if bucket.direct:
            return
        for slot, i in enumerate(bucket.params):
            p = self.params[i]
            if p.grad is None:
                continue  # unused here: _assign_unused decides
            if p.grad.layout == torch.strided:
                p.grad.copy_(bucket.views[slot])
            else:  # e.g. a sparse gradient: .grad becomes dense
                p.grad = bucket.views[slot].clone()

    @staticmethod
    def _adopt(bucket: _Bucket, p: nn.Parameter) -> bool:
        """Direct bucket: its buffer is the parameter's own (contiguous, dense) gradient."""
        if p.grad is None:
            bucket.buffer = torch.zeros_like(p, memory_format=torch.contiguous_format)
            return False
        grad = p.grad
        if grad.layout != torch.strided:
            grad = grad.to_dense()
        if not grad.is_contiguous():
            grad = grad.contiguous()
        if grad is not p.grad:
            p.grad = grad
        bucket.buffer = grad
        return True

    def _launch(self, index: int) -> None:
        """Hand full bucket ``index`` (local gradients) to the comm hook; the next bucket in
        order is launched only after this one, on every rank alike."""
        bucket = self.buckets[index]
        params = [self.params[i] for i in bucket.params]
        views = [bucket.buffer.view_as(params[0])] if bucket.direct else bucket.views
        bucket.hook_bucket = comm_hooks.GradBucket(
            index, bucket.buffer, views, params, [self.names[i] for i in bucket.params],
            is_last=index == len(self.buckets) - 1)
        bucket.result = self.hook(self.hook_state, bucket.hook_bucket)

    def _finalize(self) -> None:
        """End of backward (autograd engine callback): finish the launched all-reduces."""
        if not self.sync:
            self._reset()
            return
        try:
            used = self._launch_remaining()
            for bucket in self.buckets:
                averaged = comm_hooks.resolve(bucket.result, bucket.hook_bucket)
                if averaged is not bucket.buffer:
                    bucket.buffer.copy_(averaged.view_as(bucket.buffer))
                self._copy_back(bucket)
            if used is not None:
                wait(used)
                self._assign_unused(self.local_used)
        finally:
            self._reset()
        heartbeat()  # one synchronised step done: progress for `meshrun --hang-timeout`
        if not self.rebuilt:
            self._rebuild()

    def _launch_remaining(self):
        """Launch buckets that never filled up (parameters without a gradient)."""
        if self.next_bucket == len(self.buckets) and not self.find_unused:
            return None
        missing = [i for i, done in enumerate(self.arrived) if not done]
        if missing and not self.find_unused:
            names = ", ".join(self.names[i] for i in missing)
            raise RuntimeError(
                f"ddp: {len(missing)} parameter(s) received no gradient in this backward: "
                f"{names}. Pass find_unused_parameters=True to ddp(), or make every parameter "
                f"take part in the loss")
        self.local_used = torch.zeros(len(self.params), dtype=torch.int32,
                                      device=self.params[self.buckets[0].params[0]].device)
        for i in range(len(self.params)):
            b, slot = self.location[i]
            has_grad = self.arrived[i] or self._into_slot(self.buckets[b], slot)
            self.local_used[i] = int(has_grad)
        for index in range(self.next_bucket, len(self.buckets)):
            self._launch(index)
        self.next_bucket = len(self.buckets)
        return launched(dist.all_reduce(self.local_used, group=self.group, async_op=True))

    def _assign_unused(self, used: torch.Tensor) -> None:
        """Parameters used on some rank but without a local .grad get the averaged slot;
        unused everywhere keep .grad as it was."""
        for i in torch.nonzero(used).flatten().tolist():
            p = self.params[i]
            if p.grad is None:
                b, slot = self.location[i]
                bucket = self.buckets[b]
                p.grad = bucket.buffer if bucket.direct else bucket.views[slot].clone()

    def _rebuild(self) -> None:
        """Rebuild buckets once, in the order gradients arrived on rank 0 of the group.

        Skipped when every bucket would hold the same parameters as now (the usual case)."""
        self.rebuilt = True
        n = len(self.params)
        seen = set(self.arrival_order)
        order = self.arrival_order + [i for i in reversed(range(n)) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=group_device(self.group))
        dist.broadcast(order_t, group=self.group, group_src=0)
        self.arrival_order = []
        groups = self._assign(order_t.tolist())
        if [set(g) for g in groups] != [set(b.params) for b in self.buckets]:
            # Built at the start of the next backward, not now (the buffers are not needed
            # before then; either way the old ones are dropped before the new are allocated).
            self.pending_groups = groups

    # -- buffers ----------------------------------------------------------------------------

    def _before_forward(self, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: broadcast buffers from rank 0 without bumping version counters;
        at the first forwards with grad, check that the ranks' inputs differ (`data_check`).
        Returns None: the forward's arguments are the caller's."""
        if self.in_backward:  # a backward that raised never reached _finalize: forget it
            self._reset()
        self.input_check(args, kwargs)
        if self.buffers and self.sync and torch.is_grad_enabled():
            broadcast_from_first_(self.buffers, self.group, swap_data=True)


# -------------------------------------------------------------------------------------------
# helpers


def _key(p: torch.Tensor):
    return (p.dtype, p.device)
