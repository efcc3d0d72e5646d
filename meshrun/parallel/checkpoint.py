"""Distributed checkpoints that reshard on load: `save`, `load`, `model_state`, `optimizer_state`.

Each rank writes only the blocks of the global tensors that it holds, in parallel, one file
per rank; rank 0 writes the metadata (global shape and the offsets of every saved block).
`load` asks, for every block the *current* layout holds, for the overlapping parts of the
saved blocks. So a checkpoint saved at one world size and strategy loads at another: FSDP
shards over 4 ranks into 3, TP shards over 2 ranks into unsharded tensors, pipeline stages
owned by other ranks, in any combination. Values are keyed by the model's own parameter names
(``blocks.3.qkv.weight``), which no meshrun strategy renames.

This is torch.distributed.checkpoint (DCP) underneath: its file format, its planner (which
computes the overlaps) and its filesystem writer and reader. What meshrun adds is the
description of meshrun's layouts as DCP chunks (`meshrun.parallel.placement`: a fused TP shard
with vocabulary padding, cut again on dim 0 by FSDP, is several blocks, which DTensor
placements cannot describe), optimizer state keyed by parameter name with the same blocks as
its parameter, and atomic saves:

- `save` writes into ``<path>.partial`` and puts it in place in one step (a rename, or an
  exchange with the checkpoint it replaces) only after every rank's files, the metadata and
  the directory are on disk (fsync'd), so a save killed at any moment leaves the previous
  checkpoint, and nothing else under a checkpoint name (`meshrun.parallel.atomic_dir`). The
  next save sweeps what killed saves left. Two jobs saving into one directory: the second
  gets `SaveInProgress`, never an interleaving.
- ``save(..., async_=True)`` copies the blocks to host memory and writes in the background;
  the next save, `load` or `wait()` joins it.
- Saving reads only. Optimizer state missing at save time (a frozen parameter, one without
  a gradient yet) is simply not saved; `load` creates state for exactly the parameters the
  checkpoint has state for.
- `load` checks the files first: a damaged or truncated checkpoint is one error naming the
  file.
- `latest(directory)` finds the newest complete ``step_<N>`` checkpoint, for resuming.
- A save or load counts as progress for ``meshrun --hang-timeout`` (`meshrun.parallel.busy`),
  for at most ``busy_timeout`` seconds (`busy_bound`): by default the
  ``MESHRUN_CHECKPOINT_TIMEOUT`` variable, else torch's default process-group timeout, 30
  minutes (``torch.distributed.constants.default_pg_timeout``: as long as torch lets one of
  DCP's collectives wait before it raises, so a save torch itself would let run is never
  called hung). A save that hangs (a rank stuck in a write, or one that never reaches the
  save's collectives) is then reported as a hang within the bound plus ``--hang-timeout``.
  The bound does not stop the save; a save known to take long passes a larger one.

Typical use, on every rank (both calls are collectives over the default group)::

    state = {"model": checkpoint.model_state(model), "step": step,
             "optim": checkpoint.optimizer_state(optimizer, model)}
    checkpoint.save(state, f"ckpt/step_{step}")
    ...
    path = checkpoint.latest("ckpt")
    if path is not None:
        checkpoint.load(state, path)   # in place; state["step"] is updated

Mirrors ``torch.distributed.checkpoint.save`` / ``load`` with
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
``get_optimizer_state_dict`` (parameter-name-keyed optimizer state).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import math
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

from meshrun import _torch, worker_signals
from meshrun.parallel import atomic_dir, placement
from meshrun.parallel.atomic_dir import SaveInProgress
from meshrun.parallel.heartbeat import busy

__all__ = ["AsyncSave", "ModelState", "OptimizerState", "SaveInProgress",
           "create_optimizer_state", "latest", "load", "model_state", "optimizer_state", "save",
           "wait"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
#: The variable that sets `busy_bound`'s default: seconds, or "inf" for no bound.
BUSY_TIMEOUT_ENV = "MESHRUN_CHECKPOINT_TIMEOUT"
#: `busy_bound`'s default without the variable: torch's default process-group timeout (s).
DEFAULT_BUSY_TIMEOUT_S = dist.constants.default_pg_timeout.total_seconds()


def busy_bound(busy_timeout: float | None = None) -> float:
    """Seconds a checkpoint save or load counts as progress for ``--hang-timeout``.

    Args:
        busy_timeout: seconds (> 0; ``math.inf``: no bound), or None for the default:
            ``MESHRUN_CHECKPOINT_TIMEOUT`` (seconds, or "inf"), else `DEFAULT_BUSY_TIMEOUT_S`
            (torch's default process-group timeout, 1800 s).

    Raises:
        ValueError: a bound that is not a number > 0 (the argument or the variable).
    """
    where = "busy_timeout"
    if busy_timeout is None:
        text = os.environ.get(BUSY_TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_BUSY_TIMEOUT_S
        where = BUSY_TIMEOUT_ENV
        try:
            busy_timeout = float(text)
        except ValueError:
            busy_timeout = math.nan
    if not (isinstance(busy_timeout, (int, float)) and busy_timeout > 0):
        raise ValueError(f"checkpoint: {where} must be seconds > 0 (or inf: no bound), got "
                         f"{busy_timeout!r}")
    return float(busy_timeout)


def _progress_for(what: str):
    """Run the decorated call inside `busy` (``what``), bounded by its ``busy_timeout``."""
    def decorate(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with busy(what, timeout=busy_bound(kwargs.get("busy_timeout"))):
                return fn(*args, **kwargs)
        return call
    return decorate


@_progress_for("checkpoint save")
def save(state: dict, path: str | os.PathLike, *, async_: bool = False,
         busy_timeout: float | None = None) -> AsyncSave | None:
    """Write ``state`` to the directory ``path``, atomically; a collective over all ranks.

    Reads only: the model, the optimizer and the random state are left exactly as they were.

    Args:
        state: a dict of tensors, `ModelState` / `OptimizerState` (or any DCP ``Stateful``),
            nested dicts, and small picklable values (ints, floats, strings). Values and
            tensors that are not parameters are taken as replicated: one rank's copy is
            written (torch DCP's deduplication picks which), and every rank loads it; a
            per-rank value (each rank's own RNG state) needs a key per rank
            (``f"rng_{rank}"``).
        path: the checkpoint directory; it must not exist yet, or it is replaced in one step
            (`meshrun.parallel.atomic_dir`): a kill at any moment leaves either the previous
            checkpoint or the new one under ``path``, complete.
        async_: copy this rank's blocks to host memory, return, and write them on a background
            thread (over a process group of its own, so training's collectives go on). The
            next `save`, or `wait()`, joins it and raises its error.
        busy_timeout: seconds the call counts as progress for ``meshrun --hang-timeout``
            (`busy_bound`; None: ``MESHRUN_CHECKPOINT_TIMEOUT``, else 1800 s). With
            ``async_`` it bounds the foreground part only.

    Returns:
        None; with ``async_``, the `AsyncSave` handle (``handle.wait()``).

    Raises:
        FileExistsError: ``path`` is a symbolic link, a file, or a directory that is not a
            checkpoint (it would be replaced); or a foreign ``<path>.partial`` is in the way.
        RuntimeError: another rank failed to read its state (the message names it); every
            rank raises, none is left waiting.
        ValueError: optimizer state that cannot be resharded (see `optimizer_state`).
        SaveInProgress: another job (or an unjoined save) is writing into ``path``'s parent
            directory.
        ValueError: ``busy_timeout`` (or ``MESHRUN_CHECKPOINT_TIMEOUT``) is not seconds > 0.
        OSError: the filesystem refused a write (every rank raises; ``path`` is untouched).

    Cost: every rank writes its own blocks (bytes held / write bandwidth) in parallel, plus
    four small collectives (lock outcome, plans, metadata, rename outcome). Asynchronous: the
    training loop pays one host copy of the rank's blocks.
    """
    del busy_timeout  # the decorator's (`_progress_for`)
    wait()  # one save at a time: the previous background write finishes first
    path = os.path.abspath(os.fspath(path))
    group = _background_group() if async_ else None  # collective: before anything can fail
    lock, error = None, None
    if _rank() == 0:  # the lock, the sweep and the .partial directory are rank 0's
        try:
            atomic_dir.check_target(path)
            lock = atomic_dir.DirLock(os.path.dirname(path))
            atomic_dir.sweep(os.path.dirname(path))  # left by killed saves (not ours: locked)
            atomic_dir.begin(path)
        except Exception as e:
            error = e
            if lock is not None:
                lock.release()
                lock = None
    try:
        _agree(error, None)  # inside: a peer lost here must not leave the lock held
        # Each rank reads its state (and copies it, for a background write) before any of
        # DCP's collectives: a rank that fails here must not leave the others waiting.
        error = None
        try:
            resolved = _stage(state, copy_tensors=async_)
        except Exception as e:
            error = e
        _agree_all(error)
        if not async_:
            _write(resolved, path, None)
            return None
        global _pending
        _pending = AsyncSave(resolved, path, group, lock)
        lock = None  # the background thread releases it
        return _pending
    finally:
        if lock is not None:
            lock.release()


class AsyncSave:
    """A save writing in the background (see `save`); `wait` joins it."""

    def __init__(self, staged: dict, path: str, group, lock):
        self.path, self._lock, self._error = path, lock, None
        self._thread = threading.Thread(target=self._run, args=(staged, group),
                                        name="meshrun-checkpoint", daemon=True)
        worker_signals.start_thread(self._thread)  # every signal blocked: the script's

    def _run(self, staged: dict, group) -> None:
        try:
            _write(staged, self.path, group)
        except BaseException as e:  # handed to wait(), in the training thread
            self._error = e
        finally:
            if self._lock is not None:
                self._lock.release()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is in place (or ``timeout`` seconds have passed: check
        `done`); raise the error the write met, if any."""
        self._thread.join(timeout)
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def wait() -> None:
    """Join the save still writing in the background, if any (see `save`'s ``async_``)."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        pending.wait()


@atexit.register
def _finish_at_exit() -> None:
    """A script that ends (or raises) while a background save is writing: finish it, so the
    checkpoint it staged is not lost; bounded, since a peer that died cannot finish its part
    (the previous checkpoint then stays the newest)."""
    if _pending is not None:
        try:
            _pending.wait(timeout=EXIT_WAIT_S)
        except BaseException as e:
            print(f"checkpoint: the background save to {_pending.path} failed: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return
        if not _pending.done():
            print(f"checkpoint: the background save to {_pending.path} did not finish in "
                  f"{EXIT_WAIT_S:.0f} s at exit; the previous checkpoint stays the newest",
                  file=sys.stderr, flush=True)


EXIT_WAIT_S = 60.0
_pending: AsyncSave | None = None
_group = None  # the background saves' own process group, made at the first


@_progress_for("checkpoint load")
def load(state: dict, path: str | os.PathLike, *, busy_timeout: float | None = None) -> None:
    """Load the checkpoint at ``path`` into ``state``, in place; a collective over all ranks.

    Tensors (and the blocks of `ModelState` / `OptimizerState`) are filled in place with the
    parts of the saved tensors they cover, whatever layout saved them; other values in
    ``state`` are replaced by the saved ones.

    Args:
        state: as for `save`, built from the current model and optimizer. A top-level
            ``Stateful`` whose tensors may not exist yet (`comm_hooks.PowerSGDState`: error
            feedback and ``Q`` are made by the first compressed step) defines
            ``create_for_load(saved)``; it is called first with the checkpoint's keys under
            it (relative) and their sizes (None: not a tensor), to make them.
        path: a checkpoint directory (e.g. ``latest(directory)``, after checking it is not
            None).
        busy_timeout: seconds the call counts as progress for ``meshrun --hang-timeout``
            (`busy_bound`; None: ``MESHRUN_CHECKPOINT_TIMEOUT``, else 1800 s).

    Raises:
        FileNotFoundError: ``path`` is None, or holds no complete checkpoint.
        RuntimeError: ``state`` has a key the checkpoint lacks (the message names it).
        ValueError: a tensor's global shape differs from the saved one (another model).
        OSError: a file could not be read.
        ValueError: ``busy_timeout`` (or ``MESHRUN_CHECKPOINT_TIMEOUT``) is not seconds > 0.
    """
    del busy_timeout  # the decorator's (`_progress_for`)
    wait()  # a background save of this job finishes first
    if path is None:
        raise FileNotFoundError("checkpoint.load: no checkpoint path (latest() found none: "
                                "start from scratch, or check the directory)")
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"checkpoint.load: no complete checkpoint at {path} (its "
                                f".metadata file is missing)")
    reader = dcp.FileSystemReader(path)
    metadata = _read_checked(reader, path)
    with _dcp_errors("load", path):
        saved_keys = set(metadata.state_dict_metadata)
        for key, optim in _optimizer_states(state):
            optim.prepare_load({name for name in optim.names.values()
                                if any(k.startswith(f"{key}.state.{name}.") for k in saved_keys)})
        for key, value in state.items():  # e.g. a comm hook's state (PowerSGDState)
            if isinstance(value, Stateful) and hasattr(value, "create_for_load"):
                prefix = key + "."
                value.create_for_load({k[len(prefix):]: getattr(md, "size", None)
                                       for k, md in metadata.state_dict_metadata.items()
                                       if k.startswith(prefix)})
        dcp.load(state, storage_reader=reader, planner=_LoadPlanner(),
                 no_dist=not dist.is_initialized())


def latest(directory: str | os.PathLike | None) -> str | None:
    """The path of the newest complete ``step_<N>`` checkpoint under ``directory``, or None.

    Complete means renamed into place by `save` (``.partial`` directories are ignored)."""
    if directory is None or not os.path.isdir(directory):
        return None
    steps = []
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(directory, name, ".metadata")):
            steps.append((int(m.group(1)), name))
    return os.path.join(os.fspath(directory), max(steps)[1]) if steps else None


def model_state(module: nn.Module, *, params: Iterable[nn.Parameter] | None = None
                ) -> ModelState:
    """A ``Stateful`` view of ``module``'s parameters and persistent buffers for `save`/`load`.

    Args:
        module: the whole model as built (before any pipeline split), so that keys are the
            model's parameter names on every rank.
        params: the parameters this rank holds (under pipeline parallelism, those of its
            stages); default all of them.
    """
    return ModelState(module, params)


def optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, *,
                    params: Iterable[nn.Parameter] | None = None) -> OptimizerState:
    """A ``Stateful`` view of ``optimizer``'s state keyed by ``module``'s parameter names.

    Each state tensor shaped like its parameter (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's
    ``momentum_buffer``) is saved and loaded with its parameter's blocks, so it reshards too;
    other state (``step``) is taken as replicated. Saving reads the state as it is and changes
    nothing: a parameter without state (frozen, never given a gradient, or an optimizer that
    has not stepped) is saved without any. `load` makes the state match the checkpoint's:
    state is created (`create_optimizer_state`) for the parameters the checkpoint has state
    for, then overwritten with the saved values; parameters the checkpoint has no state for
    are left without any, so their next step is a fresh optimizer's first step.

    Raises:
        ValueError: the optimizer holds a parameter that is not in ``module``.
    """
    return OptimizerState(optimizer, module, params)


class ModelState(Stateful):
    """See `model_state`."""

    def __init__(self, module: nn.Module, params=None):
        self.module = module
        self.params = None if params is None else {id(p) for p in params}

    def state_dict(self) -> dict:
        out = {}
        for name, p in self.module.named_parameters():
            if self.params is None or id(p) in self.params:
                out[name] = ShardedBlocks.of(p.detach(), p)
        for name, b in self.module.named_buffers():
            if _persistent(self.module, name) and self._holds_owner(name):
                out[name] = b
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        pass  # `load` wrote into the parameters and buffers themselves

    def _holds_owner(self, buffer_name: str) -> bool:
        """Under a pipeline split, a buffer goes with its module's parameters."""
        if self.params is None:
            return True
        owner = _owner(self.module, buffer_name)
        return any(id(p) in self.params for p in owner.parameters(recurse=False))


class OptimizerState(Stateful):
    """See `optimizer_state`."""

    def __init__(self, optimizer, module, params=None):
        self.optimizer = optimizer
        keep = None if params is None else {id(p) for p in params}
        self.names = {id(p): n for n, p in module.named_parameters()
                      if keep is None or id(p) in keep}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self.names:
                    raise ValueError(f"checkpoint.optimizer_state: the optimizer holds a "
                                     f"parameter of shape {tuple(p.shape)} that is not among "
                                     f"the module's (pass the module the optimizer trains)")

    def state_dict(self) -> dict:
        """The optimizer's state as it is: parameters without state (frozen, or not stepped
        yet) have no entries. Reads only; nothing is created or changed."""
        state = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                entries = {}
                for key, value in self.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value) and value.dim() and value.shape == p.shape:
                        entries[key] = ShardedBlocks.of(value, p)
                    elif torch.is_tensor(value) and value.dim() and _is_split(p):
                        raise ValueError(
                            f"checkpoint.optimizer_state: {self.names[id(p)]}: state "
                            f"{key!r} of shape {tuple(value.shape)} is neither a scalar nor "
                            f"shaped like its parameter's shard {tuple(p.shape)} (a factored "
                            f"optimizer such as Adafactor); it cannot be resharded, and saving "
                            f"one rank's copy would be wrong: use an unfactored optimizer "
                            f"with sharded parameters")
                    else:
                        entries[key] = value
                state[self.names[id(p)]] = entries
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def prepare_load(self, saved: set[str]) -> None:
        """Make the optimizer's state the shape of the saved one, before DCP fills it.

        ``saved`` are the names of the parameters the checkpoint has state for. Those lacking
        state here get it created (`create_optimizer_state`), so there is something to load
        into; those that have state here but none in the checkpoint lose it, so the next step
        treats them as a fresh optimizer would, as the run that saved would have."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        create_optimizer_state(self.optimizer,
                               [p for p in params if self.names[id(p)] in saved])
        for p in params:
            if self.names[id(p)] not in saved:
                self.optimizer.state.pop(p, None)

    def load_state_dict(self, state_dict: dict) -> None:
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"],
                                strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                mine = self.optimizer.state.get(p)
                if mine is None:
                    continue
                for key, value in state_dict["state"].get(self.names[id(p)], {}).items():
                    if not isinstance(value, ShardedBlocks) and not torch.is_tensor(value):
                        mine[key] = value  # python scalars were replaced, tensors filled


@torch.no_grad()
def create_optimizer_state(optimizer: torch.optim.Optimizer,
                           params: Iterable[torch.Tensor] | None = None) -> None:
    """Create the per-parameter state a first step would, for ``params`` that lack it.

    Only those parameters are touched: a second optimizer of the same type, with each group's
    hyperparameters but learning rate 0, takes one step on them with zero gradients, and its
    state is handed to ``optimizer``. The parameters' values, their ``.grad``, every other
    parameter's state and the step counters of the others are left exactly as they were. The
    values created are placeholders for `load` to overwrite (Adam's moments are zero, its
    ``step`` is 1; SGD's momentum buffer is ``weight_decay * p``).

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose constructor takes ``(param_groups)``.
        params: parameters of ``optimizer``; default all of them.

    Raises:
        ValueError: a parameter in ``params`` is not in ``optimizer``.

    torch's ``_init_optim_state`` does this by stepping the whole optimizer, which changes
    the state of the parameters that already had some; this never does.
    """
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    if params is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
    todo: dict[int, list[torch.Tensor]] = {}  # id(group) -> its parameters that lack state
    for p in params:
        if id(p) not in group_of:
            raise ValueError(f"create_optimizer_state: a parameter of shape {tuple(p.shape)} "
                             f"is not in the optimizer")
        if not optimizer.state.get(p):
            todo.setdefault(id(group_of[id(p)]), []).append(p)
    if not todo:
        return
    groups = []
    for g in optimizer.param_groups:
        if id(g) in todo:
            hyper = {k: v for k, v in g.items() if k != "params"}
            hyper["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
            groups.append({**hyper, "params": todo[id(g)]})
    scratch = type(optimizer)(groups)
    grads = {id(p): p.grad for g in groups for p in g["params"]}
    values = {id(p): p.detach().clone() for g in groups for p in g["params"]}
    try:
        for g in groups:
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        scratch.step()
    finally:
        for g in groups:
            for p in g["params"]:
                p.grad = grads[id(p)]
                p.copy_(values[id(p)])  # lr 0 leaves them; a decoupled decay must not either
    for g in groups:
        for p in g["params"]:
            optimizer.state[p] = scratch.state[p]


class ShardedBlocks:
    """A rank's blocks of one global tensor, described to DCP (its ``_Checkpointable``
    protocol: ``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``).

    Args:
        local: the tensor this rank holds (a parameter, or optimizer state shaped like it).
        shape: the global shape.
        pieces: `meshrun.parallel.placement.Piece` s, blocks of ``local`` in the global tensor.
    """

    def __init__(self, local: torch.Tensor, shape: torch.Size, pieces: list[placement.Piece]):
        self.local, self.shape, self.pieces = local, torch.Size(shape), pieces

    @classmethod
    def of(cls, local: torch.Tensor, param: torch.Tensor) -> ShardedBlocks:
        """``local`` laid out as ``param`` is (``local`` may be ``param`` itself)."""
        return cls(local, placement.global_shape(param), placement.pieces(param))

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(p.offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=_chunk(p), properties=props,
                                                      size=self.shape))
                for p in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(p) for p in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for p in self.pieces:
            if tuple(p.offsets) == tuple(index.offset):
                return p.view(self.local)
        raise ValueError(f"checkpoint: no block at offset {tuple(index.offset)} of "
                         f"{index.fqn} on this rank")


# -- DCP planners that know ShardedBlocks (the planners' documented extension points) ---------


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ShardedBlocks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DefaultLoadPlanner's, less the step that would replace our ShardedBlocks by None
        # (we load into real tensors, never meta ones)
        _torch.set_up_load_planner(self, state_dict, metadata, is_coordinator)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ShardedBlocks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


# -- helpers ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _dcp_errors(what: str, path: str):
    """DCP gathers every rank's exception into a ``CheckpointException`` (a BaseException,
    which ``except Exception`` misses); raise the first rank's own error type instead, and
    keep DCP's single-process note ("torch.distributed is disabled ...") off the console."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointException as e:
        rank, (error, _) = min(e.failures.items())
        kind = type(error) if isinstance(error, (ValueError, RuntimeError, OSError)) \
            else RuntimeError
        raise kind(f"checkpoint.{what} {path}: rank {rank}: {error}") from e


def _chunk(p: placement.Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes))


def _write(state: dict, path: str, group) -> None:
    """dcp.save into ``<path>.partial`` (made by rank 0), then rank 0 renames it into place."""
    partial = path + atomic_dir.PARTIAL
    with _dcp_errors("save", path):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), planner=_SavePlanner(),
                 process_group=group, no_dist=not dist.is_initialized())
    error = _attempt(lambda: atomic_dir.commit(partial, path)) if _rank() == 0 else None
    _agree(error, group)


