"""Neighbour copies: a fully sharded model that survives the loss of a node without a checkpoint.

Under `fully_shard` each rank holds the only copy of its rows of every parameter and of their
optimizer state, so a node lost takes those rows with it. `Copies` keeps, on each rank, what
`meshrun.parallel.elastic` needs to rebuild the whole model in memory after one node's loss:

- **its own snapshot**: its packed rows (parameters, then each optimizer state tensor of the
  parameter's shape: Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's momentum) and what every
  rank holds whole (the other values of the loop's ``state``, buffers, unsharded parameters,
  the optimizers' scalars and hyper-parameters, the RNG state), taken at a step's end;
- **its neighbour's packed rows**, from the same step: rank r sends its rows to its *keeper*,
  the rank with r's local rank (modulo that node's size) on the next node, so the keeper is
  on another node whenever the world spans several.

`refresh` takes both every ``every`` steps (one point-to-point exchange: each rank sends
1/N of the model and its optimizer state and receives as much per rank it keeps). After a
change of world, `restore` finds, for every old rank, a survivor that holds its rows at one
common step (its owner, or its keeper when the owner's node was lost), broadcasts them to the
new world, whose ranks (joiners included) then hold the full model and optimizer state at
that step, as if no strategy had been applied; the script's ``build()`` shards it again over
the new world and `after_build` cuts the optimizer state to the new rows. Steps done since
that step are trained again (``every`` 1: none). A generation is dropped only once a newer
one is confirmed on every rank (`confirm`), so a node lost during an exchange leaves the
previous one held by all. When the copies do not cover every old rank (two nodes lost
together, a node lost during a new world's first exchange, copies off), `restore`
says so and the caller falls back to the last checkpoint.

HSDP (shards within a node, replicas across nodes) exchanges nothing: a refresh keeps each
rank's own snapshot only, and a lost node's shards come from a replica on another node; the
rows are then indexed by shard (S shards of R replicas) instead of by rank.

Packing is per parameter and independent of how the parameters were grouped into units:
parameter ``(d0, *rest)`` over S shards takes ``ceil(d0 / S)`` rows (torch.chunk's,
padded), so a joiner, whose model is not sharded yet, can unpack what it receives. Limits:
FSDP or HSDP over the whole world (not beside TP or PP, for now); nodes of equal size for
the keeper to be on another node in every case; the full model and optimizer state are held
on every rank for the moment of the restore.

The idea of keeping a peer's state in memory for fast recovery is Gemini's (Wang et al.,
"GEMINI: Fast Failure Recovery in Distributed Training with In-Memory Checkpoints", SOSP 2023)
and of DeepSpeed-style "checkpoint to a neighbour's memory"; here the copy is refreshed by
the training loop itself and used by the in-place recovery of `meshrun.parallel.elastic`.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import MutableMapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshrun import _torch
from meshrun.parallel import placement
from meshrun.parallel._comm import group_device

__all__ = ["Copies", "NotCovered"]


class NotCovered(RuntimeError):
    """The survivors do not hold every old shard's rows at one common step."""


@dataclass
class _Layout:
    """Where each sharded parameter's rows (and its optimizer state's) sit in a packed shard.

    ``names[i]`` has unsharded shape ``shapes[i]``, optimizer state keys ``keys[i]`` (tensors
    of the parameter's local shape) and ``rows(i) = ceil(shapes[i][0] / shards)`` rows per
    shard; ``dtypes[i]`` names the dtype of the parameter, then of each key's tensor. A packed
    shard is bytes: parameter after parameter, ``1 + len(keys[i])`` blocks of ``rows(i) *
    prod(shapes[i][1:])`` elements of their dtype, the shard's own rows first in each
    block (the rest is padding, never read)."""

    shards: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    keys: list[list[str]]
    dtypes: list[list[str]]

    def __post_init__(self):
        # bytes of each block, once: packing runs at every step's end
        self._blocks = [[self.rows(i) * math.prod(self.shapes[i][1:]) * self.dtype(i, j).itemsize
                         for j in range(1 + len(self.keys[i]))] for i in range(len(self.names))]
        self._nbytes = sum(map(sum, self._blocks))

    def rows(self, i: int) -> int:
        return math.ceil(self.shapes[i][0] / self.shards)

    def rows_of(self, i: int, shard: int) -> int:
        return max(0, min(self.rows(i), self.shapes[i][0] - shard * self.rows(i)))

    def dtype(self, i: int, j: int) -> torch.dtype:
        return getattr(torch, self.dtypes[i][j])

    def block(self, i: int, j: int) -> int:
        """Bytes of tensor j (0: the parameter, then its keys) of parameter i in a shard."""
        return self._blocks[i][j]

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def as_dict(self) -> dict:
        return {"shards": self.shards, "names": self.names, "shapes": self.shapes,
                "keys": self.keys, "dtypes": self.dtypes}

    def empty(self, device, spares: list[torch.Tensor] | None = None) -> torch.Tensor:
        """A packed buffer: one taken from ``spares`` when one fits (the padding is never
        read), else a new one."""
        device = torch.device(device)
        for k, spare in enumerate(spares or ()):
            if spare.numel() == self.nbytes and spare.device == device:
                return spares.pop(k)
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)


