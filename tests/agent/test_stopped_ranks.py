"""Every failure report says where each stopped rank was (pytorch#122694).

The scenario: a plain torch script whose rank 0 sits in its own slow reader while rank 1's
barrier times out and fails. The report must name rank 0 as the likely cause, with its
function, and any rank waiting in a collective as waiting; one node and two.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from support import two_c10d_agents

from meshrun.agent.errors import WorkerFailure, culprits, format_report, root_cause
from meshrun.agent.stacks import classify, main_thread, traceback_frames
from meshrun.agent.verdicts import Whereabouts, attribute

SCRIPTS = Path(__file__).parent / "e2e_scripts"
READER = SCRIPTS / "slow_reader.py"


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# --- the rules, on their own --------------------------------------------------------------


def _w(state: str, op: str = "") -> Whereabouts:
    return Whereabouts(state, op, "x.py:1 in f")


def test_attribute_names_the_ranks_outside_any_collective():
    ranks = {0: (_w("running"), 3), 1: (_w("waiting", "barrier"), 4), 2: (_w("running"), 3),
             3: (_w("waiting", "barrier"), 4)}  # fmt: skip
    blamed, why = attribute(ranks)
    assert blamed == [0, 2] and "outside any collective" in why


def test_attribute_names_the_rank_behind_then_the_odd_collective():
    behind = {0: (_w("waiting", "all_reduce"), 7), 1: (_w("waiting", "all_reduce"), 6)}
    assert attribute(behind)[0] == [1]
    odd = {0: (_w("waiting", "all_reduce"), 5), 1: (_w("waiting", "broadcast"), 5),
           2: (_w("waiting", "all_reduce"), 5)}  # fmt: skip
    blamed, why = attribute(odd)
    assert blamed == [1] and "different collective" in why and "all_reduce" in why
    same = {0: (_w("waiting", "all_reduce"), 5), 1: (_w("waiting", "all_reduce"), None)}
    blamed, why = attribute(same)
    assert blamed == [] and "elsewhere" in why
    assert attribute({0: (_w("running"), None)}) == ([], "")  # nobody waits: no culprit


def test_a_failure_inside_a_collective_counts_as_waiting():
    tb = (
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/home/me/train.py", line 23, in main\n'
        "[rank1]:     dist.barrier()\n"
        '[rank1]:   File "/venv/site-packages/torch/distributed/distributed_c10d.py", line 5356, in barrier\n'
        "[rank1]:     work.wait()\n"
        "[rank1]: RuntimeError: Timed out waiting 3000ms for recv operation to complete\n"
    )
    frames = traceback_frames(tb)
    assert frames[0].func == "barrier" and frames[-1].func == "main"
    assert classify(frames).state == "waiting"
    failed = WorkerFailure(1, 1, 11, 1, 1000, traceback=tb, source="stderr")
    stopped = WorkerFailure(0, 0, 10, -15, 1001, stopped=True, state="running",
                            at="/home/me/train.py:14 in read_batch", source="stack")  # fmt: skip
    assert culprits([failed, stopped])[0] == [0]
    assert root_cause([stopped, failed]) is failed  # a stopped rank is never the root cause
    report = format_report([failed, stopped])
    assert "Likely cause: rank 0" in report and "LIKELY CAUSE, running" in report


def test_main_thread_is_found_among_threads():
    dump = (
        "Thread 0x1 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n'
        '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
        "Current thread 0x2 (most recent call first):\n"
        '  File "/home/me/train.py", line 5 in step\n'
        '  File "/home/me/train.py", line 9 in <module>\n'
    )
    assert [f.func for f in main_thread(dump)] == ["step", "<module>"]
    assert classify(main_thread(dump)).state == "running"
    assert classify(main_thread(dump), blocked=True).state == "waiting"  # meshrun's counters


# --- real processes -----------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_plain_script_report_names_the_slow_reader_as_the_likely_cause(launch):
    result = launch.run(
        ["--nproc-per-node", "3", "--shutdown-timeout", "2", str(READER)], timeout=80
    )
    err = result.stderr
    assert result.returncode == 1, err
    report = err[err.index("Root cause") :]
    assert "  rank       : 1 (local rank 1)" in report  # the first failure: rank 1's timeout
    reader = _line_of(READER, "time.sleep(120)")
    barrier = _line_of(READER, "dist.barrier()")
    assert re.search(r"Likely cause: rank 0, outside any collective", report), report
    m = re.search(
        rf"rank 0 \(host .*, local rank 0, pid \d+\): LIKELY CAUSE, running, outside any "
        rf"collective at (\S+slow_reader.py):{reader} in read_batch\n    full stack: (\S+)", report
    )
    assert m, report
    assert "read_batch" in Path(m[2]).read_text()  # the full stack, in rank 0's log directory
    assert re.search(
        rf"rank 2 \(host .*\): waiting in barrier(?: #\d+)? at \S+slow_reader.py:{barrier} in main", report
    ), report


# deaf_to_stacks.py blocks the stack signal in its main thread; meshrun's threads in the worker
# block every signal (meshrun/worker_signals.py), so nothing else takes it and the record stays on
DEAF: dict[str, str] = {}


@pytest.mark.timeout(90)
def test_a_stack_not_taken_in_time_is_one_line_and_never_delays_the_stop(launch):
    start = time.monotonic()
    result = launch.run(
        ["--nproc-per-node", "2", "--shutdown-timeout", "2", str(SCRIPTS / "deaf_to_stacks.py")],
        timeout=80, env=DEAF,
    )
    elapsed = time.monotonic() - start
    err = result.stderr
    assert result.returncode == 3, err
    assert "no stack within 2 s (faulthandler did not answer)" in err, err
    assert "rank 0 (host" in err and "place unknown" in err
    # start-up, 1 s, at most 2 s for stacks, 2 s of grace: far less than rank 0's 120 s sleep
    assert elapsed < 40, elapsed


@pytest.mark.timeout(120)
def test_two_nodes_every_node_reports_the_other_nodes_stopped_rank(tmp_path):
    agents = two_c10d_agents(tmp_path, "stopped", ["--monitor-interval", "0.1",
                                                   "--shutdown-timeout", "2", str(READER)])  # fmt: skip
    reader = _line_of(READER, "time.sleep(120)")
    for code, _, err in agents:
        assert code == 1, err
        report = err[err.index("Root cause") :]
        assert "  rank       : 1 (local rank 0)" in report, report
        assert re.search(
            rf"rank 0 \(host .*node rank 0, local rank 0, pid \d+\): LIKELY CAUSE, running, "
            rf"outside any collective at \S+slow_reader.py:{reader} in read_batch", report
        ), report


@pytest.mark.timeout(90)
def test_sigterm_while_stacks_are_taken_exits_143_at_once(launch):
    """Rank 1 fails with restarts left; rank 0 never answers the stack request (it blocks the
    signal). A SIGTERM while the agent waits for that stack ends the wait: exit 143 promptly,
    as from any other moment, and the restart is not carried out."""
    import signal as sig

    proc = launch.start(["--nproc-per-node", "2", "--max-restarts", "3", "--shutdown-timeout",
                         "2", str(SCRIPTS / "deaf_to_stacks.py")], env=DEAF)  # fmt: skip
    deadline = time.monotonic() + 60
    err = ""
    while "restarting the worker group" not in err:
        line = proc.stderr.readline()
        assert line and time.monotonic() < deadline, err
        err += line
    time.sleep(0.3)  # inside the 2 s wait for rank 0's stack
    sent = time.monotonic()
    proc.send_signal(sig.SIGTERM)
    rest = proc.stderr.read()  # to EOF: the agent exited (pytest-timeout bounds it)
    proc.wait(30)
    elapsed = time.monotonic() - sent
    assert proc.returncode == 143, err + rest
    assert "round 1" not in rest, rest  # no new round was started
    assert "during rendezvous" not in rest, rest  # it stopped from where it was
    assert elapsed < 1.7 + 2, elapsed  # a liveness bound: the stack wait (2 s) plus grace


def _filing(report: str) -> dict[int, str]:
    """Each rank the report lists after its root cause -> its line (section and place)."""
    filed, section = {}, ""
    for line in report.splitlines():
        if line.startswith(("Other failures", "Stopped ranks", "Likely cause")):
            section = line.split(" (")[0].split(":")[0]
        m = re.match(r"  rank (\d+) \(", line)
        if m and section != "Likely cause":
            filed[int(m[1])] = f"{section}: {line.strip()}"
    return filed


@pytest.mark.timeout(150)
@pytest.mark.parametrize("failing", [0, 2])
def test_two_nodes_file_every_rank_the_same_way(tmp_path, failing):
    """One rank fails while its peers on both nodes wait in a barrier that then breaks under
    them. Every node's report lists every rank in the same section with the same place (the
    store's record, which every node reads), whichever node the failure was on."""
    agents = two_c10d_agents(
        tmp_path, "filing", ["--monitor-interval", "0.1", "--shutdown-timeout", "2",
                             "--max-restarts", "0", str(SCRIPTS / "fail_in_step.py"), str(failing)],
        nproc=2, timeout=120,
    )  # fmt: skip
    filings = []
    for code, _, err in agents:
        assert code == 7, err
        report = err[err.index("Root cause") :]
        assert f"  rank       : {failing} (" in report, report
        filings.append(_filing(report))
    assert set(filings[0]) == {0, 1, 2, 3} - {failing}, agents[0][2]
    assert filings[0] == filings[1], (agents[0][2], agents[1][2])