def _stage(state: dict, copy_tensors: bool) -> dict:
    """Everything ``state`` would write, Statefuls read through their ``state_dict``; with
    ``copy_tensors`` a host copy, for a background write that the training loop cannot
    disturb (else the tensors themselves)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, Stateful):
            value = value.state_dict()
        if isinstance(value, dict):
            out[key] = _stage(value, copy_tensors)
        elif isinstance(value, list):
            out[key] = [_stage({"v": v}, copy_tensors)["v"] for v in value]
        elif not copy_tensors:
            out[key] = value
        elif isinstance(value, ShardedBlocks):
            out[key] = ShardedBlocks(value.local.detach().to("cpu", copy=True), value.shape,
                                     value.pieces)
        elif torch.is_tensor(value):
            out[key] = value.detach().to("cpu", copy=True)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _background_group():
    """A gloo group of every rank for background saves (made once, collectively)."""
    global _group
    if _group is None and dist.is_initialized():
        _group = dist.new_group(backend="gloo")
    return _group


def _attempt(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:
        return e
    return None


def _agree(error: BaseException | None, group) -> None:
    """Every rank raises rank 0's ``error`` (or none does): a collective over ``group``."""
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, group=group, group_src=0)
        error = box[0]
    if error is not None:
        raise error


def _agree_all(error: BaseException | None) -> None:
    """Raise on every rank if any rank has an ``error`` (a collective over the world): the
    failing rank raises its own, the others a RuntimeError naming it."""
    if dist.is_initialized():
        notes = [None] * dist.get_world_size()
        dist.all_gather_object(notes, None if error is None
                               else f"{type(error).__name__}: {error}")
        if error is None and any(notes):
            rank, note = next((r, n) for r, n in enumerate(notes) if n)
            raise RuntimeError(f"checkpoint.save: rank {rank} failed before writing: {note}")
    if error is not None:
        raise error


