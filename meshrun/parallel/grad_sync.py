"""`gradient_sync(module, enabled)`: one switch for gradient accumulation under any data
parallelism.

Gradient accumulation runs several forward/backward passes per optimizer step; only the last
backward needs to synchronise gradients across data-parallel ranks. Each strategy spells that
switch differently: FSDP's ``set_requires_gradient_sync(bool)`` (meshrun `fully_shard` and
torch's FSDP2), DDP's ``no_sync()`` context (meshrun `ddp` and torch's
``DistributedDataParallel``). The pipeline runtime (one backward per microbatch) and training
loops with accumulation use this one function instead.
"""

from __future__ import annotations

import contextlib

from torch import nn


def gradient_sync(module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """A context in which backward synchronises gradients only if ``enabled``.

    Args:
        module: a module under `fully_shard` (FSDP-style), `ddp` or torch's DDP (DDP-style), or
            a plain module (nothing to switch).
        enabled: True for the backward that ends an accumulation (the last microbatch).

    Returns:
        A context manager to run that backward in. FSDP-style modules are switched at once
        (the setting persists, as torch's does, until the next call); DDP-style ones only
        inside the context, through ``no_sync()``.
    """
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP-style
        module.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if not enabled and hasattr(module, "no_sync"):  # meshrun ddp and torch DDP
        return module.no_sync()
    return contextlib.nullcontext()
