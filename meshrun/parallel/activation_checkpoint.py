"""`checkpoint_activations(module, policy)`: trade compute for activation memory.

A checkpointed module keeps (almost) none of the tensors its forward would save for backward;
its backward first runs the forward again to get them back. Per module:

- ``"full"``: only the module's inputs are kept; everything inside is recomputed (one extra
  forward of the module in backward; two in a zero-bubble pipeline stage, whose B and W each
  run a backward through it). Chen et al. 2016, "Training Deep Nets with Sublinear
  Memory Cost"; Megatron's full recomputation.
- ``"selective"``: the outputs of the expensive ops (matrix multiplies and attention, the
  `SAVED_OPS`) are kept, the cheap ones (norms, activations, dropout, adds) recomputed: most
  of the memory saved for a fraction of the extra compute. Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models"; torchtitan's op-level
  selective AC.
- a callable ``policy(op) -> bool``: keep the outputs of the ATen ops it returns True for.

Which modules: typically each transformer block (``for b in model.blocks:
checkpoint_activations(b)``); every k-th block for less recompute. It is torch's
``torch.utils.checkpoint`` underneath (non-reentrant, with the CPU and CUDA random state
preserved, so dropout draws the same mask in the recompute as in the forward).

With the strategies: apply it to modules at or below the ones given to `fully_shard` (a
checkpointed block may be an FSDP unit, before or after `fully_shard`: FSDP re-gathers and
installs the unit's parameters before the recompute), under `ddp`, to modules `parallelize`
has sharded (the recompute re-issues their collectives, on every rank in the same order), and
inside pipeline stages ("full" only in a stage whose backward is split into B and W: torch's
selective checkpoint allows one backward, and the pipeline refuses it). Not to a module that
contains FSDP units (their hooks would run again
in the recompute): that is refused at the first forward. Under tensor parallelism with
`ShardedDropout` / `SequenceParallel` dropout, pass the model's ``tp_rng_tracker`` as
``rng_tracker`` so the per-rank stream is replayed too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from meshrun import _torch

aten = torch.ops.aten
# the ops whose outputs "selective" keeps: matrix multiplies and attention
SAVED_OPS = frozenset(op for op in (
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    *_torch.attention_ops(),
) if op is not None)


def checkpoint_activations(module: nn.Module, policy: str | Callable = "full", *,
                           rng_tracker=None) -> nn.Module:
    """Recompute ``module``'s activations in backward instead of keeping them; in place.

    Args:
        module: the module to checkpoint (its ``forward``, as it is now: apply after
            `parallelize` or before, either works).
        policy: ``"full"``, ``"selective"`` (keep the outputs of `SAVED_OPS`), or a callable
            ``policy(op: torch._ops.OpOverload) -> bool`` (True: keep that op's outputs).
        rng_tracker: a `meshrun.parallel.RNGTracker` whose stream the module draws from
            (tensor-parallel dropout): its state is replayed in the recompute.

    Returns:
        ``module``, whose forward now runs under ``torch.utils.checkpoint.checkpoint``.
        Outputs, gradients and parameters are those of the module without it (bit for bit:
        the same ops in the same order).

    Raises:
        ValueError: an unknown policy, or ``module`` is already checkpointed.
        RuntimeError (at the first forward): ``module`` contains modules given to
            `fully_shard` (checkpoint those, or modules inside them, instead).
    """
    if getattr(module, "_meshrun_ac_policy", None) is not None:
        raise ValueError(f"checkpoint_activations: {type(module).__name__} is already "
                         f"checkpointed (policy {module._meshrun_ac_policy!r})")
    _context_fn(policy)  # an unknown policy: refused now, not at the first forward
    module.forward = _CheckpointedForward(module, policy, rng_tracker)
    module._meshrun_ac_policy = policy
    return module


class _CheckpointedForward:
    """The forward `checkpoint_activations` installs on a module: its own forward under
    ``torch.utils.checkpoint.checkpoint``. An object that refers to the module (not a closure
    over it), so ``copy.deepcopy(model)`` gives the copy a forward of the copy, and
    ``torch.save(model)`` can pickle it (with a picklable policy)."""

    def __init__(self, module: nn.Module, policy, rng_tracker):
        self.module, self.policy, self.rng_tracker = module, policy, rng_tracker
        # the class's forward, called with the module (a copy calls it with the copy), or a
        # forward already set on the instance (another wrapper's), called as it is
        self.own = module.__dict__.get("forward")
        self.checked = False

    def __call__(self, *args, **kwargs):
        module = self.module
        inner = self.own or functools.partial(type(module).forward, module)
        if not self.checked:
            _refuse_fsdp_inside(module)
            self.checked = True
        if not torch.is_grad_enabled():  # eval: nothing is saved anyway
            return inner(*args, **kwargs)
        # "full": no context_fn at all, which torch.compile traces (it refuses any function
        # that is not torch's own default there)
        extra = {} if self.policy == "full" else {"context_fn": _context_fn(self.policy)}
        if self.rng_tracker is not None:
            inner = _ReplayTracker(self.rng_tracker, self.rng_tracker.get_state()).wrap(inner)
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True,
                          **extra, **kwargs)


class _ReplayTracker:
    """The forward and its recompute both start the tracker from the state it had before."""

    def __init__(self, tracker, state):
        self.tracker, self.state, self.calls = tracker, state, 0

    def wrap(self, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            self.calls += 1
            if self.calls > 1:  # the recompute: draw what the forward drew
                after = self.tracker.get_state()
                self.tracker.set_state(self.state)
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.tracker.set_state(after)
            return fn(*args, **kwargs)
        return run


def _context_fn(policy):
    if policy == "full":
        return noop_context_fn
    if policy == "selective":
        keep = SAVED_OPS.__contains__
    elif callable(policy):
        keep = policy
    else:
        raise ValueError(f"checkpoint_activations: policy must be 'full', 'selective' or a "
                         f"callable op -> bool (got {policy!r})")

    def decide(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if keep(op) else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, decide)


def _refuse_fsdp_inside(module: nn.Module) -> None:
    from meshrun.parallel.fsdp import FSDPModule

    inside = [name for name, m in module.named_modules()
              if name and isinstance(m, FSDPModule)]
    if inside:
        raise RuntimeError(f"checkpoint_activations: {type(module).__name__} contains modules "
                           f"given to fully_shard ({', '.join(inside[:3])}); their hooks would "
                           f"run again in the recompute: checkpoint those modules (or modules "
                           f"inside them) instead")
