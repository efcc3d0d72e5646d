"""One placement record per parameter: where its pieces live, read by everything that needs it.

Strategies change what a rank holds of a parameter, never its name, and meshrun keeps the
local value a plain tensor (any optimizer steps on it). What the local tensor *is* of the
global one is the parameter's `Placement`:

- ``global_shape`` and ``dtype`` of the unsplit parameter;
- ``cuts``: the strategies that cut it, in the order they were applied, each a `Cut` (which
  process group cuts which dim, this rank's index in it, fused chunks and padding):
  ``parallelize`` (TP) cuts first, along one dim, possibly in several fused blocks (``qkv``:
  ``[q_r; k_r; v_r]``) and with vocabulary padding; `fully_shard` then keeps ``torch.chunk``
  rows of dim 0 of *that* local tensor;
- ``pieces``: the blocks of the global tensor this rank holds (`Piece`: local index slices,
  global offsets, sizes), derived from the cuts;
- ``stage``: the pipeline stage that owns it (None when not pipelined).

Writers: ``parallelize`` (`record` in ``_make_shard``), `fully_shard` (`Placement.narrow`),
`PipelineStage` (`Placement.owned_by`). Readers: `meshrun.parallel.checkpoint` (pieces, global
shape), ``clip_grad_norm_`` (`sharded_over`), ``full_tensor``, ``state_dict()`` (`to_dtensor`),
``load_state_dict`` (`from_state`) and ``full_state_dict()`` (`gather_to_first`). No file reads
another strategy's private attributes.

The model is DTensor's spec (``DTensorSpec``: mesh, placements, global shape), minus the
tensor subclass; pieces are DCP's chunk metadata (``ChunkStorageMetadata``: offsets and sizes
in the global tensor), generalised to the several blocks per rank that fused TP shards give.
Where a placement is a DTensor layout exactly (TP with one chunk, FSDP, TP then FSDP),
`to_dtensor` gives that DTensor, with its true global shape, so ``torch.distributed.checkpoint``
saves the unsplit model.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["Cut", "Piece", "Placement", "from_state", "full_tensor", "gather_to_first",
           "global_shape", "of", "pieces", "record", "restore", "sharded_over", "to_dtensor"]

_ATTR = "_meshrun_placement"  # the one attribute, set and read only here


@dataclass(frozen=True)
class Piece:
    """One block: ``local[index]`` is ``global[offsets[d]:offsets[d] + sizes[d], ...]``.

    ``index`` is a tuple of slices, one per dim of the local tensor; ``offsets`` and ``sizes``
    are in elements of the global tensor, one per dim.
    """

    index: tuple[slice, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The block of ``local`` (a view, shape ``sizes``)."""
        return local[self.index]

    @property
    def region(self) -> tuple[slice, ...]:
        """Where the block sits in the global tensor: ``global[region]`` has shape ``sizes``."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes, strict=True))


@dataclass(frozen=True)
class Cut:
    """One strategy's cut of dim ``dim`` of the (so far) local tensor over a process group.

    Attributes:
        strategy: ``"tp"`` or ``"fsdp"`` (who made it).
        group: the process group (None: the world).
        dim: the dim cut (non-negative).
        size: ranks in ``group``; ``rank``: this rank's index in it.
        chunks: fused blocks, each cut separately (TP ``qkv``: 3); rank r keeps block r of each.
        padded: the dim is first padded with zero rows to ``padded`` (a multiple of
            ``size * chunks``) and every rank keeps ``padded / size`` rows (TP, Megatron's
            vocabulary padding). None: ``torch.chunk`` rows, ``ceil(n / size)`` per rank, the
            last ranks fewer or none (FSDP, and DTensor's ``Shard``).
        replicas: the groups that hold this same cut, each a copy of the others (HSDP: the
            size of the replicate group); 1 for a plain cut.
    """

    strategy: str
    group: dist.ProcessGroup | None = field(compare=False)
    dim: int
    size: int
    rank: int
    chunks: int = 1
    padded: int | None = None
    replicas: int = 1

    def segments(self, length: int, rank: int | None = None) -> tuple[list[tuple[int, int, int]],
                                                                         int]:
        """How rank ``rank`` (default: this one) keeps a dim of ``length`` elements.

        Returns ``([(old_start, new_start, count), ...], new_length)``: rows
        ``old_start:old_start + count`` of the dim before the cut are rows
        ``new_start:new_start + count`` after it (rows at or past ``length`` are padding).
        """
        r = self.rank if rank is None else rank
        if self.padded is None:
            c = math.ceil(length / self.size)
            rows = max(0, min(c, length - r * c))
            return [(min(r * c, length), 0, rows)], rows
        m = self.padded // (self.size * self.chunks)  # rows per chunk per rank
        per_chunk = self.padded // self.chunks
        return [(k * per_chunk + r * m, k * m, m) for k in range(self.chunks)], self.chunks * m


@dataclass(frozen=True, eq=False)
class Placement:
    """Where one parameter's pieces live (see the module docstring).

    Attributes:
        global_shape: the unsplit shape.
        dtype: the parameter's dtype.
        cuts: `Cut` s in the order applied (TP, then FSDP); empty: whole on every rank.
        stage: the pipeline stage that owns the parameter, None when not pipelined.
    """

    global_shape: torch.Size
    dtype: torch.dtype
    cuts: tuple[Cut, ...] = ()
    stage: int | None = None

    @functools.cached_property
    def local_shape(self) -> torch.Size:
        """The shape of this rank's local tensor (padding included)."""
        return _layout(self.global_shape, self.cuts)[0]

    @functools.cached_property
    def pieces(self) -> tuple[Piece, ...]:
        """The non-empty blocks of the global tensor this rank holds (padding excluded)."""
        return _layout(self.global_shape, self.cuts)[1]

    @property
    def groups(self) -> list[dist.ProcessGroup | None]:
        """The process groups the parameter is cut over, in order (None: the world)."""
        return [c.group for c in self.cuts]

    def narrow(self, cut: Cut) -> Placement:
        """This placement cut once more (by the next strategy, on the current local tensor)."""
        return replace(self, cuts=(*self.cuts, cut))

    def owned_by(self, stage: int) -> Placement:
        """This placement, owned by pipeline stage ``stage``."""
        return replace(self, stage=stage)


def of(param: torch.Tensor) -> Placement:
    """The placement of ``param``: the recorded one, else whole and replicated (its shape)."""
    found = getattr(param, _ATTR, None)
    return found if found is not None else Placement(param.shape, param.dtype)


def fsdp_cut(param: torch.Tensor) -> tuple[Cut, torch.Size] | None:
    """The cut `fully_shard` made of ``param`` (rows of dim 0 over its shards, ``replicas``
    copies of that layout under HSDP) and the shape it cut (the local shape before it: the
    unit's unsharded parameter); None when FSDP does not shard ``param``."""
    found = of(param)
    for i, cut in enumerate(found.cuts):
        if cut.strategy == "fsdp":
            return cut, Placement(found.global_shape, found.dtype, found.cuts[:i]).local_shape
    return None


def record(param: torch.Tensor, placement: Placement) -> None:
    """Attach ``placement`` to ``param`` (a strategy calls this when it cuts or owns it).

    Raises:
        ValueError: ``param``'s shape is not the placement's local shape.
    """
    if tuple(param.shape) != tuple(placement.local_shape):
        raise ValueError(f"placement: a parameter of shape {tuple(param.shape)} cannot hold a "
                         f"local tensor of shape {tuple(placement.local_shape)}")
    setattr(param, _ATTR, placement)


def restore(param: torch.Tensor, placement: Placement) -> None:
    """Put back a record that a strategy's undo found (`meshrun.parallel.fsdp.release`),
    without the shape check: the caller gives ``param`` its tensor of that shape next. A
    whole, unowned placement is no record at all."""
    if not placement.cuts and placement.stage is None:
        if hasattr(param, _ATTR):
            delattr(param, _ATTR)
    else:
        setattr(param, _ATTR, placement)


def global_shape(param: torch.Tensor) -> torch.Size:
    """The unsplit shape of ``param`` (its own shape when no strategy cut it)."""
    return of(param).global_shape


def pieces(param: torch.Tensor) -> list[Piece]:
    """The blocks of the global tensor that this rank's ``param`` holds (empty ones dropped).

    Raises:
        ValueError: ``param``'s shape does not match what its strategies recorded (it was
            replaced after sharding).
    """
    placement = of(param)
    if tuple(param.shape) != tuple(placement.local_shape):
        raise ValueError(f"placement: a parameter of shape {tuple(param.shape)} was recorded "
                         f"with local shape {tuple(placement.local_shape)}")
    return list(placement.pieces)


def sharded_over(param: torch.Tensor) -> list[dist.ProcessGroup | None]:
    """The process groups ``param`` is cut over (TP, then FSDP); ``None`` is the world."""
    return of(param).groups


# -- whole tensors from pieces -----------------------------------------------------------------


def full_tensor(placement: Placement, local: torch.Tensor) -> torch.Tensor:
    """The unsplit tensor, on every rank of the cut groups: all-gathers, last cut first.

    Args:
        placement: the parameter's placement.
        local: a tensor of ``placement.local_shape`` (the parameter, or its gradient).

    Returns:
        A new tensor of ``placement.global_shape`` (padding dropped, fused chunks in order);
        ``local`` itself (detached) when nothing cut it. One all-gather per cut.
    """
    t = local.detach()
    for cut, length in reversed(list(zip(placement.cuts, _lengths(placement), strict=True))):
        t = _uncut(cut, length, t, _all_gather(t, cut, length))
    return t


def gather_to_first(placement: Placement, local: torch.Tensor) -> torch.Tensor | None:
    """The unsplit tensor on the first rank (rank 0 of every cut group); None elsewhere.

    One ``gather`` per cut, last cut first (FSDP rows onto FSDP rank 0, then the TP blocks
    onto TP rank 0 among those): no rank all-gathers, and only the first one holds the result.
    Ranks must call it in the same order, parameter by parameter.
    """
    t = local.detach()
    for cut, length in reversed(list(zip(placement.cuts, _lengths(placement), strict=True))):
        parts = _gather(t, cut, length)
        if parts is None:
            return None
        t = _uncut(cut, length, t, parts)
    return t


# -- DTensors for state dicts ------------------------------------------------------------------


def to_dtensor(placement: Placement, local: torch.Tensor, name: str) -> torch.Tensor:
    """``local`` as a DTensor of the true global shape (no copy, no communication).

    Every cut becomes a ``Shard(dim)`` on one dim of a DeviceMesh made from the cut groups
    (1-D for one cut; 2-D ``(tp, fsdp)`` for TP then FSDP: DTensor applies placements in mesh
    order, each to the previous local tensor, as the cuts were). The local tensor is narrowed
    to its valid rows (padding dropped). A tensor nothing cut is returned as is.

    Raises:
        ValueError: the layout is not a DTensor layout (fused chunks, or padding that does not
            leave ``torch.chunk`` rows on every rank of the cut groups); the message names
            ``name`` and points to `meshrun.parallel.checkpoint` and ``full_state_dict()``.
    """
    if not placement.cuts:
        return local
    problem = _not_a_dtensor(placement)
    if problem:
        raise ValueError(f"state_dict: parameter {name!r} ({problem}) cannot be described as a "
                         f"DTensor of shape {tuple(placement.global_shape)}; save it with "
                         f"meshrun.parallel.checkpoint (any layout, resharding on load), or "
                         f"take full tensors with meshrun.parallel.full_state_dict()")
    mesh = _device_mesh(placement.cuts, local.device.type)
    value = _valid(placement, local)
    shape = placement.global_shape
    return DTensor.from_local(value, mesh, [Shard(c.dim) for c in placement.cuts],
                              run_check=False, shape=shape, stride=_contiguous_stride(shape))


def from_state(placement: Placement, value, current: torch.Tensor) -> torch.Tensor:
    """What ``load_state_dict`` should copy into a parameter whose local value is ``current``.

    Accepts: a DTensor that `to_dtensor` would make (its local tensor, padding put back), a
    DTensor of another layout (gathered with ``full_tensor()``, then cut), a full tensor of the
    global shape (this rank's pieces taken), or anything else, returned unchanged (a local
    tensor; a wrong shape is then reported by ``load_state_dict``).
    """
    if not placement.cuts:
        return value.full_tensor() if isinstance(value, DTensor) else value
    if isinstance(value, DTensor):
        if _same_layout(placement, value, current.device.type):
            local = value.to_local()
            if tuple(local.shape) == tuple(placement.local_shape):
                return local
            out = current.detach().clone()
            if placement.pieces:
                out[placement.pieces[0].index] = local
            return out
        value = value.full_tensor()
    if tuple(value.shape) != tuple(placement.global_shape):
        return value
    out = current.detach().clone()
    for piece in placement.pieces:
        out[piece.index] = value[piece.region]
    return out


_RAW = contextvars.ContextVar("meshrun_raw_state_dict", default=False)


@contextlib.contextmanager
def local_state_dict():
    """Within it, the strategies' ``state_dict()`` hooks leave local tensors as they are."""
    token = _RAW.set(True)
    try:
        yield
    finally:
        _RAW.reset(token)


def register_state_dict_hooks(module, params: list[tuple[str, torch.Tensor]]) -> list:
    """Make ``module.state_dict()`` give ``params`` (name relative to ``module``, parameter)
    as DTensors of their global shape (`state_dict_hook`), and ``load_state_dict`` take
    those, full tensors or local shards (`load_state_dict_hook`); returns the hooks' handles
    (``handle.remove()`` undoes it)."""
    if not params:
        return []
    return [module.register_state_dict_post_hook(functools.partial(state_dict_hook, params)),
            module.register_load_state_dict_pre_hook(
                functools.partial(load_state_dict_hook, params))]


def state_dict_hook(params: list[tuple[str, torch.Tensor]], module, state_dict, prefix,
                    local_metadata) -> None:
    """A ``state_dict`` post-hook: each ``(key, param)`` value becomes `to_dtensor` 's.

    Registered by the strategies with ``functools.partial(state_dict_hook, params)``, keys
    relative to the module the hook is registered on.
    """
    if _RAW.get():
        return
    for key, param in params:
        key = prefix + key
        if key in state_dict and not isinstance(state_dict[key], DTensor):
            state_dict[key] = to_dtensor(of(param), state_dict[key], key)


def load_state_dict_hook(params: list[tuple[str, torch.Tensor]], module, state_dict, prefix,
                         local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs) -> None:
    """A ``load_state_dict`` pre-hook: each ``(key, param)`` value becomes `from_state` 's."""
    for key, param in params:
        key = prefix + key
        if key in state_dict:
            with torch.no_grad():
                state_dict[key] = from_state(of(param), state_dict[key], param)


# -- helpers -----------------------------------------------------------------------------------


def _layout(shape: torch.Size, cuts: tuple[Cut, ...],
            ranks: tuple[int, ...] | None = None) -> tuple[torch.Size, tuple[Piece, ...]]:
    """(local shape, non-empty pieces) of ``shape`` after ``cuts``, at ``ranks`` (default:
    this rank's index in each cut group)."""
    local = list(shape)
    blocks = [Piece(tuple(slice(0, n) for n in shape), (0,) * len(shape), tuple(shape))]
    for i, cut in enumerate(cuts):
        segments, new_length = cut.segments(local[cut.dim], None if ranks is None else ranks[i])
        blocks = [b for piece in blocks for b in _narrow(piece, cut.dim, segments)]
        local[cut.dim] = new_length
    return torch.Size(local), tuple(b for b in blocks if all(b.sizes))


def _narrow(piece: Piece, dim: int, segments) -> list[Piece]:
    """The parts of ``piece`` that the ``segments`` of a cut of ``dim`` keep, renumbered."""
    out = []
    a, b = piece.index[dim].start, piece.index[dim].stop
    for old, new, count in segments:
        lo, hi = max(a, old), min(b, old + count)
        if hi <= lo:
            continue
        index, offsets, sizes = list(piece.index), list(piece.offsets), list(piece.sizes)
        index[dim] = slice(new + lo - old, new + hi - old)
        offsets[dim] += lo - a
        sizes[dim] = hi - lo
        out.append(Piece(tuple(index), tuple(offsets), tuple(sizes)))
    return out


def _lengths(placement: Placement) -> list[int]:
    """The length of each cut's dim just before that cut."""
    local, out = list(placement.global_shape), []
    for cut in placement.cuts:
        out.append(local[cut.dim])
        local[cut.dim] = cut.segments(local[cut.dim])[1]
    return out


def _padded_rows(cut: Cut, length: int) -> int:
    """Rows every rank sends for a cut of a dim of ``length`` (equal sizes for gloo)."""
    return math.ceil(length / cut.size) if cut.padded is None else cut.padded // cut.size


def _send(t: torch.Tensor, cut: Cut, length: int) -> torch.Tensor:
    rows = _padded_rows(cut, length)
    t = t.movedim(cut.dim, 0)
    if t.shape[0] < rows:
        t = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
    return t.contiguous()


def _all_gather(t: torch.Tensor, cut: Cut, length: int) -> list[torch.Tensor]:
    send = _send(t, cut, length)
    parts = [torch.empty_like(send) for _ in range(cut.size)]
    dist.all_gather(parts, send, group=cut.group)
    return parts


def _gather(t: torch.Tensor, cut: Cut, length: int) -> list[torch.Tensor] | None:
    send = _send(t, cut, length)
    parts = [torch.empty_like(send) for _ in range(cut.size)] if cut.rank == 0 else None
    dist.gather(send, parts, group=cut.group, group_dst=0)
    return parts


def _uncut(cut: Cut, length: int, t: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's (dim-first, padded) part of a cut -> the dim of ``length`` before it."""
    out = t.new_empty(length, *parts[0].shape[1:])
    for r, part in enumerate(parts):
        for old, new, count in cut.segments(length, r)[0]:
            n = max(0, min(count, length - old))  # rows past length are padding
            if n:
                out[old:old + n] = part[new:new + n]
    return out.movedim(0, cut.dim)


def _dtensor_rows(length: int, size: int, rank: int) -> tuple[int, int]:
    """(offset, rows) of ``Shard`` on a dim of ``length`` over ``size`` ranks (torch.chunk)."""
    c = math.ceil(length / size)
    return min(rank * c, length), max(0, min(c, length - rank * c))


def _not_a_dtensor(placement: Placement) -> str | None:
    """Why the placement is not ``Shard`` on every cut (checked at every rank), else None."""
    return _dtensor_problem(tuple(placement.global_shape),
                            tuple(replace(c, group=None, rank=0) for c in placement.cuts))


@functools.lru_cache(maxsize=1024)
def _dtensor_problem(shape: tuple[int, ...], cuts: tuple[Cut, ...]) -> str | None:
    """`_not_a_dtensor` of a shape and group-free cuts (cached: it visits every rank)."""
    if any(c.chunks > 1 for c in cuts):
        return "fused TP chunks: each rank holds several blocks"
    for ranks in itertools.product(*(range(c.size) for c in cuts)):
        _, got = _layout(torch.Size(shape), cuts, ranks)
        offsets, sizes = [0] * len(shape), list(shape)
        for cut, r in zip(cuts, ranks, strict=True):
            start, sizes[cut.dim] = _dtensor_rows(sizes[cut.dim], cut.size, r)
            offsets[cut.dim] += start
        if not all(sizes):
            if got:
                return f"rows at ranks {ranks} where torch.chunk gives none"
        elif len(got) != 1 or (got[0].offsets, got[0].sizes) != (tuple(offsets), tuple(sizes)):
            return f"padded rows at ranks {ranks} are not torch.chunk rows"
    return None


def _valid(placement: Placement, local: torch.Tensor) -> torch.Tensor:
    """``local`` narrowed to the one piece it holds (zero rows on some dim if none)."""
    if placement.pieces:
        return local[placement.pieces[0].index]
    dim = placement.cuts[-1].dim
    return local.narrow(dim, 0, 0)


_MESHES: dict[tuple, DeviceMesh] = {}


def _device_mesh(cuts: tuple[Cut, ...], device_type: str) -> DeviceMesh:
    """The DeviceMesh of the cut groups, in cut order (built once per groups and device)."""
    groups = [c.group if c.group is not None else dist.group.WORLD for c in cuts]
    key = (tuple(id(g) for g in groups), device_type)
    if key not in _MESHES:
        if len(groups) == 1:
            _MESHES[key] = DeviceMesh.from_group(groups[0], device_type)
        else:
            _MESHES[key] = DeviceMesh.from_group(groups, device_type, mesh=_grid(groups),
                                                 mesh_dim_names=_names(cuts))
    return _MESHES[key]


def _grid(groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """Global ranks of the groups' product, ``grid[i, j, ...]``: index i in groups[0], ...

    The groups are axes of a `meshrun.parallel.Mesh` (an affine grid of ranks), so a rank's
    coordinates add: ``rank(i, j) = ranks0[i] + ranks1[j] - me``.
    """
    me = dist.get_rank()
    axes = [torch.tensor(dist.get_process_group_ranks(g)) - me for g in groups]
    grid = torch.full([len(a) for a in axes], me, dtype=torch.int)
    for d, a in enumerate(axes):
        grid = grid + a.view(*[-1 if i == d else 1 for i in range(len(axes))]).int()
    if grid.unique().numel() != grid.numel():
        raise ValueError("placement: the cut groups are not axes of one mesh of ranks")
    return grid


def _names(cuts: tuple[Cut, ...]) -> tuple[str, ...]:
    names, seen = [], {}
    for c in cuts:
        seen[c.strategy] = seen.get(c.strategy, 0) + 1
        names.append(c.strategy if seen[c.strategy] == 1 else f"{c.strategy}{seen[c.strategy]}")
    return tuple(names)


def _same_layout(placement: Placement, value: DTensor, device_type: str) -> bool:
    if tuple(value.shape) != tuple(placement.global_shape):
        return False
    if tuple(value.placements) != tuple(Shard(c.dim) for c in placement.cuts):
        return False
    mesh = value.device_mesh
    groups = [c.group if c.group is not None else dist.group.WORLD for c in placement.cuts]
    return (mesh.ndim == len(groups)
            and all(dist.get_process_group_ranks(mesh.get_group(d))
                    == dist.get_process_group_ranks(g) for d, g in enumerate(groups)))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))
