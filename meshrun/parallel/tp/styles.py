"""The tensor-parallel styles: what `parallelize` does to each planned module (see
`meshrun.parallel.tp` for the math). A style is data: it says which parameters it shards
(`ShardSpec`) and replaces the module's ``forward`` with local matmuls between the
collectives of `meshrun.parallel.tp.comm`.

Mirrors ``torch.distributed.tensor.parallel``'s styles; Megatron-LM's layers.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshrun import _torch
from meshrun.parallel.tp import comm
from meshrun.parallel.tp.random import RNGTracker
from meshrun.parallel.tp.vocab import vocab_parallel_embedding


class ParallelStyle:
    """Base of the styles; a style is data, applied by `parallelize`."""

    def _shard_specs(self, module: nn.Module, name: str, tp: _TP) -> dict[str, ShardSpec]:
        return {}

    def _apply(self, module: nn.Module, name: str, tp: _TP) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class ColwiseParallel(ParallelStyle):
    """Column-parallel ``nn.Linear`` (or ``nn.Embedding``): output sharded on the last dim.

    Linear ``[out, in]``: rank r holds rows ``[out/P, in]`` (and ``bias[out/P]``); the
    forward maps ``[.., in]`` to ``[.., out/P]``. Embedding ``[V, C]``: rank r holds columns
    ``[V, C/P]``; ids ``[*]`` map to ``[*, C/P]``.

    Args:
        input_layouts: ``Replicate()`` (default: identity forward, all-reduce backward) or
            ``Shard(d)``: the input is sharded along sequence dim ``d`` (sequence
            parallelism; all-gathered in forward and again in backward). Linear only.
        output_layouts: ``Shard(-1)`` (default: keep the local shard) or ``Replicate()``:
            all-gather the last dim (backward keeps this rank's slice).
        use_local_output: accepted for torch compatibility; meshrun always returns plain
            local tensors. Must be True.
        vocab_parallel: (meshrun) this Linear produces logits over a vocabulary: ``out`` is
            padded to a multiple of P and padded logits are ``-inf``.
        chunks: (meshrun) ``out`` is ``chunks`` equal fused blocks (``qkv``: 3), each
            sharded separately, so rank r holds ``[block_0 r; block_1 r; ...]``.

    Raises (at `parallelize`): ValueError for another module type, ``out`` (per chunk) not
    divisible by P without ``vocab_parallel``, or an unsupported layout.

    Mirrors ``torch.distributed.tensor.parallel.ColwiseParallel`` (Megatron's
    ``ColumnParallelLinear``).
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True,
                 vocab_parallel: bool = False, chunks: int = 1):
        self.input_layouts = _one_layout(input_layouts, Replicate(), "input_layouts")
        self.output_layouts = _one_layout(output_layouts, Shard(-1), "output_layouts")
        if not use_local_output:
            raise ValueError("ColwiseParallel: meshrun returns plain local tensors; "
                             "use_local_output must be True (for a vocab-parallel loss pass "
                             "vocab_parallel=True and use vocab_parallel_cross_entropy)")
        if self.output_layouts not in (Shard(-1), Replicate()):
            raise ValueError(f"ColwiseParallel: output_layouts must be Shard(-1) or Replicate() "
                             f"(got {self.output_layouts})")
        if chunks < 1 or (chunks > 1 and vocab_parallel):
            raise ValueError(f"ColwiseParallel: chunks must be >= 1 and 1 with vocab_parallel "
                             f"(got chunks={chunks}, vocab_parallel={vocab_parallel})")
        self.vocab_parallel, self.chunks = vocab_parallel, chunks

    def _shard_specs(self, module, name, tp):
        if isinstance(module, nn.Linear):
            if isinstance(self.input_layouts, Shard) and self.input_layouts.dim == -1:
                raise ValueError(f"{name}: ColwiseParallel input_layouts must be Replicate() or "
                                 f"Shard(<sequence dim>) (got Shard(-1))")
            spec = _spec(name, "out_features", module.out_features, 0, tp, self.chunks,
                         pad=self.vocab_parallel or name in tp.vocab_tied)
            specs = {"weight": spec}
            if module.bias is not None:
                specs["bias"] = spec
            return specs
        if isinstance(module, nn.Embedding):
            _check_embedding(module, name, "ColwiseParallel")
            if not isinstance(self.input_layouts, Replicate) or self.chunks != 1:
                raise ValueError(f"{name}: ColwiseParallel on an Embedding takes replicated "
                                 f"ids and chunks=1")
            return {"weight": _spec(name, "embedding_dim", module.embedding_dim, 1, tp, 1,
                                    pad=False)}
        raise ValueError(f"{name}: ColwiseParallel applies to nn.Linear or nn.Embedding "
                         f"(got {type(module).__name__})")

    def _apply(self, module, name, tp):
        group, gather_out = tp.group, isinstance(self.output_layouts, Replicate)
        if isinstance(module, nn.Embedding):
            def embedding_forward(mod, ids):
                y = F.embedding(ids, mod.weight, mod.padding_idx)
                return comm.gather(y, group, -1) if gather_out else y

            module.forward = types.MethodType(embedding_forward, module)
            return
        spec: ShardSpec = module.weight._meshrun_tp_spec
        seq_dim = self.input_layouts.dim if isinstance(self.input_layouts, Shard) else None
        pad_mask = _pad_mask(spec, tp, module.weight.device)
        chunks = self.chunks

        def linear_forward(mod, x):
            if seq_dim is not None:
                y = comm.AllGatherLinear.apply(x, mod.weight, mod.bias, group, seq_dim)
            else:
                y = F.linear(comm.copy_to_tp(x, group), mod.weight, mod.bias)
            if pad_mask is not None:
                y = y.masked_fill(pad_mask, float("-inf"))
            if not gather_out:
                return y
            y = comm.gather(y, group, -1)
            if chunks > 1:  # [.., P, chunks, n] -> [.., chunks, P, n]
                y = y.unflatten(-1, (tp.size, chunks, -1)).transpose(-3, -2).flatten(-3)
            return y[..., :spec.size]

        module.forward = types.MethodType(linear_forward, module)


