"""The collective record, the worker's side: a thread that copies torch's flight recorder to a file.

The classic distributed mistakes (a rank that skips a collective under ``if rank == 0:``, one
that calls ``broadcast`` where the others call ``all_reduce``, a data-dependent branch) leave
every rank waiting until a timeout, and each rank's stack alone shows only "waiting". What
names the mistake is the *sequence* of collectives: every process group numbers its
collectives, and all members must issue the same op with the same shapes as call number n.

**What is recorded.** torch's flight recorder keeps, per process, a ring of the last
``TORCH_FR_BUFFER_SIZE`` collectives it issued on any backend (gloo included, since torch 2.6):
process group, sequence number in that group, op, input shapes and dtypes, time issued; and,
per group, the last number issued ("enqueued") and the last one completed. The agent turns it
on through the worker's environment (`meshrun.agent.collectives.record_env`), so a plain torch script records with no
change. torch keeps the ring in the worker's memory, where a blocked or dead rank cannot be
asked for it, so a thread in the worker (`Recorder`, started by meshrun's ``sitecustomize``)
writes a compact copy to a file in the rank's log directory whenever it changed, checking
every `INTERVAL_S`, and once more at exit. The copy adds what the ring lacks: each group's
member ranks. A rank blocked in gloo or NCCL releases the GIL, so its file stays current; a
rank killed with SIGKILL leaves the copy of at most `INTERVAL_S` before. Point-to-point calls
(``send``/``recv``) are not in the ring for gloo and are left out for every backend.

**Where it runs.** In every worker, loaded by path from meshrun's ``sitecustomize``
(``worker_site/sitecustomize.py``) before the script imports torch: a worker's interpreter
need not have meshrun installed, so this module imports only the standard library, and
reaches torch's private names through ``meshrun/_torch.py``, loaded by path beside it
(`_door`). The agent's side, which reads the files, is `meshrun.agent.collectives`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import sys
import threading
import time
import weakref

#: Set in a worker's environment to the path its record goes to; "0" in the agent's own
#: environment turns the record off.
RECORD_ENV = "MESHRUN_COLLECTIVE_RECORD"
RECORD_FILE = "collectives.json"
#: Entries of torch's flight recorder ring, unless the user set ``TORCH_FR_BUFFER_SIZE``.
RING_ENTRIES = 64
#: Seconds between the recorder thread's looks at the ring.
INTERVAL_S = 0.5
#: Calls kept in the file.
FILE_CALLS = 32


class Recorder:
    """The thread in a worker that keeps its record file current (see the module docstring).

    It does nothing until the script has initialized ``torch.distributed`` (it only looks in
    ``sys.modules``: torch is never imported for it), then writes the file whenever the ring
    changed. `stop` (registered with ``atexit``) ends the thread before the interpreter
    finalizes, so it is never inside torch when the interpreter goes away, and writes the
    last state.

    Args:
        path: the record file (written by rename, so a reader never sees half of it).
        interval: seconds between looks.
    """

    def __init__(self, path: str, interval: float = INTERVAL_S) -> None:
        self.path = path
        self.interval = interval
        self._done = threading.Event()
        self._last = b""
        self._names: dict[str, str] = {}  # group name -> its member ranks ("0-3")
        self._live: list[tuple[weakref.ref, str]] = []  # the groups at the last look
        self._seen = -1  # the newest ring entry (record_id) at the last look
        self._cutoff: dict[str, int] = {}  # group name -> its entries up to here: destroyed
        self._torch = _door()  # raises when meshrun/_torch.py cannot be loaded
        self._start_thread = _signals().start_thread  # and meshrun/worker_signals.py
        self._thread = threading.Thread(target=self._run, name="meshrun-collective-record",
                                        daemon=True)  # fmt: skip

    def start(self) -> Recorder:
        # every signal blocked in the thread, so a signal the script blocked (to sigwait for
        # it) waits for the script instead of killing the worker here (exit 138 for SIGUSR1)
        self._start_thread(self._thread)
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """End the thread and write the last state (called at exit)."""
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * self.interval + 1)
        self.write_once()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self.write_once()

    def write_once(self) -> bool:
        """Write the record when the ring changed; True when written. Never raises: a record
        that cannot be made or written is skipped (the worker must not notice)."""
        try:
            dist = sys.modules.get("torch.distributed")
            if dist is None or not dist.is_available() or not dist.is_initialized():
                return False
            dump = self._torch.flight_recorder_dump()
            if dump == self._last:
                self._touch()
                return False
            ring = json.loads(dump)
            record = make_record(ring, self._group_ranks(dist, ring), self._cutoff)
        except Exception:  # noqa: BLE001 - no record then (the report goes without its line)
            return False
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(record, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except OSError:  # a full log disk: the worker must not notice; tried again later
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        self._last = dump
        return True

    def _touch(self) -> None:
        """Mark the unchanged record as current (its mtime): the agent waits for that before it
        reads a rank it is about to stop (`wait_current`)."""
        with contextlib.suppress(OSError):
            os.utime(self.path)

    def _group_ranks(self, dist, ring: dict) -> dict[str, str]:
        """Each live process group's name (as torch's ring names it) -> its member ranks.

        A group destroyed since the last look (``destroy_process_group()``, then perhaps a new
        ``init_process_group``, whose default group is named "0" again) ends its calls: the
        ring outlives the groups, so that group's entries up to the last look are left out
        from then on (``self._cutoff``, per group name: the other groups keep theirs), and
        its member list is found again; calls it made after the last look are told by
        `make_record` (a new group's sequence numbers start again). The groups are
        remembered by weak reference: a new group may take a destroyed one's address, so an
        ``id()`` would call it the same group (a flake in CI: the old calls stayed)."""
        groups = self._torch.process_group_names(dist)
        now = {id(pg) for pg, _ in groups}  # ids of live objects: unique while they live
        for ref, name in self._live:
            if (pg := ref()) is None or id(pg) not in now:
                self._cutoff[name] = self._seen
                self._names.pop(name, None)
        self._live = [(weakref.ref(pg), name) for pg, name in groups]
        self._seen = max((int(e.get("record_id", -1)) for e in ring.get("entries", [])),
                         default=self._seen)  # fmt: skip
        for pg, name in groups:
            if name not in self._names:
                try:
                    self._names[name] = ranges(dist.get_process_group_ranks(pg))
                except Exception:  # noqa: BLE001 - a group being destroyed
                    continue
        return self._names


def start_recorder_from_env() -> Recorder | None:
    """In a worker: start the `Recorder` when the agent asked for one (`RECORD_ENV`), and take
    the variable out of the environment, so the processes the script starts do not write the
    same file."""
    path = os.environ.pop(RECORD_ENV, "")
    if not path or path == "0":
        return None
    try:
        recorder = Recorder(path)
    except Exception as e:  # noqa: BLE001 - the worker runs on, unrecorded
        print(f"meshrun: the collective record is off ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return recorder.start()


def make_record(dump: dict, group_ranks: dict[str, str],
                cutoff: int | dict[str, int] = -1) -> dict:
    """Turn torch's flight-recorder dump (``_dump_fr_trace_json``) into the record file's shape:
    ``{"pid", "written_ms", "groups": {name: {"ranks", "issued", "done"}}, "calls": [...]}``,
    each call ``{"group", "seq", "op", "args", "issued_ms"}``, oldest first, p2p and the
    entries up to ``cutoff`` (``record_id``, for every group or per group name: calls of
    groups destroyed since) left out, and so are a group name's calls before its sequence
    numbers start again (a group destroyed and made again under the same name).

    ``issued``/``done`` are the last sequence numbers issued and completed in the group (0:
    none). Groups are keyed by their global name (torch's ``pg_id`` is a per-process index and
    differs between ranks that belong to different groups); groups the script did not create
    (a desync check's helper groups) are left out.
    """
    id_to_name: dict[str, str] = {}
    calls = []
    last_seq: dict[str, int] = {}  # group name -> the sequence number of its latest call
    for e in sorted(dump.get("entries", []), key=lambda e: int(e.get("record_id", 0))):
        name = str(e.get("process_group", ["?"])[0])
        if name == "" and str(e.get("pg_id")) == "0":
            name = "0"  # a desync check's wrapper leaves names empty; 0 is the default group
        limit = cutoff.get(name, -1) if isinstance(cutoff, dict) else cutoff
        if int(e.get("record_id", 0)) <= limit:
            continue
        id_to_name[str(e.get("pg_id"))] = name
        if e.get("is_p2p") or name not in group_ranks:
            continue
        seq = int(e.get("collective_seq_id", 0))
        if 0 < seq <= last_seq.get(name, 0):  # numbered from 1 again: a new group
            calls = [c for c in calls if c["group"] != name]
        last_seq[name] = seq
        calls.append({
            "group": name,
            "seq": seq,
            "op": str(e.get("profiling_name", "?")).split(":")[-1],
            "args": _describe_args(e.get("input_sizes", []), e.get("input_dtypes", [])),
            "issued_ms": int(e.get("time_created_ns", 0)) // 1_000_000,
        })  # fmt: skip
    groups = {}
    for pg_id, status in dump.get("pg_status", {}).items():
        name = id_to_name.get(str(pg_id))
        if name is None or name not in group_ranks:
            continue
        groups[name] = {
            "ranks": group_ranks[name],
            "issued": max(0, int(status.get("last_enqueued_collective", 0))),
            "done": max(0, int(status.get("last_completed_collective", 0))),
        }
    return {"pid": os.getpid(), "written_ms": int(time.time() * 1000), "groups": groups,
            "calls": calls[-FILE_CALLS:]}  # fmt: skip


def _describe_args(sizes: list, dtypes: list) -> str:
    """``[[4, 3]], ["Float"]`` -> "float[4, 3]"; several tensors joined with ", "."""
    parts = [f"{str(d).lower()}{list(s)}" for s, d in zip(sizes, dtypes, strict=False)]
    text = ", ".join(parts)
    return text if len(text) <= 80 else text[:77] + "..."


def ranges(ranks, sep: str = ",") -> str:
    """``[0, 1, 2, 5]`` -> "0-2,5" (``sep`` between the runs: ", " in what people read): the
    one way meshrun writes a list of ranks, compact for a large world; "" for none."""
    out: list[list[int]] = []
    for r in sorted(int(r) for r in ranks):
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return sep.join(f"{a}-{b}" if a != b else str(a) for a, b in out)


def parse_ranges(text: str) -> list[int]:
    """Inverse of `ranges`: "0-2,5" -> ``[0, 1, 2, 5]``; "" -> ``[]``.

    Raises:
        ValueError: not of that form.
    """
    ranks: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


def _door():
    """``meshrun/_torch.py``: the package's module where meshrun is imported as a package,
    else loaded by path (as ``_meshrun_torch``) from beside this file's folder."""
    return _sibling("_torch")


def _signals():
    """``meshrun/worker_signals.py`` (`start_thread`), found the same way as `_door`."""
    return _sibling("worker_signals")


def _sibling(name: str):
    """The top-level module ``meshrun.<name>`` (standard library only at import): imported
    where meshrun is imported as a package, else loaded by path from beside this file's
    folder, once per process, as ``_meshrun_torch`` / ``_meshrun_worker_signals`` (the name
    the worker site gives the same file, so the site's copy is the one used)."""
    if __package__ == "meshrun.agent":
        return importlib.import_module(f"meshrun.{name}")
    alias = f"_meshrun_{name.lstrip('_')}"
    if alias in sys.modules:
        return sys.modules[alias]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f"{name}.py")
    spec = importlib.util.spec_from_file_location(alias, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[alias] = module
    return module
