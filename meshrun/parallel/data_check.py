"""Catch data that was never sharded: every data-parallel rank training on the same batches.

Nothing fails when a script forgets its ``DistributedSampler`` (or builds one without the
rank), or never calls ``set_epoch``: every rank trains on the same data, or every epoch repeats
the same order, the effective batch is smaller than the user thinks, and compute is wasted.
Two cheap checks say so, once each, as one warning line:

- `InputCheck`, the same-data check: at each of a model's first `COMPARED_FORWARDS` (8)
  forwards with grad enabled, the ranks of its data-parallel group compare a fingerprint of
  the forward's tensor arguments, positional and keyword (``model(x)`` and
  ``model(input_ids=x)`` alike; one small all-gather per compared forward). Only when the
  inputs are identical on every rank at *every one* of those forwards does rank 0 of the
  group warn, naming ``DistributedSampler``. The first forward whose inputs differ on some
  rank ends the check silently (a constant warm-up batch followed by sharded data warns
  nothing). Only the data-parallel group is compared: tensor- and context-parallel peers share
  their inputs by design.
- The sampler watch (`watch_samplers`, armed by ``meshrun.parallel.init()`` and by every
  wrapper the check covers) wraps ``DistributedSampler.__iter__`` and changes nothing it
  yields. A sampler with ``shuffle=True`` iterated a second time at the same epoch
  (``set_epoch`` never called: the same order every epoch) gets a warning naming
  ``set_epoch``. And it knows the sampler's padding: without ``drop_last`` a sampler pads its
  indices to a multiple of the world by repeating them, so over a dataset of one sample every
  rank gets that sample (a dataset smaller than the world gives rank ``r`` the index
  ``r mod len``: the ranks' lists are identical only for one sample). Once such a sampler was
  iterated in this process, identical batches are correct and the same-data check says
  nothing.

What the same-data check covers:

- meshrun.parallel's ``ddp`` and ``fully_shard`` (the data-parallel group, the HSDP shard
  group for a 2-D mesh), always;
- torch's own ``torch.nn.parallel.DistributedDataParallel`` (its ``process_group``) and
  ``torch.distributed.fsdp.fully_shard`` (the root module's 1-D mesh) once the script called
  ``meshrun.parallel.init()`` (`watch_torch_wrappers`), however the script imported them:
  ``DistributedDataParallel.__init__`` is wrapped to add a forward pre-hook with kwargs to
  each new instance (removed once the check is decided), and ``FSDPModule.__call__`` is given
  a pass-through that runs the check on the first call of each root (a module under no other
  fully_shard'ed one). Neither returns anything to torch, so the model computes what it
  computes without the check.

Not covered: torch's wrappers in a script that never calls ``meshrun.parallel.init()`` (it
only ran ``init_process_group``); torch's ``fully_shard`` on a 2-D or larger mesh (HSDP,
FSDP x TP: no one public process group holds exactly the data-parallel ranks); forwards
inside a ``torch.compile`` trace (a collective there would break the graph: the check runs
only in eager forwards); non-tensor inputs (strings, lists of ints); a script whose first 8
forwards are a constant warm-up (it warns); and a padded one-sample sampler anywhere in the
process silences the check for every model of it.

Cost, per model: the first forward with grad enabled, and each further one while every rank's
inputs were identical, up to `COMPARED_FORWARDS`: a fingerprint (blake2b over the first
`FINGERPRINT_BYTES`, 1 MiB, of each tensor argument; a CUDA tensor copies that head to the
host, which synchronises) and one all-gather of two int64 per rank over the group. A script
whose ranks get different data pays one all-gather, at its first forward; one that feeds the
same data pays 8. After that, nothing (torch's DDP: the hook is removed; torch's FSDP: one
dictionary lookup per fully_shard'ed module call). The compared forwards are collectives:
every rank of the group must run them (as DDP's and FSDP's forwards require anyway; under
torch's ``Join`` a rank that runs out of batches within the first 8 forwards would leave the
others waiting in the check).

``MESHRUN_DATA_CHECK=0`` switches both checks off. The idea of the first is DeepSpeed's and
torchtitan's "same data on every rank" sanity checks, made one all-gather per forward.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import weakref

import torch
import torch.distributed as dist

from meshrun.parallel._comm import ALL_GATHER, group_device

#: Bytes of each tensor argument that go into the fingerprint (the head of its storage).
FINGERPRINT_BYTES = 1 << 20
#: How many forwards with grad enabled must see identical inputs on every rank before the
#: same-data warning (a constant warm-up shorter than this warns nothing).
COMPARED_FORWARDS = 8
SAME_INPUT_WARNING = "got the same batch at each of the first"

_warned: set[str] = set()
_padded_samplers: list[int] = []  # num_replicas of each sampler seen padding to one sample


def enabled() -> bool:
    """False when ``MESHRUN_DATA_CHECK=0`` (or "false", "no", "off")."""
    return os.environ.get("MESHRUN_DATA_CHECK", "1").strip().lower() not in ("0", "false", "no", "off")


def arm() -> None:
    """Arm every check that needs arming (``meshrun.parallel.init()`` calls it): the sampler
    watch and the same-data check on torch's own wrappers. Idempotent; a no-op when off."""
    watch_samplers()
    watch_torch_wrappers()


