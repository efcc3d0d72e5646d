"""`parallelize(module, group_or_mesh, plan)`: Megatron-style tensor and sequence parallelism.

A *plan* maps submodule names to *styles*, as torch's ``parallelize_module`` does; ``*`` in a
name matches one component (``"blocks.*.mlp.0"``). `parallelize` keeps parameter names and
replaces each planned parameter by this rank's shard (a plain ``nn.Parameter``, not a
DTensor), and replaces the planned modules' ``forward`` with the Megatron math below. All
communication is in the autograd functions of `meshrun.parallel.tp_comm`.

With ``P`` ranks in the TP group, rank ``r``, and activations ``X`` ``[B, T, C]``:

- `ColwiseParallel` (Linear ``Y = X A^T + b``, ``A`` ``[out, in]``): rank ``r`` holds rows
  ``A_r`` ``[out/P, in]`` and ``b_r``, computes ``Y_r = X A_r^T + b_r``: output sharded on the
  last dim. Input ``Replicate()``: identity forward, all-reduce backward (Megatron's f).
  Input ``Shard(1)`` (sequence parallel): all-gather the sequence in forward, reduce-scatter
  the input gradient in backward; the gathered input is *not* saved for backward but gathered
  again there (`tp_comm.AllGatherLinear`), as Megatron does, to save activation memory.
  ``chunks=k`` (a meshrun extension) shards a fused projection such as ``qkv`` ``[3C, C]``
  block by block, so rank ``r`` holds ``[q_r; k_r; v_r]`` and its heads stay whole.
- `RowwiseParallel` (Linear): rank ``r`` holds columns ``A_r`` ``[out, in/P]``, computes the
  partial ``X_r A_r^T`` on its input shard; output ``Replicate()``: all-reduce forward,
  identity backward (g); ``Shard(1)``: reduce-scatter along the sequence forward, all-gather
  backward (g-bar). The bias (replicated) is added once, after the reduction.
- `RowwiseParallel` on an ``nn.Embedding``: the vocabulary-parallel embedding. Rows (the
  vocabulary) are sharded; ids outside the local range are masked (`vocab_parallel`), and the
  partial lookups are all-reduced (or reduce-scattered along the sequence).
- `ColwiseParallel(vocab_parallel=True)` on the output Linear: logits sharded on the
  vocabulary, for `vocab_parallel_cross_entropy`, which never gathers them.
- `SequenceParallel`: a norm (or dropout) on activations sharded along the sequence; its
  parameters are replicated and their gradients, partial sums over each rank's tokens, are
  all-reduced in backward (the parameters enter the module through f).
- `PrepareModuleInput` / `PrepareModuleOutput`: change an input/output layout between
  ``Replicate()`` and ``Shard(d)`` (split forward / all-gather backward, or the reverse).

Vocabulary padding: a vocabulary ``V`` (an Embedding under `RowwiseParallel`, a Linear under
``ColwiseParallel(vocab_parallel=True)``, or one tied to such an Embedding) is padded with
zero rows to ``Vp``, the next multiple of ``P`` (Megatron's ``padded_vocab_size``); padded
logits are ``-inf``, so softmax, sampling and the loss ignore them. Any other dimension that
``P`` does not divide is refused at `parallelize` time.

Tied weights (an Embedding and the output Linear sharing one Parameter) stay tied: both are
vocabulary-sharded the same way and share one local shard. A tied parameter used by a
module outside the plan, or sharded differently by two styles, is refused, naming both.

State dicts: each sharded parameter's `meshrun.parallel.placement` record says what its shard
is, so ``state_dict()`` gives it as a ``DTensor`` of the unsplit shape, ``Shard(dim)`` on a
1-D DeviceMesh of the TP group, its local tensor this rank's valid rows (a padded vocabulary
keeps ``ceil(V / P)`` rows per rank, so the valid rows are ``torch.chunk`` 's, as with
DTensor's ``Shard``); torch DCP saves that as the unsplit model. Fused chunks (``chunks > 1``)
are not a DTensor layout: ``state_dict()`` raises ValueError naming the parameter (save with
`meshrun.parallel.checkpoint`, or gather with ``full_state_dict()``). ``load_state_dict``
accepts those DTensors, full tensors, or local shards.

Dropout: modules under `SequenceParallel` or `ShardedDropout` run under the per-TP-rank
stream of an `RNGTracker` (their activations are sharded); every other random op draws from
the default stream, which must be the same on every TP rank (checked at `parallelize` when
the model has dropout).

Collectives per transformer layer (attention + MLP, each a Colwise -> Rowwise pair):
without sequence parallelism, 2 all-reduces forward and 2 backward; with it, 2 all-gathers +
2 reduce-scatters forward, and 4 all-gathers (2 of them re-gathering the inputs of the column
layers) + 2 reduce-scatters backward, plus one small all-reduce per sequence-parallel norm
and per row-parallel bias for their parameter gradients.

Sources: Shoeybi et al. 2019 (Megatron-LM), Korthikanti et al. 2022 (sequence parallelism);
the API mirrors ``torch.distributed.tensor.parallel`` (``parallelize_module``,
``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``).
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshrun.parallel import placement, tp_comm
from meshrun.parallel.mesh import Mesh
from meshrun.parallel.tp_random import RNGTracker
from meshrun.parallel.vocab_parallel import vocab_parallel_embedding

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleOutput",
           "Replicate", "RowwiseParallel", "SequenceParallel", "Shard", "ShardedDropout",
           "full_tensor", "parallelize"]


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
    _broadcast_state(module, group)
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
# styles


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
                return tp_comm.gather(y, group, -1) if gather_out else y

            module.forward = types.MethodType(embedding_forward, module)
            return
        spec: ShardSpec = module.weight._meshrun_tp_spec
        seq_dim = self.input_layouts.dim if isinstance(self.input_layouts, Shard) else None
        pad_mask = _pad_mask(spec, tp, module.weight.device)
        chunks = self.chunks

        def linear_forward(mod, x):
            if seq_dim is not None:
                y = tp_comm.AllGatherLinear.apply(x, mod.weight, mod.bias, group, seq_dim)
            else:
                y = F.linear(tp_comm.copy_to_tp(x, group), mod.weight, mod.bias)
            if pad_mask is not None:
                y = y.masked_fill(pad_mask, float("-inf"))
            if not gather_out:
                return y
            y = tp_comm.gather(y, group, -1)
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
                return tp_comm.reduce_from_tp(y, group)
            return tp_comm.reduce_scatter_to_sp(y, group, seq_dim)

        if isinstance(module, nn.Embedding):
            def embedding_forward(mod, ids):
                return reduce(vocab_parallel_embedding(ids, mod.weight, group, mod.padding_idx))

            module.forward = types.MethodType(embedding_forward, module)
            return

        def linear_forward(mod, x):
            if split_input:
                x = tp_comm.split(x, group, -1)
            y = reduce(F.linear(x, mod.weight))
            if mod.bias is None:
                return y
            # under SP each rank adds the bias to its own tokens: its gradient is partial
            return y + (mod.bias if seq_dim is None else tp_comm.copy_to_tp(mod.bias, group))

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
# helpers: plan matching, specs, sharding


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
        for pname, p in mod._parameters.items():
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
    shard._meshrun_tp_spec = spec  # read by this file's styles only
    cut = placement.Cut("tp", tp.group, spec.dim, tp.size, tp.rank, spec.chunks, spec.padded)
    placement.record(shard, placement.of(full).narrow(cut))
    return shard


def _pad_mask(spec: ShardSpec, tp: _TP, device: torch.device) -> torch.Tensor | None:
    """The padded vocabulary rows of this rank's output (True: -inf), on ``device`` (the
    weight's: masked_fill needs the mask where the logits are), or None if it holds none."""
    if spec.padded == spec.size:
        return None
    rows = spec.padded // tp.size
    mask = torch.arange(tp.rank * rows, (tp.rank + 1) * rows) >= spec.size
    return mask.to(device) if bool(mask.any()) else None


