"""`init()`: join the process group that the launcher described, and say where this rank runs.

A worker started by ``meshrun`` or ``torchrun`` finds the torchrun environment contract
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; docs/design.md §3.1). `init()` reads it,
picks the backend (nccl when CUDA is available, gloo otherwise), binds the CUDA device from
LOCAL_RANK, calls ``torch.distributed.init_process_group`` and returns a small frozen
`ParallelContext`. Under plain ``python`` (none of the rank variables set) it forms a world of
one on an in-memory store, so the same script runs anywhere; a partial environment is an error
naming what is missing, never a silent world of one.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshrun import _torch, exit_guard
from meshrun.parallel import data_check
from meshrun.parallel.heartbeat import register_stack_dump

RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
STORE_VARS = ("MASTER_ADDR", "MASTER_PORT")

_context: ParallelContext | None = None  # the one context of this process (init is idempotent)
_timeout: timedelta | None = None  # the collective timeout init() was given (rejoin keeps it)


@dataclass(frozen=True)
class ParallelContext:
    """Where this worker runs.

    Attributes:
        rank: global rank, 0 <= rank < world_size.
        local_rank: rank within this node (indexes the node's devices).
        world_size: number of processes in the default process group.
        device: ``cuda:<local_rank>`` when CUDA is available, else ``cpu``.
        backend: the c10d backend of the default group (``"nccl"`` or ``"gloo"``).
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def init(backend: str | None = None, timeout: float | timedelta | None = None) -> ParallelContext:
    """Initialise the default process group from the torchrun environment; return the context.

    Idempotent: a second call returns the same `ParallelContext` (arguments are then ignored).
    If the script already called ``init_process_group`` itself, that group is adopted.

    Args:
        backend: override the c10d backend (default: ``"nccl"`` on CUDA, ``"gloo"`` on CPU).
        timeout: collective timeout, seconds or a ``timedelta`` (default: torch's default).

    Raises:
        RuntimeError: some but not all of RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
            MASTER_PORT are set (the message names the missing ones), or they are not integers.

    Mirrors the ``env://`` init method of ``torch.distributed.init_process_group`` and the
    environment that ``torch.distributed.run`` (torchrun) gives its workers.
    """
    global _context, _timeout
    if _context is not None:
        return _context
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    _timeout = timeout
    env = os.environ
    cuda = torch.cuda.is_available()
    if dist.is_initialized():  # the script initialised the group itself: adopt it
        local_rank = int(env.get("LOCAL_RANK", 0))
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
    elif not any(name in env for name in RANK_VARS):
        print("meshrun.parallel: no RANK/LOCAL_RANK/WORLD_SIZE in the environment; "
              "running as a world of one process", file=sys.stderr)
        rank, local_rank, world_size = 0, 0, 1
        backend = backend or ("nccl" if cuda else "gloo")
        _set_device(cuda, local_rank)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                **_timeout_kwargs(timeout))
    else:
        missing = [name for name in RANK_VARS + STORE_VARS if name not in env]
        if missing:
            raise RuntimeError(
                f"meshrun.parallel.init: incomplete torchrun environment: missing "
                f"{', '.join(missing)} (set all of {', '.join(RANK_VARS + STORE_VARS)}, "
                f"launch with meshrun/torchrun, or unset them all for a world of one)")
        rank, local_rank, world_size = (_int_env(name) for name in RANK_VARS)
        backend = backend or ("nccl" if cuda else "gloo")
        _set_device(cuda, local_rank)
        from meshrun.parallel._sockets import note_world_sockets, tcp_connections

        before = tcp_connections()  # the world's own connections, for an in-place change
        dist.init_process_group(backend, init_method="env://", **_timeout_kwargs(timeout))
        note_world_sockets(before)
    register_stack_dump()  # lets `meshrun --hang-timeout` show where this rank is stuck
    data_check.arm()  # set_epoch forgotten; the same data on every rank, torch's wrappers too
    exit_guard.install()  # (under torchrun too) registered first, so it runs last: atexit
    atexit.register(_destroy_at_exit)  # is LIFO
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    _context = ParallelContext(rank, local_rank, world_size, device, str(backend))
    return _context


def rejoin() -> ParallelContext:
    """Join the world that the environment describes now, after the last one was destroyed
    (``torch.distributed.destroy_process_group``), with `init`'s backend and timeout; return
    the new context, which `init` returns from now on.

    For in-place elastic recovery (`meshrun.parallel.elastic`): the agent handed this
    process a new round's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which the caller
    put in ``os.environ``. LOCAL_RANK (and so the device) does not change.

    Raises:
        RuntimeError: `init` was never called, the old world is still initialised, or the
            environment is incomplete (as for `init`).
    """
    global _context
    if _context is None or dist.is_initialized():
        raise RuntimeError("meshrun.parallel.rejoin: call init() first, and destroy the old "
                           "process group before joining a new world")
    missing = [name for name in RANK_VARS + STORE_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(f"meshrun.parallel.rejoin: incomplete environment: missing "
                           f"{', '.join(missing)}")
    rank, local_rank, world_size = (_int_env(name) for name in RANK_VARS)
    from meshrun.parallel._sockets import note_world_sockets, tcp_connections

    before = tcp_connections()
    groups = _torch.group_count()
    try:
        dist.init_process_group(_context.backend, init_method="env://",
                                **_timeout_kwargs(_timeout))
    except BaseException:
        # torch counted the group although it never formed: a fresh process joining the
        # next world would name its groups from 0 and this one from 1, and they would wait
        # for each other's keys forever (torch resets the count only in destroy)
        _torch.set_group_count(groups)
        raise
    note_world_sockets(before)
    _context = ParallelContext(rank, local_rank, world_size, _context.device, _context.backend)
    return _context


def _destroy_at_exit() -> None:
    # torch 2.13 + gloo: a process that exits while gloo's threads still hold Python objects
    # can die of "terminate called without an active exception" (SIGABRT) in teardown
    # (`meshrun.exit_guard` says why). Destroying the group joins its threads where nothing
    # else holds it; the exit guard covers the rest.
    if dist.is_initialized():
        dist.destroy_process_group()


def _set_device(cuda: bool, local_rank: int) -> None:
    if cuda:
        torch.cuda.set_device(local_rank)


def _timeout_kwargs(timeout: timedelta | None) -> dict:
    return {} if timeout is None else {"timeout": timeout}


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"meshrun.parallel.init: {name} must be an integer "
                           f"(got {name}={value!r})") from None
