"""`Mesh`: the world's ranks arranged as a named N-D grid, one process group per axis.

``Mesh({"pp": 2, "dp": 2, "tp": 2})`` lays ranks out in row-major order with the last axis
innermost: with 8 ranks, tp groups are {0,1}, {2,3}, ..., dp groups {0,2}, {1,3}, {4,6}, ...,
and pp groups {0,4}, {1,5}, ... Keep TP innermost: its collectives are the most frequent, and
contiguous ranks share a node. Each strategy is handed ``mesh.group(axis)``; nothing here is a
module-level global.

Built on ``torch.distributed.device_mesh.init_device_mesh`` (every rank creates every group in
the same order there); ``mesh.device_mesh`` exposes it for DTensor-based code.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshrun import _torch


class Mesh:
    """A named N-D mesh over the default process group.

    Args:
        shape: axis name -> size, in order from outermost to innermost, e.g.
            ``{"pp": 2, "dp": 4, "tp": 2}``. The product must equal the world size.
        device_type: ``"cuda"`` or ``"cpu"`` (default: ``"cuda"`` if available).

    Raises:
        RuntimeError: the default process group is not initialised (call
            ``meshrun.parallel.init()`` first).
        ValueError: empty shape, a size < 1, a non-string or duplicate axis name, or a product
            of sizes different from the world size (the message names sizes and world size).

    Mirrors torch's ``DeviceMesh`` (``init_device_mesh(..., mesh_dim_names=...)``).
    """

    def __init__(self, shape: Mapping[str, int], *, device_type: str | None = None):
        shape = dict(shape)
        if not shape:
            raise ValueError("Mesh: the shape must name at least one axis, e.g. {'dp': 2}")
        for axis, size in shape.items():
            if not isinstance(axis, str) or not axis:
                raise ValueError(f"Mesh: axis names must be non-empty strings (got {axis!r})")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"Mesh: axis {axis!r} must have an integer size >= 1 "
                                 f"(got {size!r})")
        if not dist.is_initialized():
            raise RuntimeError("Mesh: the default process group is not initialised; "
                               "call meshrun.parallel.init() first")
        world_size = dist.get_world_size()
        product = math.prod(shape.values())
        if product != world_size:
            sizes = " x ".join(f"{a}={s}" for a, s in shape.items())
            raise ValueError(f"Mesh: the axis sizes {sizes} multiply to {product}, but the "
                             f"world size is {world_size}; make the product equal the world size")
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.shape: dict[str, int] = shape
        self._flat: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self.device_mesh: DeviceMesh = init_device_mesh(
            device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        _live.add(self)

    def release(self) -> None:
        """Let go of this mesh's process groups (after ``destroy_process_group``), so that
        their connections close even where the mesh itself is still referenced; the mesh
        cannot be used afterwards. `meshrun.parallel.elastic` releases every mesh when the
        world changes in place: a peer blocked on a connection of this rank then fails at
        once instead of waiting for the collective timeout (gloo closes a pair's socket only
        when its group object is freed)."""
        self._flat.clear()
        _torch.release_mesh_groups(self.device_mesh)
        self.device_mesh = None

    @property
    def axes(self) -> tuple[str, ...]:
        """Axis names, outermost first."""
        return tuple(self.shape)

    def group(self, axis: str | tuple[str, ...]) -> dist.ProcessGroup:
        """The process group of this rank along ``axis`` (ranks differing only in that axis).

        A tuple of axes, e.g. ``("dp", "cp")``, gives their flattened group: the ranks that
        differ only in those axes (data and context parallel ranks share parameters, so
        gradients are reduced over dp x cp, as torchtitan does). Flattened groups are made on
        first use, by every rank (a collective: call it on all ranks, in the same order)."""
        if isinstance(axis, str):
            return self.device_mesh.get_group(self._check(axis))
        axes = tuple(self._check(a) for a in axis)
        if len(axes) == 1:
            return self.group(axes[0])
        if axes not in self._flat:
            self._flat[axes] = self._new_flat_group(axes)
        return self._flat[axes]

    def _new_flat_group(self, axes: tuple[str, ...]) -> dist.ProcessGroup:
        ranks = self.device_mesh.mesh
        order = [i for i, a in enumerate(self.shape) if a not in axes] + \
            [list(self.shape).index(a) for a in axes]  # the flattened axes last, as named
        rows = ranks.permute(order).reshape(-1, math.prod(self.shape[a] for a in axes))
        mine = None
        for row in rows.tolist():  # every rank creates every group, in the same order
            group = dist.new_group(row)
            if dist.get_rank() in row:
                mine = group
        return mine

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (0 <= rank < size(axis))."""
        return self.device_mesh.get_local_rank(self._check(axis))

    def size(self, axis: str) -> int:
        """The number of ranks along ``axis``."""
        return self.shape[self._check(axis)]

    def _check(self, axis: str) -> str:
        if axis not in self.shape:
            raise KeyError(f"Mesh: no axis {axis!r} (axes: {', '.join(self.shape)})")
        return axis

    def __repr__(self) -> str:
        return f"Mesh({self.shape})"


_live: weakref.WeakSet[Mesh] = weakref.WeakSet()  # every mesh of this process, for release_all


def release_all() -> None:
    """`Mesh.release` every mesh this process made (the world is being left)."""
    for mesh in list(_live):
        mesh.release()
    _live.clear()
