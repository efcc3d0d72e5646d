"""DDP communication hooks: what `ddp()` does with each bucket of gradients, as torch's DDP.

A hook decides how one bucket of local gradients becomes the group's average. `ddp()`'s
module has ``register_comm_hook(state, hook)`` (torch's
``DistributedDataParallel.register_comm_hook``); without one, buckets go through
`allreduce_hook`, and ``ddp(..., grad_compression="fp16"|"bf16")`` is a shorthand for
`fp16_compress_hook` / `bf16_compress_hook`. HSDP's replica all-reduce takes the same hooks
(`FSDPModule.register_comm_hook`, `meshrun.parallel.fsdp`): there a bucket is one unit's
reduced shard, and the hook's group is the replica group.

The hook contract (torch's, so torch's own hooks run unchanged on meshrun's buckets)::

    hook(state, bucket: GradBucket) -> torch.futures.Future[Tensor] | Tensor | Pending

- ``bucket.buffer()`` is the bucket's flat 1-D buffer of this rank's *local* gradients (not
  yet divided by the group size); ``bucket.gradients()`` are per-parameter views of it.
- The hook returns the bucket's averaged gradient: a tensor of the buffer's size, or
  something whose ``wait()`` gives one (a torch Future, whose value may also be a one-tensor
  list, as c10d's ``Work.get_future()`` gives; or a `Pending`). `ddp` copies it into the
  buffer unless it *is* the buffer, and from there into each parameter's ``.grad``.
- When: hooks are called in backward, in the fixed bucket order (the same on every rank),
  once a bucket and every bucket before it are full; their results are waited for at the end
  of backward, in the same order. Neither happens inside ``no_sync()`` /
  ``gradient_sync(model, False)``: the accumulated gradients go through the hook at the next
  synchronised backward.
- gloo matches collectives by the order they are issued. Issue every collective from the hook
  itself or from its result's ``wait()`` (both run on the training thread, in bucket order):
  meshrun's PowerSGD does. A collective issued inside a torch ``Future.then`` callback runs on
  a communication thread, in whatever order the buckets finish (torch's PowerSGD chains its
  collectives that way: safe with one bucket or NCCL).

PowerSGD (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization", NeurIPS 2019), as torch's ``powerSGD_hook``: each gradient
matrix ``M`` (``[n, m]``: dim 0 by the rest) is approximated by ``P Q^T`` of rank ``r``; one
power-iteration step per training step, warm-started from the last step's ``Q``, with error
feedback (what the approximation lost on this rank is added to its next gradient). Per bucket
and step it all-reduces the uncompressed tensors, ``P`` (``sum n r`` elements) and ``Q``
(``sum m r``) instead of ``sum n m``. Its state (`PowerSGDState`) is a checkpoint
``Stateful``: ``state = {..., "comm_hook": powersgd_state}`` in `meshrun.parallel.checkpoint`
saves and restores the iteration, the error feedback, the ``Q`` matrices and the random
state, so a resumed run trains on exactly as the uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import placement
from meshrun.parallel._comm import all_reduce_, group_device, launched, wait
from meshrun.parallel.heartbeat import blocked

__all__ = ["GradBucket", "Pending", "PowerSGDState", "allreduce_hook", "bf16_compress_hook",
           "fp16_compress_hook", "powerSGD_hook", "resolve"]


class GradBucket:
    """One bucket of this rank's local gradients, handed to a hook (torch's
    ``torch.distributed.GradBucket``, with the same methods).

    ``buffer()``: the flat 1-D buffer (dtype and device of its parameters); ``gradients()``:
    one view of it per parameter, shaped as the parameter; ``parameters()`` and, meshrun's
    addition, ``parameter_names()`` (the module's names) in the same order; ``index()``: the
    bucket's position in launch order; ``is_last()``: whether it is the last bucket of the
    step (a stateful hook counts steps there); meshrun's addition ``shard_group()``: under
    HSDP the group the gradients were reduce-scattered over before the hook (None under
    DDP), which a hook's agreement across all data-parallel ranks spans with the replicas.
    """

    __slots__ = ("_buffer", "_gradients", "_index", "_is_last", "_names", "_parameters",
                 "_shard_group")

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[nn.Parameter], names: list[str], is_last: bool,
                 shard_group: dist.ProcessGroup | None = None):
        self._index, self._buffer, self._gradients = index, buffer, gradients
        self._parameters, self._names, self._is_last = parameters, names, is_last
        self._shard_group = shard_group

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[nn.Parameter]:
        return self._parameters

    def parameter_names(self) -> list[str]:
        return self._names

    def is_last(self) -> bool:
        return self._is_last

    def shard_group(self) -> dist.ProcessGroup | None:
        return self._shard_group

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer's values with ``tensor``'s (same number of elements)."""
        self._buffer.copy_(tensor.view_as(self._buffer))


class Pending:
    """A hook's result still in flight: ``wait()`` waits for ``works`` (c10d work handles,
    with this rank marked blocked meanwhile), then returns ``then()``, the averaged tensor."""

    def __init__(self, works: list[dist.Work], then: Callable[[], torch.Tensor]):
        self.works, self.then = works, then

    def wait(self) -> torch.Tensor:
        for work in self.works:
            wait(work)
        return self.then()


def resolve(result, bucket: GradBucket) -> torch.Tensor:
    """The tensor a hook's ``result`` stands for (waiting for it if need be), checked against
    ``bucket``'s buffer.

    Raises:
        TypeError: the hook returned neither a tensor nor something with ``wait()``.
        ValueError: the tensor's number of elements differs from the bucket's.
    """
    if not torch.is_tensor(result):
        if not hasattr(result, "wait"):
            raise TypeError(f"comm hook: bucket {bucket.index()}: the hook returned "
                            f"{type(result).__name__}; return a Tensor or a Future of one")
        if isinstance(result, torch.futures.Future):
            with blocked():
                result = result.wait()
        else:
            result = result.wait()
        if isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]
    if not torch.is_tensor(result) or result.numel() != bucket.buffer().numel():
        got = f"{result.numel()} elements" if torch.is_tensor(result) else type(result).__name__
        raise ValueError(f"comm hook: bucket {bucket.index()}: the hook's result has {got}, "
                         f"the bucket {bucket.buffer().numel()}; return the averaged bucket")
    return result