@dataclass
class _Snapshot:
    packed: torch.Tensor  # one shard's rows, bytes (`_Layout`)
    layout: _Layout
    whole: dict | None = None  # what every rank holds whole: own snapshots only


class Copies:
    """This rank's snapshots for in-place recovery of fully sharded state (module docstring).

    Args:
        every: refresh every this many steps (1: at every step's end, nothing is trained
            twice after a loss; 0: never: a lost node's rows are then only on disk).

    Raises:
        ValueError: ``every`` is not an int >= 0.
    """

    def __init__(self, every: int = 1):
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"neighbour copies: every must be an int >= 0 (got {every!r})")
        self.every = every
        # (round, world size, shards: the shard group's size) of the world the snapshots
        # were taken in; they are kept until the next world's first complete refresh, so a
        # loss during a change of world still finds them
        self.world: tuple[int, int, int] | None = None
        self.held: dict[tuple[int, int], _Snapshot] = {}  # (shard, step) -> its rows
        self.sharded: tuple[tuple, _Layout] | None = None  # (world, layout) sharded now
        # what the layout was computed from (`_current`), and each packed buffer's typed
        # views, one per tensor packed into it (one fused copy per step, no slicing)
        self._layout_of: tuple | None = None
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._restored: list[tuple[torch.Tensor, torch.optim.Optimizer, str]] = []
        self._neighbours: tuple[tuple, list[int], list[int]] | None = None
        self._pending: tuple | None = None  # the exchange in flight (see `settle`)
        # packed buffers of dropped snapshots, for the next ones: no allocation (and no page
        # faults on first touch) at a step's end
        self._spares: list[torch.Tensor] = []
        self._unconfirmed = False  # a generation was kept since the last `confirm`

    # -- while training ---------------------------------------------------------------------

    def refresh(self, state: MutableMapping, round: int) -> bool:
        """Snapshot this rank at ``state["step"]`` steps done (every ``every`` steps, and at
        the first call in a new world, whatever the step) and start the exchange with the
        keeper (a collective: every rank calls it at the same step; `settle` waits for it,
        or the next call: the transfer may overlap a step). The loop calls all three
        (`exchange`) at each step's end and before a new world's first step. The new
        generation is kept once the exchange completed on this rank, beside the previous
        one until `confirm`, so a node lost during it leaves every rank a generation held
        by all (the previous one, or this one where every exchange completed). Returns
        whether it ran (a refresh step, the model fully sharded, the world more than one
        node).

        Raises:
            RuntimeError: the model is sharded some other way than FSDP or HSDP over the
                whole world, an optimizer keeps per-parameter state of another shape
                (Adafactor's factored moments), or a parameter is in two optimizers; a
                collective's error when a peer vanished.
        """
        self.settle()  # one still in flight (a caller that did not settle it)
        step = int(state["step"])
        params = _sharded(state)
        if not params:
            return False
        world, shard, replicas = _world(state, round, params)
        if not self.every:  # copies off: the names and shapes, for a checkpoint's load
            if self.sharded is None or self.sharded[0] != world:
                self.sharded = (world, _layout(state, params, world[2], with_state=False))
                self._layout_of = None  # not a layout to pack with
            return False
        self._current(state, params, world)
        if step % self.every and self.world == world:
            return False  # (a new world's first call refreshes: its copies start now)
        if self.world == world and (shard, step) in self.held:
            return False  # a retried step: the copies of its start are in place
        if replicas > 1:  # HSDP: the other replicas hold the same rows; nothing to send
            self._commit(world, {(shard, step): self._take(state, params)})
            return True
        if self._neighbours is None or self._neighbours[0] != world:
            self._neighbours = (world, *_neighbours())
        _, keepers, sources = self._neighbours
        if not keepers:  # one node: its loss is everyone's, no copy can help
            return False
        mine = self._take(state, params, whole=False)
        inbox = {src: mine.layout.empty(mine.packed.device, self._spares) for src in sources}
        ops = [dist.P2POp(dist.isend, mine.packed, keeper) for keeper in keepers]
        ops += [dist.P2POp(dist.irecv, buf, src) for src, buf in inbox.items()]
        works = dist.batch_isend_irecv(ops)
        mine.whole = _whole(state, params)  # while the rows travel
        new = {(shard, step): mine}
        new.update({(src, step): _Snapshot(buf, mine.layout) for src, buf in inbox.items()})
        self._pending = (world, new, works)
        return True

    def settle(self) -> None:
        """Wait for the exchange in flight (`refresh` only starts it) and keep its snapshots.
        One that fails (a peer vanished) leaves the previous generation in place and raises
        its error."""
        if self._pending is None:
            return
        world, new, works = self._pending
        self._pending = None
        for work in works:  # (gloo's is_completed() stays False until a wait)
            work.wait()
        self._commit(world, new)

    def exchange(self, state: MutableMapping, round: int) -> bool:
        """`refresh`, `settle` and `confirm`: when it returns, every rank holds the copies of
        ``state`` now (a refresh step). What `meshrun.parallel.elastic` calls at each step's
        end and before a new world's first step. Returns whether a refresh ran.

        Raises:
            RuntimeError: as `refresh`; a collective's error when a peer vanished.
        """
        ran = self.refresh(state, round)
        self.settle()
        self.confirm()
        return ran

    def confirm(self) -> None:
        """After `settle` kept a generation: one all-reduce of the world proves that every
        rank kept it too (each enters only once its own exchange completed), so the older
        generations go. A rank whose confirmation fails (a peer vanished) keeps them: the
        peer that failed its exchange holds only those, and `restore` takes the newest step
        held by all. A collective whenever a generation was kept since the last call (every
        rank the same: refreshes happen at the same steps everywhere)."""
        if not self._unconfirmed:
            return
        dist.all_reduce(torch.zeros(1, device=group_device(None)))
        self._unconfirmed = False
        newest = max(step for _, step in self.held)
        self._drop([key for key in self.held if key[1] != newest])

    def keep_own(self, state: MutableMapping, round: int) -> None:
        """Snapshot this rank's rows and whole state at ``state["step"]`` (local: no
        communication), beside the snapshots it holds: `meshrun.parallel.elastic` calls it
        before it leaves a world at a step boundary (nodes join: every owner is alive and
        its current rows are what the new world needs; a node lost during the join finds
        the previous generation still there)."""
        params = _sharded(state)
        if not params:
            return
        world, shard, _ = _world(state, round, params)
        self._current(state, params, world)
        self._commit(world, {(shard, int(state["step"])): self._take(state, params)})

    def _current(self, state: MutableMapping, params, world: tuple[int, int, int]) -> _Layout:
        """The packed layout of ``params`` now, in ``self.sharded``: computed again only when
        what it is made of changed: the world, the parameters (names, dtypes), and each
        parameter's optimizer state tensors (keys, dtypes, shapes: an optimizer creates its
        state at its first step, some add keys later, a replaced or reloaded optimizer may
        change them all)."""
        made_of = (world, tuple((n, id(p), p.dtype) for n, p in params),
                   tuple((id(p), tuple((k, v.dtype, v.shape) for k, v in entry.items()
                                       if isinstance(v, torch.Tensor) and v.dim() > 0))
                         for o in _optimizers(state) for p, entry in o.state.items()))
        if self.sharded is None or self._layout_of != made_of:
            self.sharded = (world, _layout(state, params, world[2]))
            self._layout_of = made_of
            self._views = {}
        return self.sharded[1]

    def _take(self, state: MutableMapping, params, whole: bool = True) -> _Snapshot:
        """This rank's snapshot now (layout: `_current`'s): its packed rows, in a buffer from
        the spares when one fits, and, with ``whole``, what it holds whole."""
        layout = self.sharded[1]
        # each parameter's optimizer state (one optimizer per parameter: `_layout` checks it)
        entries = {id(p): entry for o in _optimizers(state) for p, entry in o.state.items()}
        tensors = [t for i, (_, p) in enumerate(params)
                   for t in [p, *(entries[id(p)][k] for k in layout.keys[i])]]
        packed = layout.empty(params[0][1].device, self._spares)
        cached = self._views.get(id(packed))
        if cached is None or cached[0] is not packed:
            cached = self._views[id(packed)] = (packed, _views(layout, packed, tensors))
        _pack(cached[1], tensors)
        return _Snapshot(packed, layout,
                         _whole(state, params) if whole else None)

    def _drop(self, keys) -> None:
        """Forget the snapshots at ``keys``; their buffers become the next ones' (and only
        buffers still in use keep their views)."""
        self._spares = [self.held.pop(key).packed for key in keys]
        live = {id(b) for b in self._spares} | {id(s.packed) for s in self.held.values()}
        self._views = {k: v for k, v in self._views.items() if k in live}

    def _commit(self, world, new: dict[tuple[int, int], _Snapshot]) -> None:
        """Keep ``new`` beside what is held of the same world (until `confirm`); another
        world's snapshots go (a complete generation of this world replaces them)."""
        if self.world != world:
            self._drop([key for key in self.held if key not in new])
        self.held.update(new)
        self.world = world
        self._unconfirmed = True

    # -- after a change of world ------------------------------------------------------------

    def holdings(self, state: MutableMapping) -> dict:
        """What this rank can give the new world (all-gathered by the loop; call `settle`
        first)."""
        return {"world": self.world, "tags": sorted(self.held),
                "own": {step: s.layout.as_dict() for (_, step), s in self.held.items()
                        if s.whole is not None},
                "sharded": self.sharded[1].as_dict() if self.sharded is not None else None,
                "step": int(state["step"])}

    def restore(self, state: MutableMapping, gathered: list[dict]) -> str | None:
        """Rebuild the full model and optimizer state in ``state`` from the survivors' copies
        (a collective of the new world; ``gathered``: every rank's `holdings`, by new rank).
        The snapshots stay until the new world's first complete refresh.

        Returns None when no rank held fully sharded state (nothing to do), else a line
        saying what was used.

        Raises:
            NotCovered: some old shard's rows are not held at one common step; the model's
                sharded parameters are then set to zeros of their full shape (a checkpoint
                must be loaded).
        """
        if not any(g["sharded"] or g["world"] for g in gathered):
            return None
        try:
            step, providers, whole_from = _plan(gathered)
        except NotCovered:
            self._zeros(state, gathered)
            raise
        layout = _Layout(**gathered[whole_from]["own"][step])
        me = dist.get_rank()
        shards = []
        for old, src in enumerate(providers):
            buf = (self.held[(old, step)].packed if me == src
                   else layout.empty(group_device(None)))
            dist.broadcast(buf, src=src)
            shards.append(buf)
        mine = [s for (_, t), s in self.held.items() if t == step and s.whole is not None]
        box = [mine[0].whole if me == whole_from else None]
        dist.broadcast_object_list(box, src=whole_from)
        self._apply(state, layout, shards, box[0])
        return (f"the fully sharded state of step {step} from memory (the rows of the old "
                f"world's {layout.shards} shards from ranks {sorted(set(providers))} of "
                f"this one)")

    def after_build(self) -> None:
        """After ``build()`` in a new world (every rank, joiners included): cut each restored
        optimizer state tensor (full shape) to this rank's new rows, and leave what the old
        world kept unconfirmed so: `confirm` is a collective of the new world, called for
        its own generations only (a fresh process has none of the old world's)."""
        self._unconfirmed = False
        for p, optimizer, key in self._restored:
            found = placement.fsdp_cut(p)
            if found is None:
                continue  # build() left it whole
            cut, shape = found
            [(start, _, rows)], _ = cut.segments(shape[0])  # this rank's rows of dim 0
            full = optimizer.state[p][key]
            optimizer.state[p][key] = full[start:start + rows].clone()
        self._restored = []

    # -- helpers ----------------------------------------------------------------------------

    def _zeros(self, state, gathered: list[dict]) -> None:
        """Not covered: give each sharded parameter zeros of its full shape and drop its
        optimizer state, so that ``build()`` can shard the model again for a checkpoint's
        load."""
        found = [g["sharded"] for g in gathered if g["sharded"]]
        found += [lay for g in gathered for lay in g["own"].values()]
        layout = _Layout(**found[0])
        named = dict(_named_params(state))
        for name, shape in zip(layout.names, layout.shapes, strict=True):
            p = named[name]
            p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)
            p.grad = None
            for optimizer in _optimizers(state):
                optimizer.state.pop(p, None)

    def _apply(self, state, layout: _Layout, shards: list[torch.Tensor], whole: dict) -> None:
        named = dict(_named_params(state))
        optimizers = _optimizers(state)
        self._restored = []
        offsets = [0] * len(shards)
        for i, name in enumerate(layout.names):
            p = named[name]
            shape = layout.shapes[i]
            tensors = []
            for j in range(1 + len(layout.keys[i])):
                full = torch.empty(shape, dtype=layout.dtype(i, j), device=shards[0].device)
                flat = full.view(-1).view(torch.uint8)
                block = layout.block(i, j)
                per_shard = block // layout.rows(i) if layout.rows(i) else 0  # bytes per row
                for old, packed in enumerate(shards):
                    n = layout.rows_of(i, old) * per_shard
                    flat[old * block:old * block + n].copy_(packed[offsets[old]:offsets[old] + n])
                    offsets[old] += block
                tensors.append(full)
            p.data = tensors[0].to(p.device)
            p.grad = None
            for optimizer in optimizers:
                if any(p is q for g in optimizer.param_groups for q in g["params"]):
                    entry = {k: (v.clone() if torch.is_tensor(v) else v)
                             for k, v in whole["scalars"].get(name, {}).items()}
                    for key, t in zip(layout.keys[i], tensors[1:], strict=True):
                        entry[key] = t
                        self._restored.append((p, optimizer, key))
                    optimizer.state[p] = entry
        _set_whole(state, whole)


