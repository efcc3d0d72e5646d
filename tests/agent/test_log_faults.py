"""Output under faults (docs/design.md §3.6, issue 16): the log files are complete, the console is
best effort, and neither a full log disk nor a console that cannot keep up (or is closed)
reaches a worker or the agent.

Real parts only: a full disk is a 256 KiB tmpfs mounted for the test, a stalled console is a
pipe nobody reads or a consumer stopped with SIGSTOP, ``| head -1`` is a shell pipeline.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshrun.agent.console import Console
from meshrun.agent.logs import LogFile

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"
FLOOD = str(SCRIPTS / "flood.py")
HOST = socket.gethostname()
sys.path.insert(0, str(SCRIPTS))
from flood import expected_lines  # noqa: E402


def expected(rank: int, lines: int, width: int) -> bytes:
    """The exact stdout of flood.py for ``rank`` (its log file must hold these bytes)."""
    return "".join(expected_lines(rank, lines, width)).encode() + f"finished rank {rank}\n".encode()


def log_files(logs: Path, rank: int, stream: str = "stdout") -> Path:
    [path] = logs.glob(f"*/*/attempt_0/{rank}/{stream}.log")
    return path


def _clean_env() -> dict[str, str]:
    """This environment without the launcher's variables (as the ``launch`` fixture does)."""
    drop = ("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_", "MESHRUN_", "MASTER_", "RANK", "WORLD_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 256 KiB tmpfs mounted on a fresh directory: a log disk that fills up for real."""
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    try:
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount(8) here: cannot make a small tmpfs for a full log disk")
    if res.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs (a full log disk needs root): {res.stderr.strip()}"
        )
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# --- a full log disk -------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_full_log_disk_is_said_once_and_training_goes_on(launch, small_disk):
    """Two ranks print 800 KB each into log files on a 256 KiB disk. The write error is said
    once per file on the agent's stderr, that file is dropped, the pipe keeps being drained
    (the worker never sees a broken pipe), the console copy goes on to the last line, and the
    job exits 0. What reached the file is the exact start of the stream."""
    lines, width = 4000, 200
    res = launch.run(
        [
            "--nproc-per-node",
            "2",
            "-t",
            "3",
            "--log-dir",
            str(small_disk),
            FLOOD,
            str(lines),
            str(width),
        ],
        timeout=60,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if "No space left on device" in line]
    assert said, res.stderr[-3000:]
    paths = [re.search(r"(/\S+\.log)", line).group(1) for line in said]
    assert len(paths) == len(set(paths)), f"a file's error was said more than once: {said}"
    for rank in (0, 1):
        got = log_files(small_disk, rank).read_bytes()
        assert expected(rank, lines, width).startswith(got) and len(got) <= 256 * 1024
        # The console went on past the end of the file (it may drop lines of a burst that
        # it cannot keep up with; then it says so, and the count covers the rest).
        prefix = f"[{HOST}:{rank}]: "
        mine = [ln[len(prefix) :] for ln in res.stdout.splitlines() if ln.startswith(prefix)]
        past_file = expected_lines(rank, lines, width)[got.count(b"\n") + 1].rstrip("\n")
        assert past_file in mine
        notes = [NOTE.match(ln) for ln in mine if ln.startswith("meshrun:")]
        assert mine[-1] == f"finished rank {rank}" or (notes and all(notes)), mine[-3:]


# --- a console that cannot keep up -----------------------------------------------------------


@pytest.mark.timeout(90)
def test_console_nobody_reads_never_blocks_the_workers(launch, tmp_path):
    """meshrun's stdout and stderr are a pipe that nobody reads (it fills at 64 KiB). Two ranks
    print 1.6 MB each: they are never blocked, the job ends with exit 0, and every log file is
    complete, byte for byte."""
    logs = tmp_path / "logs"
    lines, width = 8000, 200
    r, w = os.pipe()
    try:
        proc = launch.start(
            [
                "--nproc-per-node",
                "2",
                "-t",
                "3",
                "--log-dir",
                str(logs),
                FLOOD,
                str(lines),
                str(width),
            ],
            stdout=w,
            stderr=w,
        )
        os.close(w)
        w = -1
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("meshrun blocked on a console nobody reads") from None
        assert code == 0
        for rank in (0, 1):
            assert log_files(logs, rank).read_bytes() == expected(rank, lines, width)
            assert log_files(logs, rank, "stderr").read_bytes() == b"flood-done\n"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


NOTE = re.compile(
    r"meshrun: console too slow, (\d+) lines? \((\d+) bytes\) of rank (\d)'s stdout not "
    r"shown; (\S+) has all of it$"
)


