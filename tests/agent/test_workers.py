"""WorkerGroup and output forwarding, with real processes and real signals."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from support import alive

from meshrun.agent.console import Console, LinePrefixer
from meshrun.agent.logs import StderrTail
from meshrun.agent.workers import WorkerGroup, WorkerSpec, WorkerState

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


class Recorder:
    """A thread-safe binary sink that records when each chunk arrived."""

    def __init__(self) -> None:
        self.chunks: list[tuple[float, bytes]] = []
        self._lock = threading.Lock()

    def write(self, data: bytes) -> int:
        with self._lock:
            self.chunks.append((time.monotonic(), bytes(data)))
        return len(data)

    def flush(self) -> None:
        pass

    @property
    def data(self) -> bytes:
        with self._lock:
            return b"".join(c for _, c in self.chunks)

    def wait_for(self, needle: bytes, timeout: float) -> float | None:
        """Monotonic time at which ``needle`` was complete in the output, or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                acc = b""
                for t, c in self.chunks:
                    acc += c
                    if needle in acc:
                        return t
            time.sleep(0.01)
        return None


def spec(tmp_path: Path, rank: int, code: str, *args: str, **kw) -> WorkerSpec:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    env["TORCHELASTIC_ERROR_FILE"] = str(tmp_path / f"rank{rank}" / "error.json")
    kw.setdefault("console_out", True)
    kw.setdefault("console_err", True)
    kw.setdefault("prefix", f"[h:{rank}]: ")
    return WorkerSpec(
        local_rank=rank,
        global_rank=rank,
        argv=(sys.executable, "-u", "-c", textwrap.dedent(code), *args),
        env=env,
        log_dir=tmp_path / f"rank{rank}",
        **kw,
    )


