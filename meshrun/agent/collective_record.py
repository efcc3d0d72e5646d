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
every `INTERVAL_S`, and once more at exit. The copy adds what the ring's JSON lacks: each
group's member ranks and backend, and calls' sites (the innermost frame of the user's code,
`call_site`; see `Recorder._call_sites` for where they come from and what they cost). On a
process with an NCCL group it reads NCCL's own ring (``_dump_nccl_trace_json``), where
ProcessGroupNCCL records; else the common one (``_dump_fr_trace_json``), where gloo does.
On gloo (torch 2.13) every entry stays "scheduled" with no completion time, and a group's
last completed number equals its last issued one even while that call is blocked: the record
tells what each rank issued, not what completed (docs/hangs.md). A rank blocked in gloo or NCCL releases the GIL, so its file stays current; a
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
import functools
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
        self._lock = threading.Lock()
        self._destroy_wrapped = False
        self._last = b""
        self._names: dict[str, str] = {}  # group name -> its member ranks ("0-3")
        self._live: list[tuple[weakref.ref, str]] = []  # the groups at the last look
        self._seen = -1  # the newest ring entry (record_id) at the last look
        self._cutoff: dict[str, int] = {}  # group name -> its entries up to here: destroyed
        self._has_nccl: bool | None = None  # this torch has NCCL's ring (asked once)
        self._backends: dict[str, str] = {}  # group name -> its backend ("gloo", "nccl")
        self._sites: dict[int, str] = {}  # record_id -> call site (`_call_sites`)
        self._sites_nccl = False  # which ring the sites were read from
        self._sampled: set[int] = set()  # record_ids whose site the main thread was asked for
        self._ring: dict = {}  # the ring at the last write
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
        with self._lock:  # the recorder's thread, and the script's in destroy_process_group
            return self._write_once()

    def _write_once(self) -> bool:
        try:
            dist = sys.modules.get("torch.distributed")
            if dist is None or not dist.is_available() or not dist.is_initialized():
                return False
            self._watch_destroy(dist)
            nccl = self._reads_nccl(dist)
            dump = self._torch.flight_recorder_dump(nccl=nccl)
            if dump == self._last:
                if not self._stuck_site():
                    self._touch()
                    return False
                ring = self._ring  # unchanged; the newest call got its site: written again
            else:
                ring = json.loads(dump)
            groups = self._group_ranks(dist, ring)
            record = make_record(ring, groups, self._cutoff, self._call_sites(ring, nccl))
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
        self._last, self._ring = dump, ring
        return True

    def _reads_nccl(self, dist) -> bool:
        """Whether to read NCCL's ring rather than the common one: this torch has it, and a
        live group of this process has an NCCL backend (``dist.get_backend``: "nccl", or
        "cpu:gloo,cuda:nccl" for a group of both). ProcessGroupNCCL records only into its own
        ring; gloo only into the common one. A process with NCCL groups and gloo-only groups
        besides is read from NCCL's ring alone: the gloo-only groups' calls are then not in
        its record. Each group's backend is asked once."""
        if self._has_nccl is None:
            self._has_nccl = self._torch.has_nccl_flight_recorder()
        if not self._has_nccl:
            return False
        for pg, name in self._torch.process_group_names(dist):
            if name not in self._backends:
                try:
                    self._backends[name] = str(dist.get_backend(pg))
                except Exception:  # noqa: BLE001 - a group being destroyed
                    continue
        return any("nccl" in b for b in self._backends.values())

    def _call_sites(self, ring: dict, nccl: bool) -> dict[int, str]:
        """``record_id -> call site`` ("train.py:42 in step", `call_site`) of the ring's
        entries, where known.

        torch's pickle dump holds each call's Python frames (the JSON has none), but
        symbolizing them imports ``torch._inductor.codecache`` (torch 2.13: 3.6 s and 71 MB
        in a worker that never compiles), so it is read only where that module is loaded
        already (the script uses ``torch.compile``): then for every call, one read per change
        of the ring at most (a call's site never changes: kept by ``record_id``). Elsewhere
        the site of the newest call is taken from the main thread's stack once the ring has
        not moved for a look while that thread waits in torch.distributed (`_stuck_site`):
        the call a rank hangs in, for ``dist.*`` calls and FSDP2's waits (not DDP's reducer,
        which waits in C++ under ``backward``: no site there). The cache is emptied when the ring read changes (NCCL's and the common
        one number their entries apart)."""
        if nccl != self._sites_nccl:
            self._sites, self._sites_nccl = {}, nccl
        ids = {int(e.get("record_id", -1)) for e in ring.get("entries", [])}
        if ids - self._sites.keys() and _imported("torch._inductor.codecache"):
            try:
                frames = self._torch.flight_recorder_frames(nccl=nccl)
            except Exception:  # noqa: BLE001 - no call sites then; the calls stay
                frames = {}
            for rid in ids - self._sites.keys():
                if rid in frames:
                    self._sites[rid] = call_site(frames[rid])
        self._sites = {rid: at for rid, at in self._sites.items() if rid in ids}
        return self._sites

    def _stuck_site(self) -> bool:
        """The ring has not changed since the last look: if its newest call has no site yet
        and the main thread waits in torch.distributed now (its innermost Python frame is
        there), take the site from the main thread's innermost frame of user code; True when
        one was added. Asked once per call. Only from the recorder's own thread (at exit the
        main thread is elsewhere)."""
        if threading.current_thread() is not self._thread or not self._ring:
            return False
        entries = self._ring.get("entries", [])
        if not entries:
            return False
        newest = max(int(e.get("record_id", -1)) for e in entries)
        if self._sites.get(newest) or newest in self._sampled:
            return False
        self._sampled.add(newest)
        frame = sys._current_frames().get(threading.main_thread().ident)
        frames = []
        while frame is not None:
            frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
            frame = frame.f_back
        # waiting in a collective: the innermost Python frame is torch.distributed's (a dist.*
        # call, FSDP2's wait for its all-gather). Not "anywhere in torch": a rank may sit in
        # its DataLoader or a long forward after the newest call completed, and that site
        # would be another line's. DDP's reducer waits in C++ under backward (no such frame).
        distributed = os.path.join(_library_dirs()[0], "distributed") + os.sep
        if not frames or not os.path.abspath(frames[0][0]).startswith(distributed):
            return False
        at = call_site(frames)
        if at:
            self._sites[newest] = at
        return bool(at)

    def _watch_destroy(self, dist) -> None:
        """Write the record once more just before the script destroys its process groups.

        From ``destroy_process_group`` on, the group's calls end (`_group_ranks`) and a
        worker with no group left writes nothing, so without this its file would stop up to
        `INTERVAL_S` before its last calls: a rank that finished cleanly would look calls
        behind the others (a false desync, a wrong "last call" in a report). So the first
        look that sees ``torch.distributed`` initialized wraps its ``destroy_process_group``
        (the module's name and ``distributed_c10d``'s, which scripts and torch call): the
        wrapper writes the record, then calls torch's function with the same arguments and
        returns what it returns. A name the script bound before that look
        (``from torch.distributed import destroy_process_group``) keeps torch's function."""
        if self._destroy_wrapped:
            return
        self._destroy_wrapped = True
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        original = getattr(dist, "destroy_process_group", None)
        if original is None or getattr(original, "_meshrun_record", False):
            return
        recorder = self

        def destroy_process_group(*args, **kwargs):
            recorder.write_once()
            return original(*args, **kwargs)

        functools.update_wrapper(destroy_process_group, original)
        destroy_process_group._meshrun_record = True
        dist.destroy_process_group = destroy_process_group
        if c10d is not None and getattr(c10d, "destroy_process_group", None) is original:
            c10d.destroy_process_group = destroy_process_group

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
                cutoff: int | dict[str, int] = -1, sites: dict[int, str] | None = None) -> dict:
    """Turn torch's flight-recorder dump (``_dump_fr_trace_json`` or NCCL's
    ``_dump_nccl_trace_json``: the same shape) into the record file's shape:
    ``{"pid", "written_ms", "groups": {name: {"ranks", "issued", "done", "backend"}},
    "calls": [...]}``, each call ``{"group", "seq", "op", "args", "issued_ms", "at"}``
    (``at``: its call site from ``sites``, by ``record_id``; "" when unknown), oldest first,
    p2p and the
    entries up to ``cutoff`` (``record_id``, for every group or per group name: calls of
    groups destroyed since) left out, and so are a group name's calls before its sequence
    numbers start again (a group destroyed and made again under the same name).

    ``issued``/``done`` are the last sequence numbers issued and completed in the group (0:
    none), as torch's ``pg_status`` says; ``backend`` is the prefix of the group's calls'
    ``profiling_name`` ("gloo", "nccl"; "" before its first call). On gloo (torch 2.13)
    ``done`` moves a moment after a call finishes and never while it is blocked
    (docs/hangs.md, "What the record can and cannot tell"). Groups are keyed by their global
    name (torch's ``pg_id`` is a per-process index and
    differs between ranks that belong to different groups); groups the script did not create
    (a desync check's helper groups) are left out.
    """
    id_to_name: dict[str, str] = {}
    backends: dict[str, str] = {}
    sites = sites or {}
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
        profiling = str(e.get("profiling_name", "?"))
        if ":" in profiling:
            backends[name] = profiling.split(":")[0]
        calls.append({
            "group": name,
            "seq": seq,
            "op": profiling.split(":")[-1],
            "args": _describe_args(e.get("input_sizes", []), e.get("input_dtypes", [])),
            "issued_ms": int(e.get("time_created_ns", 0)) // 1_000_000,
            "at": sites.get(int(e.get("record_id", -1)), ""),
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
            "backend": backends.get(name, ""),
        }
    return {"pid": os.getpid(), "written_ms": int(time.time() * 1000), "groups": groups,
            "calls": calls[-FILE_CALLS:]}  # fmt: skip


def call_site(frames) -> str:
    """The innermost frame of the user's code among ``frames`` (``(filename, line, function)``,
    innermost first, as `meshrun._torch.flight_recorder_frames` gives them), as
    "/path/train.py:42 in step"; "" when every frame is torch's, meshrun's or Python's own
    (the standard library, frozen modules). Other installed packages count as the user's (a
    trainer library that issues the call is where the user meets it)."""
    skip = _library_dirs()
    for filename, line, func in frames:
        if not filename or filename.startswith("<"):
            continue
        path = os.path.abspath(filename)
        if any(path.startswith(d) for d in skip[:2]):
            continue
        if path.startswith(skip[2]) and not any(p in path for p in _PACKAGE_DIRS):
            continue
        return f"{filename}:{line} in {func}"
    return ""


_PACKAGE_DIRS = ("/site-packages/", "/dist-packages/")


def _library_dirs() -> tuple[str, str, str]:
    """(torch's package folder, meshrun's, the standard library's), each ending in "/"."""
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(os.path.abspath(getattr(torch, "__file__", None) or "/nonexistent/x"))
    meshrun_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stdlib = os.path.dirname(os.path.abspath(os.__file__))
    return tuple(d.rstrip("/") + "/" for d in (torch_dir, meshrun_dir, stdlib))


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


def _imported(name: str) -> bool:
    """Whether module ``name`` is imported and done executing: a module is in ``sys.modules``
    from the start of its import, and this thread touching torch's lazily imported modules
    while the script's thread is still importing them is how a worker got a "partially
    initialized module" ImportError of ``torch._inductor`` (seen in a test run)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


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