def _read_checked(reader, path: str):
    """The checkpoint's metadata, after checking that every file it names is whole.

    Raises:
        ValueError: ``.metadata`` cannot be read, or a data file is shorter than the blocks
            it should hold (truncated); the message names the file.
        FileNotFoundError: a data file the metadata names is missing.
    """
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise ValueError(f"checkpoint.load: {os.path.join(path, '.metadata')} is damaged "
                         f"({type(e).__name__}: {e}); load an earlier checkpoint") from e
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                       info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise FileNotFoundError(f"checkpoint.load: {file} is missing (the checkpoint is "
                                    f"incomplete); load an earlier checkpoint")
        size = os.path.getsize(file)
        if size < end:
            raise ValueError(f"checkpoint.load: {file} is damaged (truncated: {size} bytes, "
                             f"the checkpoint needs {end}); load an earlier checkpoint")
    return metadata


def _is_split(param: torch.Tensor) -> bool:
    """Whether ``param`` holds less than its whole global tensor on this rank."""
    return tuple(placement.global_shape(param)) != tuple(param.shape)


def _optimizer_states(state: dict, prefix: str = ""):
    """(flattened key, `OptimizerState`) of every optimizer view in ``state``, nested too."""
    for key, value in state.items():
        if isinstance(value, OptimizerState):
            yield prefix + key, value
        elif isinstance(value, dict):
            yield from _optimizer_states(value, f"{prefix}{key}.")


def _owner(module: nn.Module, name: str) -> nn.Module:
    owner = name.rpartition(".")[0]
    return module.get_submodule(owner) if owner else module


def _persistent(module: nn.Module, name: str) -> bool:
    return name.rpartition(".")[2] not in _torch.non_persistent_buffers(_owner(module, name))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