class InputCheck:
    """The same-data check of one model (see the module docstring).

    Call it with each forward's ``(args, kwargs)``, on every rank of ``group`` at the same
    forward (a collective while undecided). Forwards without grad, or inside a
    ``torch.compile`` trace, are not compared. ``on_done`` runs once the check is decided
    (torch's DDP removes its hook there).

    Args:
        group: the data-parallel process group (None: the default group).
        on_done: called with no arguments once no further forward will be compared.
    """

    def __init__(self, group=None, on_done=None):
        self.group = group
        self.on_done = on_done
        self.compared = 0
        self.done = False

    def __call__(self, args=(), kwargs=None) -> None:
        if self.done or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        if not enabled() or not dist.is_initialized() or dist.get_world_size(self.group) < 2:
            self._finish()
            return
        device = group_device(self.group)
        digest = fingerprint((args, kwargs or {}))
        mine = torch.tensor([digest, 1 if digest else 0], dtype=torch.int64, device=device)
        every = torch.empty(dist.get_world_size(self.group) * 2, dtype=torch.int64, device=device)
        getattr(dist, ALL_GATHER)(every, mine, group=self.group)  # torch 2.13's name or the old
        pairs = every.view(-1, 2).tolist()
        if not all(has for _, has in pairs) or len({d for d, _ in pairs}) != 1:
            self._finish()  # the ranks' inputs differ (or some have no tensor): all is well
            return
        self.compared += 1
        if self.compared < COMPARED_FORWARDS:
            return
        self._finish()
        if _padded_samplers or dist.get_rank(self.group) != 0:
            return  # a DistributedSampler over one sample: identical batches are correct
        _warn_once(
            "same-input",
            f"every rank of the data-parallel group ({len(pairs)} ranks) "
            f"{SAME_INPUT_WARNING} {COMPARED_FORWARDS} forwards, so each trains on the same "
            "data: shard it by the data-parallel rank (torch.utils.data.DistributedSampler("
            "dataset, num_replicas=dp_size, rank=dp_rank), or meshrun.parallel's mesh ranks); "
            "MESHRUN_DATA_CHECK=0 switches this check off",
        )

    def _finish(self) -> None:
        self.done = True
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            on_done()


def fingerprint(args) -> int:
    """A 63-bit hash of the tensors in ``args`` (nested lists, tuples and dicts, dict keys
    included, in sorted order): shapes, dtypes and the first `FINGERPRINT_BYTES` of each;
    0 when there is no tensor of two or more elements."""
    h = hashlib.blake2b(digest_size=8)
    found = False
    for where, t in _tensors(args, ()):
        if t.numel() < 2:
            continue
        found = True
        h.update(repr((where, tuple(t.shape), str(t.dtype))).encode())
        flat = t.detach().reshape(-1)
        n = max(1, FINGERPRINT_BYTES // max(1, flat.element_size()))
        head = flat[:n].contiguous().cpu()
        h.update(head.view(torch.uint8).numpy().tobytes() if head.dtype != torch.bool
                 else head.numpy().tobytes())  # fmt: skip
    if not found:
        return 0
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1) or 1


def pads_to_one_sample(sampler) -> bool:
    """True when ``sampler`` (a ``DistributedSampler``) gives every rank the same indices by
    its padding: no ``drop_last``, more than one replica, a dataset of one sample. (Without
    ``drop_last`` torch pads the index list to a multiple of ``num_replicas`` by repeating it
    and rank ``r`` takes ``indices[r::num_replicas]``; for a dataset smaller than the world
    rank ``r`` gets index ``r mod len``, so the lists agree on every rank only for one
    sample. With ``drop_last`` such a dataset gives every rank nothing.)"""
    try:
        n = len(sampler.dataset)
    except TypeError:
        return False
    return n == 1 and getattr(sampler, "num_replicas", 1) > 1 and not getattr(sampler, "drop_last", False)