@pytest.mark.timeout(120)
def test_stalled_console_drops_lines_with_one_note_and_a_count(launch, tmp_path):
    """The console's consumer is stopped (SIGSTOP) while two ranks print 1.6 MB each; the workers
    finish their output all the same. Once the consumer resumes, the console shows whole lines
    only, each with its rank's prefix (never two ranks' lines glued), one note per rank and
    drop episode with the count, and lines shown + lines counted as dropped = lines printed."""
    logs, go, shown = tmp_path / "logs", tmp_path / "go", tmp_path / "console.txt"
    lines, width = 8000, 200
    with open(shown, "wb") as sink:
        consumer = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=sink)
    try:
        os.kill(consumer.pid, signal.SIGSTOP)
        proc = launch.start(
            [
                "--nproc-per-node",
                "2",
                "-t",
                "3",
                "--log-dir",
                str(logs),
                FLOOD,
                str(lines),
                str(width),
                str(go),
            ],
            stdout=consumer.stdin,
            stderr=consumer.stdin,
        )
        consumer.stdin.close()

        def flooded() -> bool:
            errs = list(logs.glob("*/*/attempt_0/*/stderr.log"))
            return len(errs) == 2 and all(p.read_bytes() == b"flood-done\n" for p in errs)

        launch.wait_for(
            flooded, 60, what="both ranks to finish printing while the console is stopped"
        )
        os.kill(consumer.pid, signal.SIGCONT)
        # Each rank's note comes as soon as the console has caught up, without new output.
        launch.wait_for(
            lambda: shown.read_bytes().count(b"meshrun: console too slow") >= 2,
            30,
            what="a note from each rank once the console caught up",
        )
        go.touch()
        assert proc.wait(timeout=60) == 0
        consumer.wait(timeout=30)
    finally:
        if consumer.poll() is None:
            consumer.send_signal(signal.SIGCONT)
            consumer.kill()
            consumer.wait()

    text = shown.read_text()
    for rank in (0, 1):
        assert log_files(logs, rank).read_bytes() == expected(rank, lines, width)
        prefix = f"[{HOST}:{rank}]: "
        mine = [ln[len(prefix) :] for ln in text.splitlines() if ln.startswith(prefix)]
        full = {ln.rstrip("\n") for ln in expected_lines(rank, lines, width)}
        notes = [NOTE.match(ln) for ln in mine if ln.startswith("meshrun:")]
        assert notes and all(notes), mine[-5:]
        assert {int(m.group(3)) for m in notes} == {rank}
        for i, ln in enumerate(mine):  # a partial line only where a drop began
            if not (ln in full or ln.startswith(("meshrun:", "finished", "flood"))):
                assert any(f.startswith(ln) for f in full), ln
                assert any(NOTE.match(later) for later in mine[i + 1 :]), mine[i : i + 3]
        dropped = sum(int(m.group(1)) for m in notes)
        full_shown = sum(1 for ln in mine if ln in full)
        assert full_shown + dropped == lines, (full_shown, dropped, [m.group(0) for m in notes])
        assert mine[-1] == f"finished rank {rank}"
    others = [ln for ln in text.splitlines() if not ln.startswith(f"[{HOST}:")]
    assert all(ln.startswith("meshrun: ") for ln in others), others[:5]  # the agent's own lines


# --- a closed console ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_closed_console_before_start_the_job_runs_to_its_own_exit_code(launch, tmp_path):
    """meshrun's stdout and stderr are a pipe whose reader is already gone (EPIPE on the first
    write, before any worker starts): the agent survives, the job runs, the log files are
    complete, and the exit code is the job's (7 from the worker, not a crash's 1)."""
    logs = tmp_path / "logs"
    r, w = os.pipe()
    os.close(r)
    try:
        proc = launch.start(
            ["--nproc-per-node", "2", "--log-dir", str(logs), FLOOD, "300", "80"],
            env={"FLOOD_EXIT": "7"},
            stdout=w,
            stderr=w,
        )
    finally:
        os.close(w)
    assert proc.wait(timeout=45) == 7
    for rank in (0, 1):
        assert log_files(logs, rank).read_bytes() == expected(rank, 300, 80)