class RowwiseParallel(ParallelStyle):
    """Row-parallel ``nn.Linear``, or the vocabulary-parallel ``nn.Embedding``.

    Linear ``[out, in]``: rank r holds columns ``[out, in/P]`` (the bias is replicated);
    input ``[.., in/P]`` (this rank's shard), output ``[.., out]`` summed over the ranks.
    Embedding ``[V, C]``: rank r holds vocabulary rows ``[Vp/P, C]`` (``Vp``: ``V`` padded to
    a multiple of P); ids ``[*]`` (replicated) map to ``[*, C]``.

    Args:
        input_layouts: Linear: ``Shard(-1)`` (default, the output of a ColwiseParallel) or
            ``Replicate()`` (split here; all-gather backward). Embedding: ``Replicate()``.
        output_layouts: ``Replicate()`` (default: all-reduce forward, identity backward) or
            ``Shard(d)``: reduce-scatter along sequence dim ``d`` (sequence parallelism;
            all-gather backward).
        use_local_output: accepted for torch compatibility; must be True.

    Raises (at `parallelize`): ValueError for another module type, ``in`` not divisible by
    P, an Embedding with ``max_norm``, ``scale_grad_by_freq`` or ``sparse``, or an
    unsupported layout.

    Mirrors ``torch.distributed.tensor.parallel.RowwiseParallel`` (Megatron's
    ``RowParallelLinear`` and ``VocabParallelEmbedding``).
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        self.input_layouts = _one_layout(input_layouts, None, "input_layouts")
        self.output_layouts = _one_layout(output_layouts, Replicate(), "output_layouts")
        if not use_local_output:
            raise ValueError("RowwiseParallel: meshrun returns plain local tensors; "
                             "use_local_output must be True")

    def _shard_specs(self, module, name, tp):
        if isinstance(module, nn.Linear):
            if self.input_layouts not in (None, Shard(-1), Replicate()):
                raise ValueError(f"{name}: RowwiseParallel input_layouts must be Shard(-1) or "
                                 f"Replicate() (got {self.input_layouts})")
            return {"weight": _spec(name, "in_features", module.in_features, 1, tp, 1,
                                    pad=False)}
        if isinstance(module, nn.Embedding):
            _check_embedding(module, name, "RowwiseParallel")
            if self.input_layouts not in (None, Replicate()):
                raise ValueError(f"{name}: the vocab-parallel embedding takes replicated ids "
                                 f"(got input_layouts={self.input_layouts})")
            return {"weight": _spec(name, "num_embeddings", module.num_embeddings, 0, tp, 1,
                                    pad=True)}
        raise ValueError(f"{name}: RowwiseParallel applies to nn.Linear or nn.Embedding "
                         f"(got {type(module).__name__})")

    def _apply(self, module, name, tp):
        group = tp.group
        seq_dim = self.output_layouts.dim if isinstance(self.output_layouts, Shard) else None
        split_input = isinstance(self.input_layouts, Replicate)

        def reduce(y):
            if seq_dim is None:
                return comm.reduce_from_tp(y, group)
            return comm.reduce_scatter_to_sp(y, group, seq_dim)

        if isinstance(module, nn.Embedding):
            def embedding_forward(mod, ids):
                return reduce(vocab_parallel_embedding(ids, mod.weight, group, mod.padding_idx))

            module.forward = types.MethodType(embedding_forward, module)
            return

        def linear_forward(mod, x):
            if split_input:
                x = comm.split(x, group, -1)
            y = reduce(F.linear(x, mod.weight))
            if mod.bias is None:
                return y
            # under SP each rank adds the bias to its own tokens: its gradient is partial
            return y + (mod.bias if seq_dim is None else comm.copy_to_tp(mod.bias, group))

        module.forward = types.MethodType(linear_forward, module)


class SequenceParallel(ParallelStyle):
    """A module on activations sharded along the sequence: norms, dropout (Megatron SP).

    Parameters stay replicated; each rank's gradient is a partial sum over its own tokens, so
    they enter the module through ``IdentityFwdAllReduceBwd`` (one all-reduce per module in
    backward, of all its parameters at once). Random ops in the module draw from the per-rank
    stream of the `RNGTracker`. The input must already be sharded (as torch treats a plain
    tensor input); the output stays sharded. Shapes are unchanged.

    Args:
        sequence_dim: the sequence dim of the activations (default 1, batch-first).
        use_local_output: accepted for torch compatibility (outputs are always local).

    Mirrors ``torch.distributed.tensor.parallel.SequenceParallel``.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim

    def _apply(self, module, name, tp):
        _wrap_forward(module, tp, reduce_param_grads=True, fork_rng=True)


