"""Where each rank is: take every running worker's Python stack at once, and name the culprit.

When the agent stops workers after a failure or a hang, the stopped ranks' places are the best
evidence of what went wrong: in the most common distributed failure ("rank 1 timed out in a
collective") the rank that caused it is a *stopped* one, still in its own code (a slow data
reader, an ``if rank == 0:`` branch) while the others wait for it (pytorch#122694). So, before
any stop, the agent takes every running worker's stack, in parallel and bounded in time
(`collect_stacks`), and classifies each (`classify`):

- **waiting**: blocked inside a collective. Seen either in meshrun's progress counters (the
  rank's ``meshrun.parallel`` collectives mark themselves blocked, `blocked` below), or in the
  stack: the main thread has a frame of ``torch.distributed`` in a collective function
  (``all_reduce``, ``barrier``, ``send``, ...; plain torch scripts are classified this way);
- **running**: anywhere else: its own code, a data loader, I/O. A rank that runs while others
  wait is the likely cause (`meshrun.agent.verdicts.attribute`).

When every rank waits, the culprit is the one *behind* (fewer collectives issued, from the
counters), or the ranks inside a different collective from the rest (a rank that called
``broadcast`` where the others called ``all_reduce``); the "wavefront" view of a hang.

Stacks come from Python's ``faulthandler`` where the worker armed it: meshrun's worker site
arms it in every Python worker (`meshrun.worker_signals.arm_stack_dump`; so does
``meshrun.parallel.init()``); the agent sends ``MESHRUN_STACK_SIGNAL`` and reads
``MESHRUN_STACK_FILE``; the dump is written from the signal handler, so it works while the main
thread is blocked in C++, and needs no ptrace rights. Else (a worker that is not Python, or
whose site did not run; a main thread past faulthandler's 100 threads) from ``py-spy dump``,
which needs ptrace rights over the worker: the agent is its parent, and root or
``CAP_SYS_PTRACE`` where Yama's ptrace_scope is above 1; refused in many containers.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from meshrun.agent.spawn import popen
from meshrun.agent.verdicts import Place, Whereabouts

#: The signal faulthandler is armed on in workers: a real-time signal, since SIGUSR1 and
#: SIGUSR2 belong to the user and the scheduler (SLURM's ``--signal=USR1@N``). Its default
#: action would kill a worker that did not arm it: it is only ever sent to one that did (its
#: stack file exists, and its handler is in place).
STACK_SIGNAL = signal.SIGRTMIN + 6
STACK_SIGNAL_NAME = "SIGRTMIN+6"
#: Seconds the agent waits, in all, for the stacks of a whole group.
STACKS_TIMEOUT_S = 2.0

# torch.distributed functions that block until peers take part (the Python-level entry points;
# the object-list variants call these). A rank whose main thread is inside one is waiting.
COLLECTIVES = frozenset(
    """all_reduce all_reduce_coalesced all_gather all_gather_into_tensor all_gather_single
    all_gather_object all_gather_coalesced reduce_scatter reduce_scatter_tensor
    reduce_scatter_single reduce broadcast broadcast_object_list barrier monitored_barrier
    send recv send_object_list recv_object_list batch_isend_irecv scatter gather
    scatter_object_list gather_object all_to_all all_to_all_single init_process_group new_group
    new_subgroups _store_based_barrier wait""".split()
)
_FAULTHANDLER_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
_TRACEBACK_FRAME = re.compile(r'^(?:\[rank\d+\]:)?\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)', re.M)
_PY_SPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]+):(?P<line>\d+)\)\s*$")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}"


@dataclass(frozen=True)
class Target:
    """One running worker to take the stack of.

    Attributes:
        key: the caller's name for it (the local rank).
        pid: its process id (py-spy reads it; the caller makes sure it is still the worker's:
            the agent's workers stay unreaped until the group's stop).
        stack_file: its ``MESHRUN_STACK_FILE``; the worker creates it when it arms faulthandler.
        save_to: where a py-spy dump is written (the rank's log directory).
    """

    key: int
    pid: int
    stack_file: Path
    save_to: Path


@dataclass(frozen=True)
class Stack:
    """A worker's stacks: the dump as text (its main thread first: `main_first`), the main
    thread's frames (innermost first), where the dump is kept, and which tool took it
    ("faulthandler" or "py-spy"); ``text`` is "" with ``problem`` saying why when no stack
    could be taken."""

    text: str
    main: tuple[Frame, ...]
    path: str
    tool: str
    problem: str = ""


def collect_stacks(
    targets: list[Target], timeout: float = STACKS_TIMEOUT_S, abort=None
) -> dict[int, Stack]:
    """Take the stacks of all ``targets`` at once; return ``key -> Stack`` for every target.

    Sends the stack signal to the workers that armed faulthandler and runs one ``py-spy dump``
    per other worker, all in parallel, then waits until every stack is in or ``timeout``
    seconds (in all) have passed, or ``abort()`` (checked every 20 ms) is true (a signal
    came: the agent stops at once); what is not in by then is a `Stack` with ``problem`` set.
    Never raises for a worker that has exited meanwhile.
    """
    deadline = time.monotonic() + timeout
    sent: dict[int, tuple[Target, int]] = {}  # key -> (target, size of its file before)
    spies: dict[int, tuple[Target, subprocess.Popen]] = {}
    stacks: dict[int, Stack] = {}
    py_spy = _py_spy()
    for t in targets:
        size = _size(t.stack_file)
        # Armed once (the file exists) is not armed now: a script (or a library) that set the
        # signal back to SIG_DFL would be killed by it, and one that ignores it never answers.
        if size is not None and _handles(t.pid, STACK_SIGNAL):  # armed: ask faulthandler
            if _send(t, STACK_SIGNAL):
                sent[t.key] = (t, size)
            else:
                stacks[t.key] = _missing(t, "the process had exited")
        elif py_spy is not None:
            try:
                spies[t.key] = (t, _spy(py_spy, t))
            except OSError as e:
                stacks[t.key] = _missing(t, f"py-spy could not start ({e.strerror or e})")
        elif size is not None:
            stacks[t.key] = _missing(
                t, f"no stack: the worker no longer handles {STACK_SIGNAL_NAME} (its handler was"
                   " replaced or reset; not signalled), and py-spy is not installed"
            )  # fmt: skip
        else:
            stacks[t.key] = _missing(
                t, "no stack: the worker did not arm faulthandler (not a Python worker, or "
                   "meshrun's worker site did not run: python -S, a PYTHONPATH the script "
                   "replaced; meshrun.parallel.init() arms it too), and py-spy is not installed"
            )  # fmt: skip
    while (sent or spies) and time.monotonic() < deadline and not (abort and abort()):
        for key, (t, size) in list(sent.items()):
            now = _size(t.stack_file)
            if now is not None and now > size:
                time.sleep(0.05)  # let faulthandler finish writing every thread
                text = _read_from(t.stack_file, size)
                stacks[key] = Stack(
                    main_first(text), main_thread(text), str(t.stack_file), "faulthandler"
                )
                del sent[key]
                if _threads_cut(text) and py_spy is not None:
                    # faulthandler lists 100 threads at most, newest first: the main thread
                    # is past them. py-spy names it; the dump above stays if py-spy fails.
                    with contextlib.suppress(OSError):
                        spies[key] = (t, _spy(py_spy, t))
        for key, (t, proc) in list(spies.items()):
            if proc.poll() is not None:
                text = proc.stdout.read() if proc.stdout else ""
                proc.stdout and proc.stdout.close()
                del spies[key]
                if (proc.returncode != 0 or not text.strip()) and key in stacks:
                    continue  # the faulthandler dump (threads cut) it was to complete
                if proc.returncode != 0 or not text.strip():
                    why = ("the worker was exiting" if _exiting(t.pid)
                           else f"py-spy failed (exit {proc.returncode}: the worker was "
                                f"perhaps exiting, or ptrace is not permitted)")  # fmt: skip
                    stacks[key] = _missing(t, f"no stack: {why}")
                    continue
                path = _save(t.save_to, text)
                stacks[key] = Stack(main_first(text), main_thread(text), path, "py-spy")
        if sent or spies:
            time.sleep(0.02)
    for key, (t, _) in sent.items():
        stacks[key] = _missing(t, f"no stack within {timeout:g} s (faulthandler did not answer)")
    for key, (t, proc) in spies.items():
        proc.kill()
        proc.wait()
        proc.stdout and proc.stdout.close()
        if key not in stacks:  # else: the faulthandler dump (threads cut) stays
            stacks[key] = _missing(t, f"no stack within {timeout:g} s (py-spy did not finish)")
    return stacks


def main_thread(text: str) -> tuple[Frame, ...]:
    """The main thread's frames, innermost first, from a faulthandler or ``py-spy dump`` text.

    faulthandler names no thread: the main thread is the one whose outermost frame is
    ``<module>`` (else the last one listed: the oldest thread). py-spy names it "MainThread".
    Returns () for text in neither format.
    """
    threads: list[tuple[str, list[Frame]]] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith(("Thread ", "Current thread ")):
            threads.append((line, []))
            continue
        m = _FAULTHANDLER_FRAME.match(line) or _PY_SPY_FRAME.match(line)
        if m and threads:
            threads[-1][1].append(Frame(m["file"], int(m["line"]), m["func"].strip()))
    threads = [(head, frames) for head, frames in threads if frames]
    if not threads:
        return ()
    for head, frames in threads:
        if '"MainThread"' in head:
            return tuple(frames)
    for _head, frames in threads:
        if frames[-1].func == "<module>":
            return tuple(frames)
    if _threads_cut(text):  # the main thread (the oldest, listed last) was left out
        return ()
    return tuple(threads[-1][1])


def main_first(text: str) -> str:
    """``text`` (a faulthandler or ``py-spy dump`` text) with the main thread's block moved
    right after the preamble and its header marked ``"MainThread"`` (as py-spy names it), so a
    record cut to a few KB (`WorkerFailure.capped` keeps the head) still has the main thread's
    innermost frames and `main_thread` still finds it. Unchanged when no main thread is found.
    """
    main = main_thread(text)
    if not main:
        return text
    blocks: list[list[str]] = [[]]  # the preamble, then one block per thread
    for line in text.splitlines(keepends=True):
        if line.startswith(("Thread ", "Current thread ")):
            blocks.append([])
        blocks[-1].append(line)
    for i, block in enumerate(blocks[1:], 1):
        frames = [m for raw in block[1:] if (m := _FAULTHANDLER_FRAME.match(raw.rstrip())
                                              or _PY_SPY_FRAME.match(raw.rstrip()))]  # fmt: skip
        if len(frames) == len(main) and (frames[0]["func"].strip(), int(frames[0]["line"])) == (
            main[0].func, main[0].line
        ):
            head = block[0]
            if '"MainThread"' not in head:
                head = head.rstrip("\n").replace(" (most recent", ' "MainThread" (most recent', 1)
                head = head if '"MainThread"' in head else head + ' "MainThread"'
                head += "\n"
            return "".join(blocks[0] + [head] + block[1:] + sum(blocks[1:i] + blocks[i + 1 :], []))
    return text


def _threads_cut(text: str) -> bool:
    """Whether a faulthandler dump left threads out (more than 100: a line ``...``)."""
    return any(line.rstrip() == "..." for line in text.splitlines())


def traceback_frames(text: str) -> tuple[Frame, ...]:
    """The frames of the last Python traceback in ``text`` (an error file's ``py_callstack``
    or a stderr tail: ``File "x.py", line 3, in f``, most recent call last), innermost first."""
    start = text.rfind("Traceback (most recent call last)")
    if start < 0:
        return ()
    frames = [
        Frame(m["file"], int(m["line"]), m["func"])
        for m in _TRACEBACK_FRAME.finditer(text[start:])
    ]
    return tuple(reversed(frames))


def classify(frames: tuple[Frame, ...], blocked: bool | None = None) -> Whereabouts:
    """Where a rank is, from its main thread's frames (innermost first) and, when known,
    whether meshrun's progress counters say it is blocked in a collective right now.

    The collective named is the outermost ``torch.distributed`` collective frame (the one the
    user's code called: ``all_gather_object`` rather than the ``all_gather`` inside it), or,
    for one of meshrun's own collectives, the innermost meshrun.parallel frame.
    """
    at = _user_frame(frames)
    torch_calls = [f for f in frames if _is_torch_distributed(f.file) and f.func in COLLECTIVES]
    if torch_calls:
        return Whereabouts(Place.WAITING, torch_calls[-1].func, at)
    if blocked:
        mine = next((f for f in frames if "meshrun/parallel" in f.file), None)
        return Whereabouts(Place.WAITING, mine.func if mine else "a meshrun collective", at)
    if not frames:
        return Whereabouts(Place.UNKNOWN, "", at)
    return Whereabouts(Place.RUNNING, "", at)


# --- helpers ---------------------------------------------------------------------------------


def _user_frame(frames: tuple[Frame, ...]) -> str:
    if not frames:
        return "unknown (no Python stack)"
    innermost = frames[0]
    user = next((f for f in frames if not _is_library(f.file)), innermost)
    text = str(user)
    if user != innermost:
        text += f" (inside {Path(innermost.file).name}:{innermost.line} in {innermost.func})"
    return text


def _is_library(path: str) -> bool:
    relative = not path.startswith("/")  # py-spy without --full-filenames shortens packages
    return (
        relative
        or "site-packages" in path
        or "dist-packages" in path
        or "/lib/python3" in path
        or "/meshrun/" in path
    )


def _is_torch_distributed(path: str) -> bool:
    return "torch/distributed/" in path


def _py_spy() -> str | None:
    """py-spy on PATH, or next to this interpreter (an unactivated virtualenv)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if os.access(beside, os.X_OK) else None


def _spy(py_spy: str, t: Target) -> subprocess.Popen:
    # the schedulers' warnings blocked for its life: one sent to every process of the job
    # must not end a stack dump (py-spy has no handler for them)
    return popen(
        [py_spy, "dump", "--full-filenames", "--pid", str(t.pid)],
        blocked=(signal.SIGUSR1, signal.SIGUSR2),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _send(t: Target, signum: int) -> bool:
    try:
        os.kill(t.pid, signum)
        return True
    except (ProcessLookupError, OSError):
        return False


def _handles(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` right now (its
    ``SigCgt`` mask in ``/proc/PID/status``). True where that cannot be read but the process
    exists (no /proc: the file's existence is all there is to go by)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return os.path.isdir(f"/proc/{pid}") is False and _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except OSError:
        return True


def _exiting(pid: int) -> bool:
    """Whether ``pid`` is gone, a zombie, or in its exit (``/proc/PID/stat`` state Z, X)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X", "x")
    except (OSError, IndexError):
        return True


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _save(path: Path, text: str) -> str:
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, text.encode("utf-8", "replace"))
        finally:
            os.close(fd)
        return str(path)
    except OSError:
        return ""


def _missing(t: Target, problem: str) -> Stack:
    return Stack("", (), "", "", problem)