def watch_samplers() -> None:
    """Wrap ``DistributedSampler.__iter__``: a shuffling sampler iterated twice at the same
    epoch warns once (``set_epoch`` was not called), and a sampler that pads one sample to
    every rank (`pads_to_one_sample`) is noted, so the same-data check stays silent. What the
    sampler yields is unchanged. Idempotent; a no-op when the check is off."""
    if not enabled():
        return
    from torch.utils.data.distributed import DistributedSampler

    if getattr(DistributedSampler.__iter__, "_meshrun_watch", False):
        return
    original = DistributedSampler.__iter__

    @functools.wraps(original)
    def __iter__(self):
        if getattr(self, "shuffle", False):
            seen = self.__dict__.setdefault("_meshrun_epochs_iterated", set())
            if self.epoch in seen and getattr(self, "rank", 0) == 0:  # one line per job
                _warn_once(
                    "set-epoch",
                    f"a DistributedSampler with shuffle=True was iterated again at epoch "
                    f"{self.epoch}: every epoch repeats the same order; call "
                    "sampler.set_epoch(epoch) before each epoch",
                )
            seen.add(self.epoch)
        if not _padded_samplers and pads_to_one_sample(self):
            _padded_samplers.append(self.num_replicas)
        return original(self)

    __iter__._meshrun_watch = True  # type: ignore[attr-defined]
    DistributedSampler.__iter__ = __iter__


def watch_torch_wrappers() -> None:
    """Put the same-data check on torch's own ``DistributedDataParallel`` and ``fully_shard``
    (see the module docstring for how, and what is not covered). Idempotent; a no-op when the
    check is off."""
    if not enabled():
        return
    from torch.nn.parallel import DistributedDataParallel

    if not getattr(DistributedDataParallel.__init__, "_meshrun_watch", False):
        original_init = DistributedDataParallel.__init__

        @functools.wraps(original_init)
        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            _check_torch_ddp(self)

        __init__._meshrun_watch = True  # type: ignore[attr-defined]
        DistributedDataParallel.__init__ = __init__
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    if getattr(FSDPModule.__dict__.get("__call__"), "_meshrun_watch", False):
        return
    own = FSDPModule.__dict__.get("__call__")

    def __call__(self, *args, **kwargs):
        if not torch.compiler.is_compiling():  # traced: nothing of ours goes into the graph
            if self not in _fsdp_checks and self not in _fsdp_inner:
                _fsdp_checks[self] = _torch_fsdp_check(self)
            check = _fsdp_checks.get(self)
            if check is not None and not check.done:
                check(args, kwargs)
        if own is not None:
            return own(self, *args, **kwargs)
        return super(FSDPModule, self).__call__(*args, **kwargs)

    __call__._meshrun_watch = True  # type: ignore[attr-defined]
    FSDPModule.__call__ = __call__


_fsdp_checks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> check | None
_fsdp_inner: weakref.WeakSet = weakref.WeakSet()  # modules under a root seen: never a root


def _check_torch_ddp(model) -> None:
    """Add the same-data check to a new torch ``DistributedDataParallel`` ``model``."""
    handles = []
    check = InputCheck(getattr(model, "process_group", None),
                       on_done=lambda: [h.remove() for h in handles])
    handles.append(model.register_forward_pre_hook(
        lambda module, args, kwargs: check(args, kwargs), with_kwargs=True))


def _torch_fsdp_check(root) -> InputCheck | None:
    """The check of a torch ``fully_shard`` root at its first call: over its parameters'
    mesh when that is 1-D; None (not checked) otherwise."""
    for m in root.modules():
        if m is not root:
            _fsdp_inner.add(m)
    from torch.distributed.tensor import DTensor

    for p in root.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            return InputCheck(mesh.get_group()) if mesh.ndim == 1 else None
    return None


def _tensors(value, where):
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, (*where, i))
    elif isinstance(value, dict):
        for k in sorted(value, key=repr):
            yield from _tensors(value[k], (*where, repr(k)))


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    print(f"meshrun.parallel: warning: {message}", file=sys.stderr, flush=True)
