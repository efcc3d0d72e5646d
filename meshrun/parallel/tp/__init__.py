"""`parallelize(module, group_or_mesh, plan)`: Megatron-style tensor and sequence parallelism.

A *plan* maps submodule names to *styles*, as torch's ``parallelize_module`` does; ``*`` in a
name matches one component (``"blocks.*.mlp.0"``). `parallelize` keeps parameter names and
replaces each planned parameter by this rank's shard (a plain ``nn.Parameter``, not a
DTensor), and replaces the planned modules' ``forward`` with the Megatron math below. All
communication is in the autograd functions of `meshrun.parallel.tp.comm`.

With ``P`` ranks in the TP group, rank ``r``, and activations ``X`` ``[B, T, C]``:

- `ColwiseParallel` (Linear ``Y = X A^T + b``, ``A`` ``[out, in]``): rank ``r`` holds rows
  ``A_r`` ``[out/P, in]`` and ``b_r``, computes ``Y_r = X A_r^T + b_r``: output sharded on the
  last dim. Input ``Replicate()``: identity forward, all-reduce backward (Megatron's f).
  Input ``Shard(1)`` (sequence parallel): all-gather the sequence in forward, reduce-scatter
  the input gradient in backward; the gathered input is *not* saved for backward but gathered
  again there (`comm.AllGatherLinear`), as Megatron does, to save activation memory.
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

Files: ``api.py`` (`parallelize`, `full_tensor`), ``styles.py`` (the styles), ``comm.py`` (the
collectives as autograd functions), ``vocab.py`` (vocabulary-parallel embedding and loss),
``random.py`` (`RNGTracker`, the per-rank dropout streams).
"""

from meshrun.parallel.tp.api import full_tensor, parallelize
from meshrun.parallel.tp.random import RNGTracker
from meshrun.parallel.tp.styles import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    ShardedDropout,
)
from meshrun.parallel.tp.vocab import vocab_parallel_cross_entropy

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleOutput",
           "RNGTracker", "RowwiseParallel", "SequenceParallel", "ShardedDropout", "full_tensor",
           "parallelize", "vocab_parallel_cross_entropy"]