@pytest.mark.timeout(60)
def test_pipe_into_head_1_the_job_runs_to_its_own_exit_code(tmp_path):
    """``meshrun ... 2>&1 | head -1`` in a real shell: head leaves after the first line, the
    agent survives the closed console (its failure report included), the log files are
    complete and ``${PIPESTATUS[0]}`` is the job's exit code."""
    logs = tmp_path / "logs"
    cmd = (
        f"{sys.executable} -m meshrun --nproc-per-node 2 --log-dir {logs} {FLOOD} 300 80 "
        '2>&1 | head -1; echo "rc=${PIPESTATUS[0]}"'
    )
    res = subprocess.run(
        ["bash", "-c", cmd],
        env={**_clean_env(), "PYTHONPATH": str(REPO), "FLOOD_EXIT": "7"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=45,
    )
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and lines[1] == "rc=7", (res.stdout, res.stderr)
    for rank in (0, 1):
        assert log_files(logs, rank).read_bytes() == expected(rank, 300, 80)


# --- log rotation ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_log_max_bytes_rotates_each_rank_s_files(launch, tmp_path):
    """--log-max-bytes 20000 and 100 KB of output: stdout.log and three older files
    (stdout.log.1 the newest of them), each at most 20000 bytes and cut at a line end; no
    fourth; together they are the exact end of the stream. stderr.log, small, is one file."""
    logs = tmp_path / "logs"
    lines, width = 1000, 100
    res = launch.run(
        [
            "--log_max_bytes",
            "20000",
            "--log-dir",
            str(logs),
            "-r",
            "3",
            FLOOD,
            str(lines),
            str(width),
        ]
    )
    assert res.returncode == 0, res.stderr
    current = log_files(logs, 0)
    older = [current.with_name(f"stdout.log.{i}") for i in (3, 2, 1)]
    assert all(p.exists() for p in older) and not current.with_name("stdout.log.4").exists()
    chain = b""
    for p in [*older, current]:
        data = p.read_bytes()
        assert 0 < len(data) <= 20000 and data.endswith(b"\n"), (p, len(data))
        chain += data
    assert expected(0, lines, width).endswith(chain) and len(chain) > 3 * 19900
    assert log_files(logs, 0, "stderr").read_bytes() == b"flood-done\n"
    assert not current.with_name("stderr.log.1").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, env",
    [
        (["--log-max-bytes", "0"], {}),
        (["--log-max-bytes", "ten"], {}),
        (["--log-max-bytes", "1.5"], {}),
        (["--log-max-bytes", "-4"], {}),
        (["--log-max-bytes", "1"], {}),
        (["--log-max-bytes", "99999999999999G"], {}),
        ([], {"PET_LOG_MAX_BYTES": "lots"}),
    ],
    ids=["zero", "word", "fraction", "negative", "one byte", "huge", "env"],
)
def test_bad_log_max_bytes_exits_2_with_one_line(launch, args, env):
    res = launch.run([*args, FLOOD, "1", "10"], env=env, timeout=30)
    assert res.returncode == 2, res.stderr
    [line] = res.stderr.splitlines()
    assert line.startswith("meshrun: error: ") and "give a number of bytes" in line, line
    assert ("--log-max-bytes" if args else "PET_LOG_MAX_BYTES") in line, line


@pytest.mark.timeout(30)
def test_log_max_bytes_spellings_env_and_config_file(tmp_path, monkeypatch):
    from meshrun.launcher import build_config

    monkeypatch.chdir(tmp_path)
    Path("t.py").write_text("")
    assert build_config(["t.py"], {}).log_max_bytes is None
    assert build_config(["--log-max-bytes", "4096", "t.py"], {}).log_max_bytes == 4096
    assert build_config(["--log_max_bytes", "64K", "t.py"], {}).log_max_bytes == 64 * 1024
    assert build_config(["t.py"], {"PET_LOG_MAX_BYTES": "2M"}).log_max_bytes == 2 * 1024**2
    Path("job.toml").write_text("log_max_bytes = 8192\n")
    assert build_config(["--config", "job.toml", "t.py"], {}).log_max_bytes == 8192


# --- the pieces, in process --------------------------------------------------------------------


class _StoppedReader:
    """A console whose writes block until ``resume`` is set (a reader that stopped reading)."""

    def __init__(self) -> None:
        self.resume = threading.Event()
        self.data = bytearray()

    def write(self, data: bytes) -> int:
        self.resume.wait()
        self.data += data
        return len(data)

    def flush(self) -> None:
        pass


@pytest.mark.timeout(30)
def test_console_queue_drops_whole_lines_with_one_note_and_never_blocks_a_put():
    reader = _StoppedReader()
    con = Console(lambda: reader, max_queued_bytes=1000)
    s = con.stream("[0]: ", "rank 0's stdout", "/logs/0/stdout.log")
    lines = [f"line {i:04d}\n".encode() for i in range(1000)]  # 10 bytes each
    t0 = time.monotonic()
    for line in lines:
        s.put(line)
    assert time.monotonic() - t0 < 1.0, "a put waited for the console"
    reader.resume.set()
    assert con.flush(5.0)
    s.put(b"after\n")
    assert s.close()
    shown = reader.data.decode().splitlines()
    assert all(ln.startswith("[0]: ") for ln in shown)
    body = [ln[5:] for ln in shown]
    [note] = [ln for ln in body if ln.startswith("meshrun:")]
    n = int(re.search(r"slow, (\d+) lines", note).group(1))
    full = [ln for ln in body if ln.startswith("line ")]
    assert full == [ln.decode().rstrip("\n") for ln in lines[: len(full)]]  # in order, whole
    assert len(full) + n == 1000 and 0 < n < 1000
    assert f"({n * 10} bytes) of rank 0's stdout not shown; /logs/0/stdout.log" in note
    assert body[-1] == "after" and body[-2] == note