# -- the built-in hooks ----------------------------------------------------------------------


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Pending:
    """The default: divide the bucket by the group size and all-reduce it in place
    (torch's ``default_hooks.allreduce_hook``). ``process_group``: None for the world."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(process_group))
    work = launched(dist.all_reduce(buffer, group=process_group, async_op=True))
    return Pending([work], lambda: buffer)


def fp16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Pending:
    """All-reduce the bucket in float16 (half the bytes) and copy the result back into the
    full-precision buffer (torch's ``default_hooks.fp16_compress_hook``). The bucket is divided
    by the group size *before* the cast, so a sum of large gradients cannot overflow fp16's
    range (65504) where their average does not."""
    return _compressed(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Pending:
    """As `fp16_compress_hook`, in bfloat16 (fp32's range, 8 bits of mantissa; torch's
    ``default_hooks.bf16_compress_hook``)."""
    return _compressed(process_group, bucket, torch.bfloat16)


def _compressed(group, bucket: GradBucket, dtype: torch.dtype) -> Pending:
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    comm = buffer if buffer.dtype == dtype else buffer.to(dtype)
    work = launched(dist.all_reduce(comm, group=group, async_op=True))

    def decompress() -> torch.Tensor:
        if comm is not buffer:
            buffer.copy_(comm)
        return buffer

    return Pending([work], decompress)


#: ``ddp(grad_compression=...)``'s names for the built-in compression hooks.
COMPRESSION_HOOKS = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}


# -- PowerSGD -------------------------------------------------------------------------------


class PowerSGDState:
    """PowerSGD's settings and state, named as torch's
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``.

    Args:
        process_group: the data-parallel group (the one given to `ddp`; None: the world).
        matrix_approximation_rank: ``r``, the rank of each gradient's approximation
            (compression: ``n m`` elements become ``(n + m) r``). 1 to 4 is usual; tune upwards
            by factors of 2 until the loss matches uncompressed training.
        start_powerSGD_iter: plain all-reduce for the first this many synchronised steps (the
            start of training is sensitive to gradient error; torch suggests about 10 % of
            the run, at least the warm-up).
        min_compression_rate: a matrix is compressed only when ``n m > rate (n + m) r``;
            others (biases, norms, small matrices) are all-reduced uncompressed, batched.
        use_error_feedback: add what the last approximation missed on this rank to its next
            gradient (the paper's error feedback; keep it on).
        warm_start: start each step's power iteration from the last step's ``Q`` (keep it on;
            off, ``Q`` is drawn afresh every step).
        orthogonalization_epsilon: added to column norms in Gram-Schmidt (e.g. 1e-8 when a
            gradient column can be all zero; 0 is exact).
        random_seed: seed of the generator that draws the initial ``Q`` (numpy's
            ``RandomState``, as torch's, so the same seed gives torch's ``Q``).

    State (read them; `state_dict` saves them): ``iter`` (synchronised steps seen),
    ``error_dict`` and ``q_memory_dict`` (parameter name -> this rank's error feedback
    ``[n, m]``, and ``Q`` ``[m, r]``), ``where_dict`` (name -> the global offsets and sizes
    of the rows this rank compressed: `powerSGD_hook` refuses state kept for other rows, as a
    checkpoint saved at another sharding gives), ``rng``. Unlike torch's, state is kept per parameter,
    not per bucket, so it survives a rebuild of the buckets and a checkpoint loaded with
    other bucket caps; and error feedback is kept only for compressed matrices (torch keeps it
    for the whole bucket; for the uncompressed part it sums to zero over the ranks, so the
    averaged gradient is the same).

    Raises:
        ValueError: ``matrix_approximation_rank`` < 1, ``min_compression_rate`` <= 0, or
            ``start_powerSGD_iter`` <= 1 with error feedback or warm start (the first step
            also rebuilds `ddp`'s buckets; torch has the same rule).
        ImportError: numpy is not installed (the generator is numpy's, as torch's).
    """

    def __init__(self, process_group: dist.ProcessGroup | None,
                 matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0,
                 random_seed: int = 0):
        import numpy as np  # torch's PowerSGDState needs it too

        if int(matrix_approximation_rank) != matrix_approximation_rank \
                or matrix_approximation_rank < 1:
            raise ValueError(f"PowerSGDState: matrix_approximation_rank must be an integer >= 1 "
                             f"(got {matrix_approximation_rank!r})")
        if min_compression_rate <= 0:
            raise ValueError(f"PowerSGDState: min_compression_rate must be positive "
                             f"(got {min_compression_rate!r})")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(f"PowerSGDState: start_powerSGD_iter must be > 1 with error "
                             f"feedback or warm start (got {start_powerSGD_iter}): the first "
                             f"synchronised step rebuilds ddp's buckets")
        self.process_group = process_group
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[str, torch.Tensor] = {}
        self.q_memory_dict: dict[str, torch.Tensor] = {}
        # parameter name -> where this rank's rows of it lie in the whole parameter (global
        # offsets and sizes of its pieces, int64): a checkpoint loaded at another sharding
        # holds error feedback of other rows, refused rather than added to these
        self.where_dict: dict[str, torch.Tensor] = {}
        self._verify_step = False  # loaded: the next compressed step's buckets all agree
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def compression_stats(self) -> tuple[float, int, int]:
        """(elements before / after compression, elements before, elements after), summed
        over every bucket the hook compressed so far (torch's ``compression_stats``)."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after else 0.0), before, after

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count one synchronised step, at its last bucket."""
        if bucket.is_last():
            self.iter += 1

    # -- checkpoint (a DCP Stateful) --------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything `powerSGD_hook` carries from step to step, under this rank's key
        (``rank<r>``, the global rank: error feedback differs per rank, and under TP so does
        ``Q``). Reads only; tensors are the state's own."""
        name, key, pos, has_gauss, cached = self.rng.get_state()
        return {_rank_key(): {
            "iter": self.iter, "numel_before": self.total_numel_before_compression,
            "numel_after": self.total_numel_after_compression,
            "rng": {"key": torch.from_numpy(key.astype("int64")), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "error": dict(self.error_dict), "q": dict(self.q_memory_dict),
            "where": dict(self.where_dict)}}

    def create_for_load(self, saved: dict[str, torch.Size | None]) -> None:
        """Called by `meshrun.parallel.checkpoint.load` before it fills `state_dict`'s tensors:
        ``saved`` maps the checkpoint's keys under this state (``rank0.error.fc1.weight``) to
        their sizes (None: not a tensor). Makes ``error_dict`` and ``q_memory_dict`` hold
        exactly the saved parameters, as zeros of the saved sizes, to be overwritten.

        Raises:
            ValueError: the checkpoint has PowerSGD state for other ranks but not this one (it
                was saved at another world size: load it at the same one, or give the run a
                fresh `PowerSGDState`).
        """
        mine = _rank_key() + "."
        if not any(k.startswith(mine) for k in saved):
            ranks = sorted({k.split(".", 1)[0] for k in saved})
            raise ValueError(f"PowerSGDState: the checkpoint holds PowerSGD state of "
                             f"{', '.join(ranks) or 'no rank'}, not of {_rank_key()}: it was "
                             f"saved at another world size; load it at the same one, or leave "
                             f"the comm hook's state out of the load (PowerSGD starts afresh)")
        device = self._device()
        for part, target in (("error", self.error_dict), ("q", self.q_memory_dict),
                             ("where", self.where_dict)):
            prefix = f"{mine}{part}."
            sizes = {k[len(prefix):]: size for k, size in saved.items() if k.startswith(prefix)}
            target.clear()
            target.update({name: torch.zeros(size, device=device,
                                             dtype=torch.int64 if part == "where" else None)
                           for name, size in sizes.items()})

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the loaded values (`checkpoint.load` filled the tensors in place)."""
        mine = state_dict[_rank_key()]
        self.iter = int(mine["iter"])
        self.total_numel_before_compression = int(mine["numel_before"])
        self.total_numel_after_compression = int(mine["numel_after"])
        rng = mine["rng"]
        self.rng.set_state(("MT19937", rng["key"].numpy().astype("uint32"), int(rng["pos"]),
                            int(rng["has_gauss"]), float(rng["cached_gaussian"])))
        self.error_dict.update(mine["error"])
        self.q_memory_dict.update(mine["q"])
        self.where_dict.update(mine.get("where", {}))
        self._verify_step = True

    def _device(self) -> torch.device:
        for t in (*self.error_dict.values(), *self.q_memory_dict.values()):
            return t.device
        return group_device(self.process_group) if dist.is_initialized() else torch.device("cpu")


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> Pending:
    """PowerSGD with error feedback (Vogels et al., NeurIPS 2019), as torch's
    ``powerSGD_hook``; the settings are ``state``'s (`PowerSGDState`).

    For the first ``state.start_powerSGD_iter`` synchronised steps: `allreduce_hook`. Then,
    per bucket, with ``r = min(n, m, matrix_approximation_rank)`` for each gradient viewed as
    a matrix ``M`` ``[n, m]`` (dim 0 by the rest):

    1. tensors not worth compressing (``n m <= min_compression_rate (n + m) r``: biases,
       norms, small matrices) are all-reduced as one flat tensor, averaged;
    2. ``M += E`` (this rank's error feedback); ``Q`` ``[m, r]`` is last step's (warm start,
       orthonormalised) or drawn from N(0, 1) and orthonormalised;
    3. ``P = M Q``, all-reduced (summed) and orthonormalised (Gram-Schmidt for ``r <= 2``,
       else QR, as torch);
    4. ``Q = M^T P``, all-reduced and divided by the group size: ``P Q^T`` is the rank-``r``
       approximation of the average of the ranks' ``M`` (exact when that is of rank <= r);
    5. ``M = P Q^T``; ``E = (M + E) - P Q^T``, what this rank's gradient lost.

    Collectives, in order: the flat uncompressed tensors and ``P`` (both at the hook call),
    then ``Q`` (in ``wait()``): issued on the training thread, in bucket order, as gloo needs.
    Compressed matrices are taken grouped by shape (first occurrence order), as torch's, so a
    seed gives torch's initial ``Q``.
    """
    group = state.process_group
    world = dist.get_world_size(group)
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(group, bucket)
    buffer = bucket.buffer()
    rank = state.matrix_approximation_rank
    compress, plain = [], []  # (name, M [n, m], r) / gradient views all-reduced as they are
    for name, grad in zip(bucket.parameter_names(), bucket.gradients(), strict=True):
        matrix = grad.view(grad.shape[0], -1) if grad.dim() else grad.view(1, 1)
        n, m = matrix.shape
        r = min(n, m, rank)
        state.total_numel_before_compression += n * m
        if (n + m) * r * state.min_compression_rate < n * m:
            compress.append((name, matrix, r))
            state.total_numel_after_compression += (n + m) * r
        else:
            plain.append(grad)
            state.total_numel_after_compression += n * m
    _check_where(state, bucket, {name for name, _, _ in compress})
    by_shape: dict[tuple, list] = {}
    for item in compress:  # grouped by shape, each group in bucket order: torch's order
        by_shape.setdefault(tuple(item[1].shape), []).append(item)
    compress = [item for items in by_shape.values() for item in items]

    flat_plain = torch.cat([g.reshape(-1) for g in plain]) if plain else None
    works = []
    if flat_plain is not None:
        flat_plain.div_(world)
        works.append(launched(dist.all_reduce(flat_plain, group=group, async_op=True)))
    if not compress:  # nothing worth compressing in this bucket (biases, norms only)
        state.maybe_increase_iter(bucket)
        return Pending(works, lambda: _unpack(flat_plain, plain, buffer))

    if state.use_error_feedback:
        for name, matrix, _ in compress:
            error = state.error_dict.get(name)
            if error is None:
                state.error_dict[name] = torch.zeros_like(matrix)
            elif error.shape != matrix.shape:
                raise ValueError(f"powerSGD_hook: {name}: the error feedback is "
                                 f"{tuple(error.shape)}, the gradient {tuple(matrix.shape)} "
                                 f"(state of another model, or saved at another sharding?)")
            else:
                matrix.add_(error)
        local = [matrix.clone() for _, matrix, _ in compress]
    p_flat = buffer.new_empty(sum(matrix.shape[0] * r for _, matrix, r in compress))
    q_flat = buffer.new_empty(sum(matrix.shape[1] * r for _, matrix, r in compress))
    ps, qs = _views(p_flat, [(matrix.shape[0], r) for _, matrix, r in compress]), \
        _views(q_flat, [(matrix.shape[1], r) for _, matrix, r in compress])
    fresh = not state.warm_start or any(name not in state.q_memory_dict
                                        for name, _, _ in compress)
    if fresh:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(state.rng.randint(1_000_000_000)))
            for q in qs:
                q.copy_(torch.randn(q.shape, dtype=q.dtype, device="cpu"))
    else:
        for (name, _, _), q in zip(compress, qs, strict=True):
            q.copy_(state.q_memory_dict[name])
    for q in qs:
        _orthogonalize(q, state.orthogonalization_epsilon)
    for (_, matrix, _), p, q in zip(compress, ps, qs, strict=True):
        torch.matmul(matrix, q, out=p)
    works.append(launched(dist.all_reduce(p_flat, group=group, async_op=True)))

    def finish() -> torch.Tensor:
        _unpack(flat_plain, plain, buffer)
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for (_, matrix, _), p, q in zip(compress, ps, qs, strict=True):
            # Q = M^T P as (P^T M)^T: a row-major M read in its own order (on CPU, M^T P, as
            # torch's bmm, is several times slower for large M)
            q.copy_(torch.matmul(p.t(), matrix).t())
        all_reduce_(q_flat, group).div_(world)
        for (name, matrix, _), p, q in zip(compress, ps, qs, strict=True):
            torch.matmul(p, q.t(), out=matrix)
            if state.warm_start:
                state.q_memory_dict[name] = q
        if state.use_error_feedback:
            for (name, matrix, _), before in zip(compress, local, strict=True):
                torch.sub(before, matrix, out=state.error_dict[name])
        state.maybe_increase_iter(bucket)
        return buffer

    return Pending(works, finish)


def _check_where(state: PowerSGDState, bucket: GradBucket, names: set[str]) -> None:
    """Record where this rank's rows of each compressed parameter lie, and refuse state kept
    for other rows (a checkpoint saved at another sharding: the same shapes, other rows, or
    no rows now where there were some).

    In the first compressed step after a load, every bucket's verdict is agreed by all the
    data-parallel ranks (a MAX of a flag over the bucket's shard group, then the replicas:
    the whole dp_replicate x dp_shard grid), so that all of them refuse together rather than
    some raising while the others wait in their next collective. Every rank calls the hook
    for every bucket (an empty one too), in the same order, so the flags line up.

    Raises:
        ValueError: the state of one of ``names`` was kept for other pieces on some rank.
    """
    mismatch = None
    for name, param in zip(bucket.parameter_names(), bucket.parameters(), strict=True):
        if name not in names and name not in state.where_dict:
            continue  # neither compressed now nor when the state was kept
        where = torch.tensor([n for piece in placement.pieces(param)
                              for n in (*piece.offsets, *piece.sizes)], dtype=torch.int64)
        saved = state.where_dict.get(name)
        if saved is not None and mismatch is None and not torch.equal(saved.cpu(), where):
            mismatch = (name, saved.tolist(), where.tolist())
        state.where_dict[name] = where
    if state._verify_step:
        if bucket.is_last():
            state._verify_step = False
        flag = torch.tensor([int(mismatch is not None)], device=bucket.buffer().device)
        for group in (bucket.shard_group(), state.process_group):
            if group is not None:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and mismatch is None:
            raise ValueError("powerSGD_hook: the PowerSGD state (error feedback, Q) loaded on "
                             "another rank was kept for other rows of its parameters: the "
                             "checkpoint was saved at another sharding or world size; load it "
                             "at the same layout, or leave the comm hook's state out of the "
                             "load (PowerSGD starts afresh)")
    if mismatch is not None:
        name, saved, where = mismatch
        raise ValueError(f"powerSGD_hook: {name}: the PowerSGD state (error feedback, Q) "
                         f"was kept for the pieces (offsets, sizes) {saved} of the "
                         f"parameter, this rank now holds {where}: the checkpoint was saved "
                         f"at another sharding or world size; load it at the same layout, or "
                         f"leave the comm hook's state out of the load (PowerSGD starts "
                         f"afresh)")


def _unpack(flat: torch.Tensor | None, views: list[torch.Tensor], buffer: torch.Tensor):
    """The averaged uncompressed tensors back into their views of the bucket."""
    offset = 0
    for view in views:
        view.copy_(flat[offset:offset + view.numel()].view_as(view))
        offset += view.numel()
    return buffer


def _views(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        out.append(flat[offset:offset + math.prod(shape)].view(shape))
        offset += math.prod(shape)
    return out


def _orthogonalize(matrix: torch.Tensor, epsilon: float = 0) -> None:
    """Orthonormalise the columns of ``matrix`` ``[n, r]`` (r <= n) in place: Gram-Schmidt for
    r <= 2 or half precision, else the Q of a reduced QR (torch's choice: QR is faster for
    larger r and has no half-precision kernel)."""
    r = matrix.shape[1]
    if r <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            col = matrix[:, i:i + 1]
            col.div_(torch.linalg.vector_norm(col, dim=0, keepdim=True) + epsilon)
            if i + 1 < r:
                rest = matrix[:, i + 1:]
                rest.sub_((col * rest).sum(dim=0, keepdim=True) * col)
    else:
        matrix.copy_(torch.linalg.qr(matrix, mode="reduced").Q)


def _rank_key() -> str:
    return f"rank{dist.get_rank() if dist.is_initialized() else 0}"
