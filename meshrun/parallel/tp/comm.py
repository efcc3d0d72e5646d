"""The communication of tensor and sequence parallelism, as autograd functions.

Megatron-LM (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism"; Korthikanti et al., 2022, "Reducing Activation Recomputation
in Large Transformer Models") writes a tensor-parallel layer as local matmuls between a few
communication operators, each the transpose of the other in backward:

==============================  =====================  =====================  =============
function                        forward                backward               Megatron name
==============================  =====================  =====================  =============
`IdentityFwdAllReduceBwd`       identity               all-reduce             f
`AllReduceFwdIdentityBwd`       all-reduce             identity               g
`ReduceScatterFwdAllGatherBwd`  reduce-scatter         all-gather             g-bar (SP)
`SplitFwdAllGatherBwd`          keep this rank's part  all-gather             scatter
`AllGatherFwdSplitBwd`          all-gather on a dim    keep this rank's part  gather
`AllGatherLinear`               all-gather + linear    all-gather again,      f-bar fused
                                                       reduce-scatter dX      with the GEMM
==============================  =====================  =====================  =============

Why each is its own ``torch.autograd.Function``: the backward of a collective depends on what
the gradient at its output *is* (partial sums on each rank, or the same full value on each
rank), which autograd cannot infer from a plain tensor; naming the pair makes the choice
explicit and every use correct by construction.

`AllGatherLinear` is the sequence-parallel input of a column-parallel linear (all-gather the
sequence-sharded input, then ``X W^T + b``). It saves only the *sharded* input for backward
and all-gathers it again there (asynchronously, overlapped with ``dX = dY W``), as Megatron's
``LinearWithGradAccumulationAndAsyncCommunication`` does: the full-sequence input of every
column layer is never kept alive between forward and backward, which is most of the
activation memory sequence parallelism saves. The cost is one extra all-gather per column
layer in backward.

Sharding along a dim ``d`` that is not 0 (the batch-first ``[B, T, C]`` sequence dim is 1):
``all_gather_single``/``all_gather_into_tensor`` concatenate along dim 0, so the rank-major
result ``[P * B, T / P, C]`` is viewed as ``[P, B, T / P, C]`` and moved to dim ``d`` (one
copy); reduce-scatter does the opposite before communicating. Every rank must call these in
the same order (gloo matches collectives by issue order); autograd on identical graphs does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshrun.parallel._comm import all_gather_flat, all_reduce_, reduce_scatter_flat, wait

# -------------------------------------------------------------------------------------------
# autograd functions


class IdentityFwdAllReduceBwd(torch.autograd.Function):
    """f: the input of a tensor-parallel region. Forward: identity. Backward: all-reduce (sum).

    Each rank's region computes a partial gradient w.r.t. the replicated input; the sum is the
    full gradient. Shapes unchanged.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous(), ctx.group), None


class AllReduceFwdIdentityBwd(torch.autograd.Function):
    """g: the output of a tensor-parallel region. Forward: all-reduce (sum). Backward: identity.

    The output is replicated, so its gradient is the same on every rank and flows to each
    rank's partial unchanged. Shapes unchanged.
    """

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceScatterFwdAllGatherBwd(torch.autograd.Function):
    """g-bar (sequence parallel): partial ``[.., T, ..]`` -> summed ``[.., T/P, ..]`` on ``dim``.

    Backward: each rank holds the gradient of its own slice; all-gather rebuilds the full
    gradient, which is the gradient of every rank's partial input.
    """

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim), None, None


class SplitFwdAllGatherBwd(torch.autograd.Function):
    """Replicated ``[.., N, ..]`` -> this rank's ``[.., N/P, ..]`` on ``dim`` (no communication).

    Backward: all-gather the slices' gradients into the full gradient of the replicated input.
    """

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _my_slice(x, group, dim).clone()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim), None, None


class AllGatherFwdSplitBwd(torch.autograd.Function):
    """Sharded ``[.., N/P, ..]`` -> replicated ``[.., N, ..]`` on ``dim``.

    For a gathered tensor consumed by replicated computation (the gradient is the same full
    value on every rank): backward keeps this rank's slice, without communication.
    """

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _my_slice(grad, ctx.group, ctx.dim).contiguous(), None, None