def _layout(state: MutableMapping, params: list[tuple[str, nn.Parameter]],
            shards: int, with_state: bool = True) -> _Layout:
    """The packed layout of ``params`` (`_sharded`'s) over ``shards`` shards now (without
    ``with_state``: the parameters only, no optimizer state, and nothing refused).

    Raises:
        RuntimeError: a parameter in more than one optimizer (its copies would hold one
            optimizer's state), or optimizer state of a shape `_shard_keys` refuses."""
    if not with_state:
        return _Layout(shards, [n for n, _ in params],
                       [tuple(_unit_shape(p)) for _, p in params], [[] for _ in params],
                       [[str(p.dtype).removeprefix("torch.")] for _, p in params])
    optimizers = _optimizers(state)
    owners: dict[int, list[str]] = {}  # id(parameter) -> the state keys of its optimizers
    for key in sorted(state, key=str):
        if isinstance(state[key], torch.optim.Optimizer):
            for q in {id(q) for g in state[key].param_groups for q in g["params"]}:
                owners.setdefault(q, []).append(key)
    for name, p in params:
        if len(owners.get(id(p), [])) > 1:
            raise RuntimeError(f"neighbour copies: parameter {name!r} is in optimizers "
                               f"{owners[id(p)]}; the copies keep one optimizer's state per "
                               f"parameter: give each parameter to one optimizer, or pass "
                               f"copy_every=0 and recover from checkpoints")
    keys = [_shard_keys(optimizers, name, p) for name, p in params]
    dtypes = [[str(t.dtype).removeprefix("torch.") for t in
               [p, *(_state_of(optimizers, p)[k] for k in ks)]]
              for (_, p), ks in zip(params, keys, strict=True)]
    return _Layout(shards, [n for n, _ in params], [tuple(_unit_shape(p)) for _, p in params],
                   keys, dtypes)


