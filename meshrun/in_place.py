"""The local channel between an agent and its workers for in-place recovery (docs/design.md §3.8).

A worker that can change world without being restarted (it runs `meshrun.parallel.elastic`)
says so; on a lost node the agent then completes the next round without stopping it and hands
it that round's environment; the worker confirms, or is stopped and started again as usual.

The channel is three small JSON files in the worker's own log directory, named by
``MESHRUN_IN_PLACE_DIR`` (the agent sets it for every worker; scripts that never write
`READY` see no difference):

=============  =======  ==================================================================
file           writer   content
=============  =======  ==================================================================
``ready``      worker   ``{"pid"}``: this process takes new worlds in place (the opt-in)
``offer``      agent    ``{"round", "env", "deadline_s", "issued_ms"}``: the next round's
                        torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and
                        the seconds the worker has to confirm; rewritten for each new round
``confirmed``  worker   ``{"round", "pid"}``: it took round ``round``'s environment
=============  =======  ==================================================================

Why files: every write is a rename of a complete file (never a torn read), they need no
thread, connection or port on either side, survive either side's death, and live in the
rank's private (0700) log directory, so only the job's user can read or forge them. The agent
reads them only at a membership change, and the worker only while it waits for a new world
(plus one ``stat`` of ``offer`` per step), so the cost in steady state is nil.

Stdlib only: imported by the agent (which never imports torch) and by meshrun.parallel.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

#: The worker's channel directory (its log directory), set by the agent for every worker.
CHANNEL_ENV = "MESHRUN_IN_PLACE_DIR"
READY, OFFER, CONFIRMED = "ready", "offer", "confirmed"
#: The variables an offer carries: those of the torchrun contract (docs/design.md §3.1) that a new
#: round changes; the rest of the worker's environment stays what it was.
ROUND_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "MESHRUN_ROUND",
)  # fmt: skip


def channel_env(log_dir: Path) -> dict[str, str]:
    """The variable that gives a worker its channel (its log directory)."""
    return {CHANNEL_ENV: str(log_dir)}


# -- the worker's side -----------------------------------------------------------------------


def channel() -> Path | None:
    """This worker's channel directory, or None (not started by a meshrun agent)."""
    value = os.environ.get(CHANNEL_ENV)
    return Path(value) if value else None


def opt_in() -> bool:
    """Tell the agent this process takes new worlds in place; False without a channel, or
    when the ``ready`` file cannot be written (a full log disk: said on stderr): the process
    then runs on as one that did not opt in, and is restarted at a membership change."""
    where = channel()
    if where is None:
        return False
    try:
        _write(where / READY, {"pid": os.getpid()})
    except OSError as e:
        print(f"meshrun.in_place: cannot opt in to in-place recovery ({e.strerror or e}: "
              f"{e.filename}); this worker will be restarted at a change of world",
              file=sys.stderr, flush=True)
        return False
    return True


def offer_after(round: int) -> dict | None:
    """The agent's offer of a round later than ``round``, or None (none yet, or unreadable)."""
    where = channel()
    offer = _read(where / OFFER) if where is not None else None
    if offer is None or not isinstance(offer.get("round"), int) or offer["round"] <= round:
        return None
    if not isinstance(offer.get("env"), dict):
        return None
    return offer


def confirm(round: int) -> None:
    """Tell the agent this process took round ``round``'s environment.

    Raises:
        OSError: the ``confirmed`` file cannot be written (a full log disk); the agent would
            stop this process at the deadline anyway, and sees its exit at once.
    """
    where = channel()
    if where is not None:
        _write(where / CONFIRMED, {"round": round, "pid": os.getpid()})


# -- the agent's side ------------------------------------------------------------------------


def opted_in(log_dir: Path, pid: int) -> bool:
    """Whether the worker ``pid`` whose channel is ``log_dir`` opted in (a ``ready`` file of
    an earlier process in the same directory does not count)."""
    ready = _read(Path(log_dir) / READY)
    return ready is not None and ready.get("pid") == pid


def make_offer(log_dir: Path, round: int, env: dict[str, str], deadline_s: float) -> None:
    """Hand the worker round ``round``'s variables (`ROUND_ENV` of ``env``); it has
    ``deadline_s`` seconds to confirm.

    Raises:
        OSError: the offer cannot be written (a full log disk, an ``offer`` path that is
            not a file); the worker then cannot take the round in place.
    """
    _write(Path(log_dir) / OFFER, {
        "round": round, "env": {k: env[k] for k in ROUND_ENV if k in env},
        "deadline_s": deadline_s, "issued_ms": int(time.time() * 1000),
    })  # fmt: skip


def confirmed(log_dir: Path, round: int, pid: int) -> bool:
    """Whether the worker ``pid`` confirmed round ``round``."""
    got = _read(Path(log_dir) / CONFIRMED)
    return got is not None and got.get("round") == round and got.get("pid") == pid


# -- helpers -----------------------------------------------------------------------------------


def _write(path: Path, value: dict) -> None:
    """Write ``value`` as JSON by renaming a complete file over ``path`` (atomic); on an
    error (OSError) nothing is left behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


#: The largest channel file read (bytes); the files are a few hundred bytes.
MAX_BYTES = 64 * 1024


def _read(path: Path) -> dict | None:
    """The JSON object in ``path``, or None: missing, unreadable, larger than `MAX_BYTES`,
    not a regular file, not JSON (also nested too deep to parse: RecursionError), or not an object. The other
    side may be anything, so nothing it wrote raises here."""
    try:  # non-blocking: a FIFO planted there must not stop the agent
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            return None
        value = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