class AllGatherLinear(torch.autograd.Function):
    """Sequence-parallel column linear: ``Y = all_gather(X, dim) W^T + b``, re-gathered in bwd.

    Shapes: ``x`` ``[.., T/P, .., in]`` (sharded on ``dim``), ``weight`` ``[out/P, in]``,
    ``bias`` ``[out/P]`` or None -> ``[.., T, .., out/P]``. Backward: all-gather ``x`` again
    (async, overlapped with ``dX = dY W``), reduce-scatter ``dX`` to ``[.., T/P, .., in]``
    (async, overlapped with ``dW = dY^T X``). Saves only the sharded ``x``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, dim):
        ctx.group, ctx.dim, ctx.has_bias = group, dim, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather(x, group, dim), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, dim = ctx.group, ctx.dim
        gathering = _AsyncAllGather(x, group, dim)  # overlapped with dX
        grad_x_full = grad.matmul(weight)
        x_full = gathering.wait()
        scattering = _AsyncReduceScatter(grad_x_full, group, dim)  # overlapped with dW
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_w = grad2d.t().matmul(x_full.reshape(-1, x_full.shape[-1]))
        grad_b = grad2d.sum(0) if ctx.has_bias else None
        return scattering.wait(), grad_w, grad_b, None, None


# -------------------------------------------------------------------------------------------
# functional forms (what the layers call)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """`IdentityFwdAllReduceBwd`: enter a tensor-parallel region with a replicated tensor."""
    return IdentityFwdAllReduceBwd.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """`AllReduceFwdIdentityBwd`: sum the partial outputs of a tensor-parallel region."""
    return AllReduceFwdIdentityBwd.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """`ReduceScatterFwdAllGatherBwd`: partial full-sequence -> summed sequence shard."""
    return ReduceScatterFwdAllGatherBwd.apply(x, group, dim)


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """`SplitFwdAllGatherBwd`: replicated -> this rank's slice on ``dim``."""
    return SplitFwdAllGatherBwd.apply(x, group, dim)


def gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """`AllGatherFwdSplitBwd`: sharded on ``dim`` -> replicated (consumer replicated)."""
    return AllGatherFwdSplitBwd.apply(x, group, dim)


# -------------------------------------------------------------------------------------------
# collectives on an arbitrary dim (no autograd)


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order). ``[.., n, ..] -> [.., P n, ..]``.

    Raises RuntimeError (from c10d) if the ranks' shapes differ.
    """
    return _AsyncAllGather(x, group, dim).wait()


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's slice of ``dim``: ``[.., N, ..] -> [.., N/P, ..]``.

    Raises ValueError if ``x.shape[dim]`` is not divisible by the group size.
    """
    return _AsyncReduceScatter(x, group, dim).wait()


class _AsyncAllGather:
    def __init__(self, x, group, dim):
        self.size = dist.get_world_size(group)
        self.dim = dim % x.dim()
        x = x.contiguous()
        self.shape = x.shape
        self.out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                               device=x.device)
        if self.size == 1:
            self.out.copy_(x)
            self.work = None
        else:
            self.work = all_gather_flat(self.out, x, group)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            wait(self.work)
        if self.dim == 0:
            return self.out
        parts = self.out.view(self.size, *self.shape)  # [P, .., n, ..]
        return parts.movedim(0, self.dim).flatten(self.dim, self.dim + 1)


class _AsyncReduceScatter:
    def __init__(self, x, group, dim):
        size = dist.get_world_size(group)
        dim = dim % x.dim()
        if x.shape[dim] % size:
            raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not "
                             f"divisible by the group size {size}")
        if dim != 0:  # rank-major: [.., P, n, ..] -> [P, .., n, ..], contiguous
            x = x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0)
        x = x.contiguous()
        if dim != 0:
            x = x.flatten(0, 1)
        self.out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype,
                               device=x.device)
        self.dim, self.size = dim, size
        if size == 1:
            self.out.copy_(x)
            self.work = None
        else:
            self.work = reduce_scatter_flat(self.out, x, group)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            wait(self.work)
        return self.out  # rank-major input: this rank's block is already in place


def _my_slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % size:
        raise ValueError(f"split: dim {dim} of shape {tuple(x.shape)} is not divisible by the "
                         f"group size {size}")
    return x.chunk(size, dim)[rank]