@pytest.fixture
def groups():
    """Makes WorkerGroups that are always stopped at the end of the test."""
    made: list[WorkerGroup] = []

    def make(*args, **kw) -> WorkerGroup:
        g = WorkerGroup(*args, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.stop(grace=0)


def parse_pids(text: str) -> dict[str, int]:
    """Parse "role pid" lines into {role: pid}, skipping a line still being written."""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def read_pids(path: Path, n: int, timeout: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            pids = parse_pids(path.read_text())
            if len(pids) >= n:
                return pids
        time.sleep(0.02)
    raise AssertionError(f"only {path.read_text() if path.exists() else ''!r} after {timeout}s")


# --- output ----------------------------------------------------------------------------------

PRINTER = """
    import sys
    r = sys.argv[1]
    print(f"out {r} a"); print(f"out {r} b")
    print(f"err {r}", file=sys.stderr)
"""


def test_output_goes_to_files_exactly_and_console_with_prefix(tmp_path, groups):
    out, err = Recorder(), Recorder()
    specs = [spec(tmp_path, r, PRINTER, str(r)) for r in range(2)]
    g = groups(specs, None, console_stdout=out, console_stderr=err)
    g.start()
    result = g.wait(10)
    assert result is not None and result.state is WorkerState.SUCCEEDED
    assert result.failures == []
    g.stop(grace=1)
    for r in range(2):
        assert (
            tmp_path / f"rank{r}" / "stdout.log"
        ).read_bytes() == f"out {r} a\nout {r} b\n".encode()
        assert (tmp_path / f"rank{r}" / "stderr.log").read_bytes() == f"err {r}\n".encode()
    out_lines = out.data.decode().splitlines()
    assert sorted(out_lines) == sorted(f"[h:{r}]: out {r} {x}" for r in range(2) for x in "ab")
    assert sorted(err.data.decode().splitlines()) == ["[h:0]: err 0", "[h:1]: err 1"]


def test_console_flags_and_empty_prefix(tmp_path, groups):
    out, err = Recorder(), Recorder()
    s = spec(tmp_path, 0, PRINTER, "0", console_err=False, prefix="")
    g = groups([s], None, console_stdout=out, console_stderr=err)
    g.start()
    assert g.wait(10).state is WorkerState.SUCCEEDED
    g.stop(grace=1)
    assert out.data == b"out 0 a\nout 0 b\n"
    assert err.data == b""
    assert (tmp_path / "rank0" / "stderr.log").read_bytes() == b"err 0\n"


def test_partial_line_is_forwarded_before_the_worker_exits(tmp_path, groups):
    out = Recorder()
    code = """
        import sys, time
        sys.stdout.write("abc"); sys.stdout.flush()
        time.sleep(60)
    """
    g = groups([spec(tmp_path, 0, code)], None, console_stdout=out)
    g.start()
    assert out.wait_for(b"[h:0]: abc", timeout=10) is not None
    assert (tmp_path / "rank0" / "stdout.log").read_bytes() == b"abc"
    assert g.wait(0) is None  # still running: the partial line did not wait for the exit
    g.stop(grace=2)
    assert out.data == b"[h:0]: abc"


def test_lines_of_ranks_printing_together_are_not_mangled(tmp_path, groups):
    # print() under python -u writes the text and the newline separately.
    code = """
        import sys
        for i in range(300):
            print(f"rank {sys.argv[1]} line {i}")
    """
    out = Recorder()
    g = groups([spec(tmp_path, r, code, str(r)) for r in range(2)], None, console_stdout=out)
    g.start()
    assert g.wait(20).state is WorkerState.SUCCEEDED
    g.stop(grace=1)
    lines = out.data.decode().split("\n")
    assert lines.pop() == ""
    assert sorted(lines) == sorted(
        f"[h:{r}]: rank {r} line {i}" for r in range(2) for i in range(300)
    )


def test_an_unfinished_line_is_broken_when_another_rank_writes(tmp_path, groups):
    slow = """
        import sys, time
        sys.stdout.write("abc"); sys.stdout.flush()
        time.sleep(1.0)
        print("def")
    """
    other = """
        import time
        time.sleep(0.5)
        print("x")
    """
    out = Recorder()
    g = groups([spec(tmp_path, 0, slow), spec(tmp_path, 1, other)], None, console_stdout=out)
    g.start()
    assert g.wait(20).state is WorkerState.SUCCEEDED
    g.stop(grace=1)
    assert out.data == b"[h:0]: abc\n[h:1]: x\n[h:0]: def\n"
    assert (tmp_path / "rank0" / "stdout.log").read_bytes() == b"abcdef\n"


def test_tqdm_carriage_returns_are_prefixed(tmp_path, groups):
    err = Recorder()
    code = """
        from tqdm import tqdm
        for _ in tqdm(range(3), mininterval=0, miniters=1, ncols=40, ascii=True):
            pass
        print("done", flush=True)
    """
    g = groups(
        [spec(tmp_path, 0, code, prefix="[p] ")],
        None,
        console_stderr=err,
        console_stdout=Recorder(),
    )
    g.start()
    assert g.wait(20).state is WorkerState.SUCCEEDED
    g.stop(grace=1)
    raw = (tmp_path / "rank0" / "stderr.log").read_bytes()
    shown = err.data
    assert b"\r" in raw and b"3/3" in raw and b"[p]" not in raw
    assert shown.replace(b"[p] ", b"") == raw
    # Every line start, after "\r" or "\n", carries the prefix (except at the very end).
    for i, byte in enumerate(shown[:-1]):
        if byte in b"\r\n" and not shown[i:].startswith(b"\r\n"):
            assert shown[i + 1 :].startswith(b"[p] "), shown[max(0, i - 20) : i + 20]
    assert shown.startswith(b"[p] ")


def test_duplicate_filters_mirror_torchrun(tmp_path, groups):
    code = """
        import sys
        print("apple 1"); print("banana"); print("orange 2"); print("a * star")
        print("e1", file=sys.stderr); print("e2", file=sys.stderr)
    """
    specs = [spec(tmp_path, 0, code), spec(tmp_path, 1, code, console_out=False)]
    g = groups(
        specs,
        None,
        duplicate_stdout_filters=["apple", "orange", "*"],
        duplicate_stderr_filters=[""],
        filtered_dir=tmp_path / "attempt",
        console_stdout=Recorder(),
        console_stderr=Recorder(),
    )
    g.start()
    assert g.wait(10).state is WorkerState.SUCCEEDED
    g.stop(grace=1)
    # Only console-copied streams are filtered (rank 1's stdout is not), with the prefix;
    # "*" is a literal; "" matches every line.
    filtered_out = (tmp_path / "attempt" / "filtered_stdout.log").read_text().splitlines()
    assert filtered_out == ["[h:0]: apple 1", "[h:0]: orange 2", "[h:0]: a * star"]
    filtered_err = (tmp_path / "attempt" / "filtered_stderr.log").read_text().splitlines()
    assert sorted(filtered_err) == ["[h:0]: e1", "[h:0]: e2", "[h:1]: e1", "[h:1]: e2"]


def test_filters_without_filtered_dir_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="filtered_dir"):
        WorkerGroup([spec(tmp_path, 0, "pass")], None, duplicate_stdout_filters=["x"])


def test_line_prefixer_handles_chunk_boundaries():
    p = LinePrefixer(b"> ")
    got = b"".join(p.feed(c) for c in [b"ab", b"c\nde", b"f\r", b"\ng\r", b"h\r\r", b"\n"])
    assert got == b"> abc\n> def\r\n> g\r> h\r> \r\n"
    assert LinePrefixer(b"").feed(b"a\nb") == b"a\nb"


def test_console_waits_briefly_for_an_unfinished_line_but_not_for_a_progress_bar():
    """The console's writer holds other ranks' output while one rank's line is unfinished, up
    to hold_s, but not after a progress bar's \\r; a put (the worker's side) never waits."""
    out = Recorder()
    con = Console(lambda: out, hold_s=0.3)
    a, b = con.stream("A: "), con.stream("B: ")
    a.put(b"bar 1/3\r")
    b.put(b"log\n")  # a "\r"-ended line is broken at once
    assert con.flush(1.0)
    a.put(b"abc")
    b.put(b"x\n")  # waits for A's line to end
    threading.Timer(0.05, a.put, (b"def\n",)).start()
    time.sleep(0.1)
    assert con.flush(1.0)
    a.put(b"ghi")
    t0 = time.monotonic()
    b.put(b"y\n")  # A never ends its line: broken after hold_s
    assert time.monotonic() - t0 < 0.1
    assert con.flush(2.0) and 0.2 < time.monotonic() - t0 < 1.0
    a.put(b"!\n")
    assert con.flush(1.0)
    assert out.data == b"A: bar 1/3\r\nB: log\nA: abcdef\nB: x\nA: ghi\nB: y\nA: !\n"


def test_stderr_tail_keeps_last_lines_as_shown_on_a_terminal():
    tail = StderrTail(max_lines=3, max_bytes=1000)
    for i in range(10):
        tail.feed(f"line {i}\n".encode())
    tail.feed(b" 10%\r 50%\r100%\n")
    assert tail.text() == "line 8\nline 9\n100%\n"
    big = StderrTail(max_lines=1000, max_bytes=100)
    big.feed(b"x" * 1000 + b"\nend\n")
    assert len(big.text()) <= 101 and big.text().endswith("end\n")


# --- outcomes --------------------------------------------------------------------------------

SLEEPER = "import time; time.sleep(60)"


def test_failure_is_decided_at_once_while_others_run(tmp_path, groups):
    fail = """
        import sys, time
        print("going down", file=sys.stderr, flush=True)
        time.sleep(0.5)
        sys.exit(7)
    """
    g = groups(
        [spec(tmp_path, 0, SLEEPER), spec(tmp_path, 1, fail)], None, console_stderr=Recorder()
    )
    g.start()
    result = g.wait(10)
    returned_ms = time.time() * 1000
    assert result is not None and result.state is WorkerState.FAILED
    [f] = result.failures
    assert (f.global_rank, f.exitcode, f.signal_name, f.exit_status) == (1, 7, None, 7)
    assert f.pid == g.pids[1]
    assert returned_ms - f.timestamp_ms < 200, "wait() must wake on the exit, not on a tick"
    assert "going down" in f.traceback and f.source == "stderr"
    assert alive(g.pids[0]), "the other worker keeps running until stop()"
    t0 = time.monotonic()
    g.stop(grace=5)
    assert time.monotonic() - t0 < 2
    assert not alive(g.pids[0])


def test_sigkill_of_a_worker_is_observed_as_a_signal(tmp_path, groups):
    g = groups([spec(tmp_path, 0, SLEEPER), spec(tmp_path, 1, SLEEPER)], None)
    g.start()
    assert g.wait(0.2) is None
    os.kill(g.pids[0], signal.SIGKILL)
    result = g.wait(10)
    assert result is not None and result.state is WorkerState.FAILED
    [f] = result.failures
    assert (f.global_rank, f.exitcode, f.signal_name, f.exit_status) == (0, -9, "SIGKILL", 137)


def test_signal_is_sent_to_every_live_worker(tmp_path, groups):
    g = groups([spec(tmp_path, r, SLEEPER) for r in range(2)], None)
    g.start()
    g.signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    result = None
    while time.monotonic() < deadline and (result is None or len(result.failures) < 2):
        result = g.wait(0.5)
        time.sleep(0.05)
    assert result is not None and result.state is WorkerState.FAILED
    assert sorted((f.global_rank, f.signal_name) for f in result.failures) == [
        (0, "SIGTERM"),
        (1, "SIGTERM"),
    ]


def test_error_file_is_used_and_a_stale_one_removed(tmp_path, groups):
    s = spec(tmp_path, 0, "import sys; sys.exit(1)")
    Path(s.error_file).parent.mkdir(parents=True)
    Path(s.error_file).write_text('{"message": "stale, from an earlier round"}')
    g = groups([s], None)
    g.start()
    f = g.wait(10).failures[0]
    assert "stale" not in f.message
    code = """
        import json, os, sys
        tb = "Traceback (most recent call last):\\nRuntimeError: bad"
        data = {"message": {"message": "RuntimeError: bad",
                            "extraInfo": {"py_callstack": tb, "timestamp": "1"}}}
        json.dump(data, open(os.environ["TORCHELASTIC_ERROR_FILE"], "w"))
        sys.exit(3)
    """
    g2 = groups([spec(tmp_path / "b", 0, code)], None)
    g2.start()
    f2 = g2.wait(10).failures[0]
    assert (f2.message, f2.source, f2.exitcode) == ("RuntimeError: bad", "error.json", 3)
    assert f2.traceback.endswith("RuntimeError: bad")


def test_spawn_error_raises_and_cleans_up(tmp_path):
    good = spec(tmp_path, 0, SLEEPER)
    bad = WorkerSpec(1, 1, ("/nonexistent/python",), {}, tmp_path / "rank1", False, False)
    g = WorkerGroup([good, bad], None)
    with pytest.raises(FileNotFoundError):
        g.start()
    assert not alive(g.pids[0])


def test_an_unstarted_reaper_is_an_error_and_leaks_nothing(tmp_path):
    from meshrun.agent.reaper import Reaper

    pidfile = tmp_path / "pid"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    g = WorkerGroup([spec(tmp_path, 0, code)], Reaper())
    with pytest.raises(RuntimeError, match="start"):
        g.start()
    assert g.pids == []
    if pidfile.exists():  # the worker got as far as running: it must be dead now
        assert not alive(int(pidfile.read_text()))


# --- stop ------------------------------------------------------------------------------------

TERM_HANDLER = """
    import signal, sys, time
    def on_term(*_):
        print("bye", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    time.sleep(60)
"""

IGNORE_TERM = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(60)
"""


def test_stop_a_worker_that_handles_sigterm_is_quick(tmp_path, groups):
    out = Recorder()
    g = groups([spec(tmp_path, 0, TERM_HANDLER)], None, console_stdout=out)
    g.start()
    # the whole line: print() under -u writes "ready" and "\n" apart; a SIGTERM between the two
    # would leave "readybye\n" in the log (the worker's doing, not the forwarder's)
    assert out.wait_for(b"ready\n", 10) is not None
    t0 = time.monotonic()
    g.stop(grace=10)
    assert time.monotonic() - t0 < 1.0
    assert (tmp_path / "rank0" / "stdout.log").read_bytes() == b"ready\nbye\n"
    assert g.wait(0).state is WorkerState.SUCCEEDED
    g.stop(grace=10)  # idempotent


def test_stop_of_a_stopped_worker_does_not_wait_out_the_grace(tmp_path, groups):
    """A SIGSTOPped worker (a hang, ^Z, a debugger) gets its SIGTERM only once it runs: the
    stop continues it, so it answers at once instead of being killed after the grace (30 s
    by default: long enough for the other nodes to finish the job without this one)."""
    out = Recorder()
    g = groups([spec(tmp_path, 0, TERM_HANDLER)], None, console_stdout=out)
    g.start()
    assert out.wait_for(b"ready\n", 10) is not None
    [(_, pid)] = g.running()
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    g.stop(grace=10)
    assert time.monotonic() - t0 < 3.0  # a liveness bound: without SIGCONT, the 10 s grace
    assert g.wait(0).state is WorkerState.SUCCEEDED  # its handler ran: no SIGKILL


def test_stop_sigkills_a_worker_that_ignores_sigterm_after_the_grace(tmp_path, groups):
    out = Recorder()
    g = groups(
        [spec(tmp_path, 0, IGNORE_TERM), spec(tmp_path, 1, TERM_HANDLER)], None, console_stdout=out
    )
    g.start()
    assert out.wait_for(b"[h:0]: ready", 10) and out.wait_for(b"[h:1]: ready", 10)
    t0 = time.monotonic()
    g.stop(grace=1.0)
    took = time.monotonic() - t0
    assert 1.0 <= took < 4.0  # the grace, then SIGKILL; the upper bound is a liveness limit
    result = g.wait(0)
    assert [(f.global_rank, f.signal_name) for f in result.failures] == [(0, "SIGKILL")]


@pytest.mark.parametrize("ignore_term", [False, True], ids=["term", "ignore-term"])
def test_stop_kills_the_whole_tree_including_setsid_grandchildren(tmp_path, groups, ignore_term):
    pidfile = tmp_path / "pids"
    argv = [str(pidfile)] + (["--ignore-term"] if ignore_term else [])
    s = WorkerSpec(
        0,
        0,
        (sys.executable, "-u", str(SCRIPTS / "tree.py"), *argv),
        {**os.environ, "PYTHONPATH": str(REPO)},
        tmp_path / "rank0",
        False,
        False,
    )
    g = groups([s], None)
    g.start()
    pids = read_pids(pidfile, 3)
    assert set(pids) == {"worker", "child", "grandchild"}
    assert os.getsid(pids["grandchild"]) == pids["grandchild"] != os.getpgid(pids["worker"])
    t0 = time.monotonic()
    g.stop(grace=0.5)
    assert time.monotonic() - t0 < 3.0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.02)
    assert not [role for role, p in pids.items() if alive(p)]


def test_stop_is_bounded_when_an_escaped_process_holds_the_pipe(tmp_path, groups):
    # The worker double-forks a daemon that keeps stdout open, then exits: stop() cannot find
    # the daemon (re-parented, own session), so it must stop waiting for EOF after ~1 s.
    pidfile = tmp_path / "daemon"
    code = f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                open({str(pidfile)!r}, "w").write(str(os.getpid()))
                print("daemon up", flush=True)
                time.sleep(60)
            os._exit(0)
        while not os.path.exists({str(pidfile)!r}):
            time.sleep(0.01)
        time.sleep(0.2)
    """
    g = groups([spec(tmp_path, 0, code)], None, console_stdout=Recorder())
    g.start()
    try:
        assert g.wait(10).state is WorkerState.SUCCEEDED
        t0 = time.monotonic()
        g.stop(grace=0.5)
        assert time.monotonic() - t0 < 3.0
        assert b"daemon up" in (tmp_path / "rank0" / "stdout.log").read_bytes()
    finally:
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def test_duplicate_filter_keeps_a_line_split_across_chunks(tmp_path):
    """A chunk that ends mid-line (a pipe read cuts anywhere): the filter keeps the partial
    line for the next chunk (it raised BufferError, resizing the buffer it was iterating)."""
    from meshrun.agent.logs import FilteredSink

    sink = FilteredSink(tmp_path / "filtered.log", ["RANK"], lambda message: None)
    feed = sink.line_filter(b"[h:0]: ")
    feed(b"RANK=0\nRANK=1 part")
    feed(b"ial\nother\n")
    feed(b"", True)
    sink.close()
    assert (tmp_path / "filtered.log").read_bytes() == b"[h:0]: RANK=0\n[h:0]: RANK=1 partial\n"
