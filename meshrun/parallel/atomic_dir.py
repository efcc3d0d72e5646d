"""Directories that appear whole or not at all: the filesystem half of `checkpoint.save`.

A checkpoint is a directory written by every rank. To make it appear at once, it is written as
``<path>.partial`` and put in place by one rename, after its files and the directory itself
are fsync'd. Replacing an existing ``<path>`` (a fixed name such as ``ckpt/latest``) is one
``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+): the new and the old directory swap names in one
step, so a reader or a kill at any moment sees one complete checkpoint under ``<path>``. Where
the filesystem cannot exchange (EINVAL: some network filesystems), the old one is renamed to
``<path>.old`` first; a kill between the two renames then leaves ``<path>.old``, which
`sweep` (run at the start of the next save) renames back.

`DirLock` keeps two jobs from writing into one directory: an exclusive ``flock`` on
``<directory>/.meshrun-save.lock`` for the length of a save. The kernel drops it when the
holder dies, so a killed job never leaves a stale lock; the holder writes its host and pid into
the file for the error message of the job it turns away.

Nothing here touches a directory meshrun did not write: every directory `begin` makes holds a
``.meshrun-checkpoint`` marker (it travels with the rename), `sweep` removes or restores only
marked directories, and `check_target` refuses to replace a directory that is not a checkpoint
(a project folder, ``.``) or a symbolic link.

Only rank 0 (of the saving group) calls these; `checkpoint` tells the others the outcome.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import socket

PARTIAL = ".partial"
OLD = ".old"
LOCK_NAME = ".meshrun-save.lock"
MARKER = ".meshrun-checkpoint"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


class SaveInProgress(RuntimeError):
    """Another process holds the save lock of this directory."""


class DirLock:
    """An exclusive, non-blocking lock on ``directory`` for one save.

    Raises:
        SaveInProgress: another process (another job, or a save of this job that was not
            joined) holds it; the message names the directory and the holder.
    """

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, LOCK_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise SaveInProgress(
                f"checkpoint.save: another save is writing into {directory} ({holder}); two "
                f"jobs must not share a checkpoint directory: give each job its own") from None
        self.fd = fd
        _HELD.add(self)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"held by {socket.gethostname()} pid {os.getpid()}\n".encode())
        except OSError:  # a full disk: the lock holds without the note
            pass

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None
            _HELD.discard(self)


# A child forked during a save (a DataLoader worker) shares the lock's open file: it closes its
# descriptor at once, so the lock goes when the saving process releases it.
_HELD: set[DirLock] = set()


def _close_in_child() -> None:
    for lock in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(lock.fd)
        lock.fd = None
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def check_target(path: str) -> None:
    """Refuse a ``path`` that a save must not replace.

    Raises:
        FileExistsError: ``path`` is a symbolic link, a file, or a directory that holds
            something other than a checkpoint (replacing it would delete it).
    """
    if os.path.islink(path):
        raise FileExistsError(f"checkpoint.save: {path} is a symbolic link; save to the "
                              f"directory it points to ({os.path.realpath(path)}) instead")
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise FileExistsError(f"checkpoint.save: {path} exists and is not a directory")
    if os.listdir(path) and not is_checkpoint(path):
        raise FileExistsError(f"checkpoint.save: {path} is a directory that is not a "
                              f"checkpoint (no .metadata); saving there would replace it: "
                              f"choose another path")


def is_checkpoint(path: str) -> bool:
    """A directory a save wrote (its marker, or DCP's ``.metadata`` for older saves)."""
    return (os.path.exists(os.path.join(path, MARKER))
            or os.path.exists(os.path.join(path, ".metadata")))


def begin(path: str) -> str:
    """A fresh, empty ``<path>.partial`` to write into; returns its path."""
    partial = path + PARTIAL
    if os.path.lexists(partial):
        if os.path.islink(partial) or not os.path.exists(os.path.join(partial, MARKER)):
            raise FileExistsError(f"checkpoint.save: {partial} exists and is not a save in "
                                  f"progress of meshrun's; move it away")
        shutil.rmtree(partial)
    os.makedirs(partial)
    with open(os.path.join(partial, MARKER), "w"):
        pass
    return partial


def commit(partial: str, path: str) -> None:
    """Put the written ``partial`` in place as ``path`` (replacing it), durably."""
    fsync_dir(partial)  # its entries (the files themselves were fsync'd by their writer)
    if not os.path.lexists(path):
        os.rename(partial, path)
    elif _exchange(partial, path):
        shutil.rmtree(partial)  # now the previous checkpoint
    else:
        old = path + OLD
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(partial, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        shutil.rmtree(old)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def sweep(directory: str) -> None:
    """Remove what killed saves left in ``directory``: every marked ``*.partial``; a marked
    ``<name>.old`` whose ``<name>`` is gone (killed between the fallback's two renames) becomes
    ``<name>`` again. Unmarked directories are the user's and stay. Call it holding the
    directory's `DirLock`, so no live save is swept."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        full = os.path.join(directory, name)
        if os.path.islink(full) or not os.path.exists(os.path.join(full, MARKER)):
            continue
        if name.endswith(PARTIAL):
            shutil.rmtree(full, ignore_errors=True)
        elif name.endswith(OLD):
            current = full[:-len(OLD)]
            if os.path.lexists(current):
                shutil.rmtree(full, ignore_errors=True)
            else:
                os.rename(full, current)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` in one step; False where the filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # glibc < 2.28
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)