class ShardedDropout(ParallelStyle):
    """(meshrun) A dropout, or any parameter-free module, whose input is sharded across the
    TP group (e.g. between a column- and a row-parallel layer): its random ops draw from the
    per-TP-rank stream of the `RNGTracker` (Megatron: ``get_cuda_rng_tracker().fork()``).

    Raises (at `parallelize`): ValueError when the module has parameters.
    """

    def _shard_specs(self, module, name, tp):
        if any(True for _ in module.parameters()):
            raise ValueError(f"{name}: ShardedDropout applies to modules without parameters "
                             f"(got {type(module).__name__})")
        return {}

    def _apply(self, module, name, tp):
        _wrap_forward(module, tp, reduce_param_grads=False, fork_rng=True)


class PrepareModuleInput(ParallelStyle):
    """Change the layouts of a module's positional inputs before its forward.

    ``Replicate() -> Shard(d)``: keep this rank's slice of dim ``d`` (backward all-gathers).
    ``Shard(d) -> Replicate()``: all-gather dim ``d`` (backward keeps this rank's slice: the
    consumer is replicated, or enters TP through a style that all-reduces its gradient).
    ``None`` entries and equal layouts leave that input alone.

    Args:
        input_layouts: a layout or a tuple of them, one per positional input.
        desired_input_layouts: the same length.
        use_local_output: accepted for torch compatibility.

    Mirrors ``torch.distributed.tensor.parallel.PrepareModuleInput`` (positional inputs).
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 use_local_output: bool = False):
        self.input_layouts = _layouts(input_layouts)
        self.desired_input_layouts = _layouts(desired_input_layouts)
        if len(self.input_layouts) != len(self.desired_input_layouts):
            raise ValueError(f"PrepareModuleInput: input_layouts and desired_input_layouts must "
                             f"have the same length (got {len(self.input_layouts)} and "
                             f"{len(self.desired_input_layouts)})")

    def _apply(self, module, name, tp):
        layouts = list(zip(self.input_layouts, self.desired_input_layouts, strict=True))

        def pre_hook(mod, args):
            if len(args) < len(layouts):
                raise ValueError(f"{name}: PrepareModuleInput expects {len(layouts)} "
                                 f"positional inputs (got {len(args)})")
            return tuple(_redistribute(a, *layouts[i], tp) if i < len(layouts) else a
                         for i, a in enumerate(args))

        module.register_forward_pre_hook(pre_hook)


class PrepareModuleOutput(ParallelStyle):
    """Change the layouts of a module's output(s) after its forward (see `PrepareModuleInput`).

    Mirrors ``torch.distributed.tensor.parallel.PrepareModuleOutput``.
    """

    def __init__(self, *, output_layouts=None, desired_output_layouts=None,
                 use_local_output: bool = True):
        self.output_layouts = _layouts(output_layouts)
        self.desired_output_layouts = _layouts(desired_output_layouts)
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError("PrepareModuleOutput: output_layouts and desired_output_layouts "
                             "must have the same length")

    def _apply(self, module, name, tp):
        layouts = list(zip(self.output_layouts, self.desired_output_layouts, strict=True))

        def hook(mod, args, output):
            single = not isinstance(output, tuple)
            outs = (output,) if single else output
            outs = tuple(_redistribute(o, *layouts[i], tp) if i < len(layouts) else o
                         for i, o in enumerate(outs))
            return outs[0] if single else outs

        module.register_forward_hook(hook)


# -------------------------------------------------------------------------------------------
# helpers: specs, forwards, layouts


@dataclass
class _TP:
    group: dist.ProcessGroup | None
    size: int
    rank: int
    rng: RNGTracker | None
    vocab_tied: frozenset = frozenset()  # Linears whose weight is a vocab-parallel embedding's


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is sharded: along ``dim``, ``size`` padded to ``padded``, in
    ``chunks`` fused blocks each split over the ranks."""

    dim: int
    size: int
    padded: int
    chunks: int = 1