def _views(layout: _Layout, packed: torch.Tensor, tensors: list[torch.Tensor]
           ) -> list[torch.Tensor]:
    """Views of ``packed`` (bytes) where each of ``tensors`` goes, in `_Layout`'s order
    (parameter i, then its keys: blocks of `_Layout.block` bytes), each of its tensor's dtype
    and shape (this rank's rows, at the start of its block; the rest is padding), or its
    bytes where the block's offset is not aligned to the dtype (mixed dtypes).

    Raises:
        RuntimeError: a tensor does not fit its block (the layout is not this state's).
    """
    views, offset = [], 0
    blocks = [layout.block(i, j) for i in range(len(layout.names))
              for j in range(1 + len(layout.keys[i]))]
    for t, block in zip(tensors, blocks, strict=True):
        nbytes = t.numel() * t.element_size()
        if nbytes > block:
            raise RuntimeError(f"neighbour copies: a tensor of {nbytes} bytes does not fit its "
                               f"block of {block} in the packed layout")
        raw = packed[offset:offset + nbytes]
        # typed where the offset allows it (a view needs the dtype's alignment), else bytes
        views.append(raw.view(t.dtype).view(t.shape) if offset % t.element_size() == 0 else raw)
        offset += block
    return views


def _pack(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` into their `_views`, in one fused copy (torch's foreach kernels, as
    torch.optim's ``foreach`` implementations use)."""
    with torch.no_grad():  # parameters among the tensors: the copy is not recorded
        sources = [t if v.dtype == t.dtype else t.reshape(-1).view(torch.uint8)
                   for t, v in zip(tensors, views, strict=True)]
        _torch.foreach_copy_(views, sources)


def _plan(gathered: list[dict]) -> tuple[int, list[int], int]:
    """(step, the new rank providing each old shard's rows, the new rank providing the whole
    state) from every rank's holdings, the same on every rank."""
    worlds = {tuple(g["world"]) for g in gathered if g["world"] is not None}
    if not worlds:
        raise NotCovered("no rank holds copies of the shards (copy_every=0, or none was "
                         "complete yet)")
    if len(worlds) != 1:
        raise NotCovered(f"the ranks' copies come from {len(worlds)} different worlds")
    (_round, _size, shards), = worlds
    held = [{tuple(t) for t in g["tags"]} for g in gathered]
    for step in sorted({t[1] for h in held for t in h}, reverse=True):
        providers = []
        for old in range(shards):
            holders = [new for new, h in enumerate(held) if (old, step) in h]
            if not holders:
                break
            providers.append(holders[0])
        else:
            owners = [new for new, g in enumerate(gathered) if step in g["own"]]
            if owners and len({repr(gathered[n]["own"][step]) for n in owners}) == 1:
                return step, providers, owners[0]
    lost = sorted(set(range(shards)) - {t[0] for h in held for t in h})
    raise NotCovered(f"no step at which the survivors hold the rows of all {shards} old "
                     f"shards" + (f" (nobody holds shard(s) {lost})" if lost else ""))


def _named_params(state: MutableMapping) -> list[tuple[str, nn.Parameter]]:
    """``(<state key>.<parameter name>, parameter)`` of every module in ``state``, each
    parameter once (under the first key that reaches it)."""
    seen, found = set(), []
    for key in sorted(state, key=str):
        if isinstance(state[key], nn.Module):
            for name, p in state[key].named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    found.append((f"{key}.{name}", p))
    return found


def _sharded(state: MutableMapping) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in _named_params(state) if placement.fsdp_cut(p) is not None]


def _optimizers(state: MutableMapping) -> list[torch.optim.Optimizer]:
    return [state[k] for k in sorted(state, key=str)
            if isinstance(state[k], torch.optim.Optimizer)]


def _state_of(optimizers, p) -> dict:
    for optimizer in optimizers:
        if p in optimizer.state:
            return optimizer.state[p]
    return {}


def _shard_keys(optimizers, name: str, p) -> list[str]:
    """The optimizer state keys of ``p`` that hold per-row values (the parameter's shape).

    Raises:
        RuntimeError: a tensor of another shape that is not a scalar (a factored moment)."""
    keys = []
    for k, v in sorted(_state_of(optimizers, p).items()):
        if not torch.is_tensor(v) or v.dim() == 0:
            continue
        if v.shape != p.shape:
            raise RuntimeError(f"neighbour copies: optimizer state {k!r} of {name!r} has shape "
                               f"{tuple(v.shape)}, neither the parameter's rows "
                               f"{tuple(p.shape)} nor a scalar (a factored moment, as "
                               f"Adafactor's); not supported: pass copy_every=0 and recover "
                               f"from checkpoints")
        keys.append(k)
    return keys


def _unit_shape(p) -> torch.Size:
    """The unsharded shape of ``p`` in its unit (the placement record's shape before the FSDP
    cut)."""
    return placement.fsdp_cut(p)[1]


def _stateful(value) -> bool:
    """An object that saves and loads itself (an LR scheduler, a GradScaler): kept by its
    state dict and loaded in place, so it stays bound to the live optimizer."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None))


def _whole(state: MutableMapping, params: list[tuple[str, nn.Parameter]]) -> dict:
    """What every rank holds whole (all but the rows of ``params``, `_sharded`'s): copies, so
    that training on does not change them."""
    sharded = {id(p): n for n, p in params}
    values, loaded, buffers, unsharded, groups, scalars = {}, {}, {}, {}, {}, {}
    for key in sorted(state, key=str):
        value = state[key]
        if isinstance(value, nn.Module):
            buffers[key] = {n: b.detach().clone() for n, b in value.named_buffers()}
            unsharded[key] = {n: p.detach().clone() for n, p in value.named_parameters()
                              if id(p) not in sharded}
        elif isinstance(value, torch.optim.Optimizer):
            groups[key] = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                           for g in value.param_groups]
        elif _stateful(value):
            loaded[key] = copy.deepcopy(value.state_dict())
        elif key != "step":
            values[key] = copy.deepcopy(value)
    for optimizer in _optimizers(state):
        for p, entry in optimizer.state.items():
            if id(p) in sharded:
                scalars[sharded[id(p)]] = {k: (v.clone() if torch.is_tensor(v) else v)
                                           for k, v in entry.items()
                                           if not (torch.is_tensor(v) and v.dim() > 0)}
    return {"values": values, "loaded": loaded, "buffers": buffers, "params": unsharded,
            "groups": groups, "scalars": scalars, "rng": torch.get_rng_state(),
            "step": int(state["step"])}


def _set_whole(state: MutableMapping, whole: dict) -> None:
    for key in sorted(state, key=str):
        value = state[key]
        if isinstance(value, nn.Module):
            with torch.no_grad():
                for n, b in value.named_buffers():
                    b.copy_(whole["buffers"][key][n])
                for n, p in value.named_parameters():
                    if n in whole["params"][key]:
                        p.data = whole["params"][key][n].to(p.device)
        elif isinstance(value, torch.optim.Optimizer):
            for group, saved in zip(value.param_groups, whole["groups"][key], strict=True):
                group.update(saved)
        elif key in whole["loaded"]:
            value.load_state_dict(whole["loaded"][key])
    for key, value in whole["values"].items():
        state[key] = value
    state["step"] = whole["step"]
    torch.set_rng_state(whole["rng"])


def _world(state: MutableMapping, round: int, params: list[tuple[str, nn.Parameter]]
           ) -> tuple[tuple[int, int, int], int, int]:
    """((round, world size, shards), this rank's shard index, replicas) of the sharding of
    ``params`` (`_sharded`'s): FSDP over the whole world (replicas 1), or HSDP (shards x
    replicas = world).

    Raises:
        RuntimeError: another layout (FSDP over part of the world: TP or PP beside it, or
            units of different groups)."""
    cuts = [placement.fsdp_cut(p)[0] for _, p in params]
    layouts = {(c.size, c.rank, c.replicas) for c in cuts}
    world = dist.get_world_size()
    (shards, shard, replicas), *others = layouts
    if others or shards * replicas != world:
        raise RuntimeError(f"neighbour copies: the model is sharded {sorted(layouts)} "
                           f"((shards, this rank's shard, replicas) per unit) in a world of "
                           f"{world}; only FSDP over the whole world, or HSDP over all of it, "
                           f"is supported (for now: not beside TP or PP)")
    return (round, world, shards), shard, replicas


def _neighbours() -> tuple[list[int], list[int]]:
    """(the ranks this rank sends its rows to, the ranks it receives rows from): rank r's
    keeper is on the next node (by node rank, cyclic), at r's local rank modulo that node's
    size; none when the world is one node."""
    nodes = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", 0)))
    order = sorted(set(nodes))
    if len(order) < 2:
        return [], []
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}

    def keeper(r: int) -> int:
        node = nodes[r]
        nxt = order[(order.index(node) + 1) % len(order)]
        return members[nxt][members[node].index(r) % len(members[nxt])]

    me = dist.get_rank()
    return [keeper(me)], [r for r in range(len(nodes)) if r != me and keeper(r) == me]
