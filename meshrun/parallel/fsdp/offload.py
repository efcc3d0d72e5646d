"""CPU offload for `fully_shard`: `OffloadPolicy`, `CPUOffloadPolicy` (torch FSDP2's names).

With ``fully_shard(module, offload_policy=CPUOffloadPolicy())`` the unit's sharded parameters,
their gradients and therefore the optimizer state live in host memory, and the optimizer
steps there, on the host copy (torch's CPU Adam for a model whose shards do not fit in device
memory, as FSDP2 and ZeRO-Offload, Ren et al., USENIX ATC 2021). Per unit and pass:

    before each all-gather:     shard (host) -> device copy (`to_device`), then all-gather it
    after each reduce-scatter:  the gradient rows (device) -> host (`to_host`), then added
                                into ``shard.grad`` on the host

So device memory holds only the unsharded parameters of the units in use and their gradients
in flight, and one shard-sized staging copy per gather. With ``pin_memory`` (and an
accelerator) the host buffers are page-locked and the host-to-device copy is asynchronous
(``non_blocking``), queued before the all-gather on the same stream, so it overlaps the
previous unit's compute; the device-to-host copy after the reduce-scatter is synchronous,
since the optimizer reads the gradient on the host right after backward.

On a CPU-only machine (device = host) the copies still happen, into distinct buffers: the
tests count them and check that the optimizer's state stays with the host shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "OffloadPolicy", "to_device", "to_host"]


@dataclass(frozen=True)
class OffloadPolicy:
    """No offload: the shards live on the module's device (torch's ``OffloadPolicy``)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state in host memory (torch FSDP2's
    ``CPUOffloadPolicy``).

    Attributes:
        pin_memory: page-lock the host shard and gradient buffers, so host-device copies are
            asynchronous (DMA) and overlap compute. Costs pinned host memory (not swappable);
            ignored when no accelerator is available.
    """

    pin_memory: bool = True


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed 1-D host buffer, page-locked when ``pin`` and an accelerator is present."""
    pin = pin and torch.cuda.is_available()
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)


def to_device(host: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A new ``device`` copy of ``host`` in ``dtype`` (the all-gather's input); asynchronous
    from pinned memory."""
    out = torch.empty(host.shape, dtype=dtype, device=device)
    out.copy_(host, non_blocking=host.is_pinned())
    return out


def to_host(grad: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A new host copy of ``grad`` in ``dtype`` (the reduce-scatter's output rows), complete
    on return."""
    out = host_empty(grad.numel(), dtype, pin).view(grad.shape)
    out.copy_(grad)
    return out