def _spec(name, what, size, dim, tp, chunks, pad) -> ShardSpec:
    if size % chunks:
        raise ValueError(f"{name}: {what}={size} is not divisible by chunks={chunks}")
    per_chunk = size // chunks
    if per_chunk % tp.size == 0:
        return ShardSpec(dim, size, size, chunks)
    if pad:
        return ShardSpec(dim, size, -(-size // tp.size) * tp.size, 1)
    fused = f" per chunk ({chunks} chunks)" if chunks > 1 else ""
    raise ValueError(f"{name}: {what}={size}{fused} is not divisible by the TP degree "
                     f"{tp.size}; only a vocabulary is padded (an nn.Embedding under "
                     f"RowwiseParallel, or ColwiseParallel(vocab_parallel=True) on the output "
                     f"layer); choose sizes divisible by {tp.size}")


def _check_embedding(module, name, style):
    bad = [a for a in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(module, a)]
    if bad:
        raise ValueError(f"{name}: {style} does not support nn.Embedding with "
                         f"{', '.join(bad)} set")


def _pad_mask(spec: ShardSpec, tp: _TP, device: torch.device) -> torch.Tensor | None:
    """The padded vocabulary rows of this rank's output (True: -inf), on ``device`` (the
    weight's: masked_fill needs the mask where the logits are), or None if it holds none."""
    if spec.padded == spec.size:
        return None
    rows = spec.padded // tp.size
    mask = torch.arange(tp.rank * rows, (tp.rank + 1) * rows) >= spec.size
    return mask.to(device) if bool(mask.any()) else None


def _wrap_forward(module: nn.Module, tp: _TP, *, reduce_param_grads: bool,
                  fork_rng: bool) -> None:
    """Run the module's own forward with its parameters entering through f (their gradients
    all-reduced once per module) and/or under the per-rank random stream."""
    inner = module.forward

    def forward(mod, *args, **kwargs):
        slots = _torch.parameter_slots(mod)
        names = [n for n, p in slots.items()
                 if p is not None and p.requires_grad] if reduce_param_grads else []
        originals = {n: slots[n] for n in names}
        if names:
            flat = comm.copy_to_tp(torch.cat([originals[n].reshape(-1) for n in names]),
                                      tp.group)
            for n, piece in zip(names, flat.split([originals[n].numel() for n in names]),
                                strict=True):
                slots[n] = piece.view_as(originals[n])  # a view, not a Parameter
        try:
            if fork_rng:
                with tp.rng.fork():
                    return inner(*args, **kwargs)
            return inner(*args, **kwargs)
        finally:
            slots.update(originals)

    module.forward = types.MethodType(forward, module)


def _redistribute(x, src, dst, tp: _TP):
    if src is None or dst is None or src == dst or not isinstance(x, torch.Tensor):
        return x
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return comm.split(x, tp.group, dst.dim)
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return comm.gather(x, tp.group, src.dim)
    raise ValueError(f"redistribute from {src} to {dst} is not supported (Replicate <-> Shard "
                     f"only)")


def _one_layout(layout, default, what):
    if isinstance(layout, tuple):
        if len(layout) != 1:
            raise ValueError(f"{what}: one layout expected (got {layout})")
        layout = layout[0]
    if layout is None:
        return default
    if not isinstance(layout, (Shard, Replicate)):
        raise ValueError(f"{what}: Shard(d) or Replicate() expected (got {layout!r})")
    return layout


def _layouts(layouts) -> tuple:
    if layouts is None:
        return ()
    if not isinstance(layouts, tuple):
        layouts = (layouts,)
    for layout in layouts:
        if layout is not None and not isinstance(layout, (Shard, Replicate)):
            raise ValueError(f"layouts must be Shard(d), Replicate() or None (got {layout!r})")
    return layouts