def _register_state_dict_hooks(module: nn.Module, names: list[str]) -> None:
    """``state_dict()`` of the sharded parameters: DTensors of the global shape; and
    ``load_state_dict`` takes those, full tensors, or local shards (`placement`)."""
    placement.register_state_dict_hooks(module, [(n, module._parameters[n]) for n in names])


@torch.no_grad()
def _broadcast_state(module: nn.Module, group) -> None:
    """Start every TP rank from rank 0's parameters and buffers (one message per dtype)."""
    tensors = [p for p in module.parameters()] + [b for b in module.buffers()]
    by_key: dict = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    for ts in by_key.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, group=group, group_src=0)
        offset = 0
        for t in ts:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _check_dropout_rng(module: nn.Module, targets, group) -> None:
    """Replicated dropout needs the same default stream on every TP rank."""
    has_dropout = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
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


def _wrap_forward(module: nn.Module, tp: _TP, *, reduce_param_grads: bool,
                  fork_rng: bool) -> None:
    """Run the module's own forward with its parameters entering through f (their gradients
    all-reduced once per module) and/or under the per-rank random stream."""
    inner = module.forward

    def forward(mod, *args, **kwargs):
        names = [n for n, p in mod._parameters.items()
                 if p is not None and p.requires_grad] if reduce_param_grads else []
        originals = {n: mod._parameters[n] for n in names}
        if names:
            flat = tp_comm.copy_to_tp(torch.cat([originals[n].reshape(-1) for n in names]),
                                      tp.group)
            for n, piece in zip(names, flat.split([originals[n].numel() for n in names]),
                                strict=True):
                mod._parameters[n] = piece.view_as(originals[n])  # a view, not a Parameter
        try:
            if fork_rng:
                with tp.rng.fork():
                    return inner(*args, **kwargs)
            return inner(*args, **kwargs)
        finally:
            mod._parameters.update(originals)

    module.forward = types.MethodType(forward, module)


def _redistribute(x, src, dst, tp: _TP):
    if src is None or dst is None or src == dst or not isinstance(x, torch.Tensor):
        return x
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return tp_comm.split(x, tp.group, dst.dim)
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return tp_comm.gather(x, tp.group, src.dim)
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