@pytest.mark.timeout(30)
def test_log_file_write_error_is_said_once_and_the_file_dropped():
    said: list[str] = []
    f = LogFile("/dev/full", on_error=said.append)  # every write: ENOSPC
    for _ in range(3):
        f.write(b"x" * 100)
    assert f.dropped and len(said) == 1, said
    assert "cannot write /dev/full: No space left on device (ENOSPC)" in said[0]


@pytest.mark.timeout(30)
def test_log_file_rotation_cuts_at_line_ends_and_keeps_three(tmp_path):
    path = tmp_path / "stdout.log"
    f = LogFile(path, max_bytes=12)
    f.write(b"aaaa\nbbbb\ncccc\n")  # 15 bytes: cut after "bbbb\n"
    f.write(b"a line longer than twelve\n")  # split: no line end fits
    f.write(b"dd\n")
    f.close()
    files = [path.with_name(f"stdout.log.{i}") for i in (3, 2, 1)] + [path]
    assert [p.read_bytes() for p in files] == [
        b"cccc\n",
        b"a line longe",
        b"r than twelv",
        b"e\ndd\n",
    ]
    assert b"".join(p.read_bytes() for p in files) == b"cccc\na line longer than twelve\ndd\n"
    assert not path.with_name("stdout.log.4").exists()  # "aaaa\nbbbb\n" rotated away


@pytest.mark.timeout(30)
def test_console_keeps_a_rank_s_traceback_in_one_block():
    """A traceback is written in many small writes; another rank's lines wait (up to hold_s
    after each of them) until it is done, and are never held longer than that."""
    out = _StoppedReader()
    out.resume.set()
    con = Console(lambda: out, hold_s=0.3)
    a, b = con.stream("A: "), con.stream("B: ")
    tb = [
        b"Traceback (most recent call last):\n",
        b'  File "t.py", line 3, in <module>\n',
        b"    f()\n",
        b"ValueError: ",
        b"boom\n",
    ]
    a.put(tb[0])
    b.put(b"other 1\n")  # waits: A is inside a traceback
    for i, part in enumerate(tb[1:], 1):
        threading.Timer(0.05 * i, a.put, (part,)).start()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert con.flush(2.0)
    assert time.monotonic() - t0 < 0.5  # held hold_s after A's last write, no longer
    b.put(b"other 2\n")
    a.close()
    assert con.flush(1.0)
    assert bytes(out.data) == b"".join(b"A: " + p if p != b"boom\n" else p for p in tb) + (
        b"B: other 1\nB: other 2\n"
    )


def test_log_disk_full_before_a_round_with_hang_detection_trains_on(launch, small_disk):
    """The log disk is full before the workers start, with --hang-timeout: the progress files
    cannot be written, so hang detection is off for that round (said in one line) and the job
    runs to its end, exit 0; the agent never dies of ENOSPC (found by the chaos soak)."""
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    res = launch.run(["--nproc-per-node", "2", "--hang-timeout", "30", "--log-dir",
                      str(small_disk), FLOOD, "10", "20"], timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "hang detection off for round 0" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]



@pytest.mark.timeout(90)
def test_a_full_log_disk_keeps_the_failure_report_on_the_console(launch, small_disk, tmp_path):
    """The log disk is full when the job fails: the report file cannot be written, which is
    said in one line (no partial file left), and the whole report is still on the console,
    its title naming no file; the exit status is the worker's."""
    with open(small_disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    script = tmp_path / "fail7.py"
    script.write_text("import sys\nsys.exit(7)\n")
    res = launch.run(["--nproc-per-node", "1", "--log-dir", str(small_disk), str(script)],
                     timeout=60)  # fmt: skip
    assert res.returncode == 7, res.stderr[-3000:]
    [said] = [ln for ln in res.stderr.splitlines() if "cannot write the failure report" in ln]
    assert "failure_report.txt" in said and "No space left on device" in said, said
    assert "\nmeshrun: job failed\n" in res.stderr and "exit code 7" in res.stderr, res.stderr
    assert not list(small_disk.glob("*/*/failure_report.txt"))
