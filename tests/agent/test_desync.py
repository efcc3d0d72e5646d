"""meshrun's own --desync-check end to end (issue 48): plain torch scripts (gloo) whose ranks
fall out of step, under a real meshrun; and a correct torch-DDP script that must pass alike
with the check on. The check reads the collective record (`meshrun.agent.desync`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "e2e_scripts"
SCRIPT = SCRIPTS / "desync_mistakes.py"


def _run(launch, mode: str, nproc: int, *extra: str, timeout_s: float = 60):
    logs = launch.cwd / "logs"
    result = launch.run(["--nproc-per-node", str(nproc), "--shutdown-timeout", "2",
                         "--log-dir", str(logs), "--desync-check", *extra, str(SCRIPT), mode,
                         str(timeout_s)], timeout=120)  # fmt: skip
    return result, logs


def _said(err: str) -> str:
    """The agent's desync line, less the call sites (" at t.py:12 in step": where the record
    has them, from the worker's side; checked by `_sites`)."""
    found = re.search(r"^meshrun: (desync .*) \(--desync-check\)$", err, re.M)
    assert found, err
    return _SITE.sub("", found[1])


_SITE = re.compile(r" at (\S+):(\d+) in [^\s,;]+")


def _sites(err: str) -> set[int]:
    """The script's lines named as call sites in the desync line ({} where there are none)."""
    found = re.search(r"^meshrun: (desync .*)$", err, re.M)
    return {int(m[2]) for m in _SITE.finditer(found[1]) if m[1].endswith(SCRIPT.name)}


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if text in line)


def _desync_event(logs: Path) -> dict:
    (events,) = logs.rglob("events.jsonl")
    found = [e for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == "desync"]
    assert len(found) == 1, events.read_text()
    return found[0]


def _seconds_to_report(logs: Path, event: dict) -> float:
    """From the first mismatched call (the script's own line, before it) to the desync event."""
    started = min(float(m[1]) for p in logs.rglob("stdout.log")
                  for m in re.finditer(r"(?:desync_mistakes|ddp_train): mismatch at ([\d.]+)", p.read_text()))
    return event["t"] - started


@pytest.mark.timeout(150)
def test_a_reordered_call_is_named_within_5_s_with_the_calls_on_each_side(launch):
    """Rank 2 calls barrier then all_reduce where ranks 0-1 call all_reduce then barrier (gloo
    would wait 60 s): the check names call #5 of group 0, both calls, and rank 2, within 5 s;
    the report's root cause is rank 2 with that line, exit 1 (torch's own check raises there),
    and the collective record's line is kept."""
    result, logs = _run(launch, "reorder", 3)
    err = result.stderr
    assert result.returncode == 1, err
    line = ("desync in group 0 at call #5: rank 2 called barrier(), ranks 0-1 called "
            "all_reduce(float[1024])")
    assert _said(err) == line, err
    # call sites, where the record has them: the barrier's line, the all_reduce before the
    # others' barrier
    sites = {_line_of("dist.barrier()  # the mistake"), _line_of("        dist.barrier()") - 1}
    assert _sites(err) <= sites, err
    assert "  rank       : 2 (local rank 2)" in err and "  message    : desync in group 0" in err
    assert re.search(r"^Collectives: in group 0, rank 2 (is at|called) barrier #5", err, re.M), err
    event = _desync_event(logs)
    assert event["culprits"] == [2] and event["what"] == "mismatch", event
    seconds = _seconds_to_report(logs, event)
    print(f"reorder named {seconds:.2f} s after the mismatched call")
    assert seconds < 5, (seconds, err)


@pytest.mark.timeout(150)
def test_a_call_of_another_shape_is_named_within_5_s(launch):
    """Rank 1 all-reduces a 2x4 tensor where ranks 0, 2 all-reduce 8 values: the same bytes,
    so gloo reduces them without a word and the training goes on; the check stops it."""
    result, logs = _run(launch, "shape", 3)
    err = result.stderr
    assert result.returncode == 1, err
    line = ("desync in group 0 at call #5: rank 1 called all_reduce(float[2, 4]), ranks 0, 2 "
            "called all_reduce(float[8])")
    assert _said(err) == line, err
    assert "  rank       : 1 (local rank 1)" in err, err
    event = _desync_event(logs)
    assert event["culprits"] == [1], event
    seconds = _seconds_to_report(logs, event)
    print(f"shape mismatch named {seconds:.2f} s after the mismatched call")
    assert seconds < 5, (seconds, err)
    assert not any("rank 0 done" in p.read_text() for p in logs.rglob("stdout.log"))


@pytest.mark.timeout(150)
def test_a_skip_then_identical_calls_is_named_by_its_offset_at_a_hang(launch):
    """Rank 0 skips one all_reduce, then every rank makes the same calls: no call differs, rank
    0 ends one call early and works on; at --hang-timeout the check names it 1 call behind."""
    result, logs = _run(launch, "skip-hang", 2, "--hang-timeout", "3")
    err = result.stderr
    assert result.returncode == 124, err
    line = ("desync in group 0: rank 0 is 1 call behind: rank 0 last called all_reduce #9 "
            "(float[1024]); rank 1 last called all_reduce #10 (float[1024])")
    assert _said(err) == line, err
    assert "  rank       : 0 (local rank 0)" in err and "  message    : desync in group 0" in err
    assert _desync_event(logs)["what"] == "offset"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_skip_then_identical_calls_is_named_by_its_offset_at_the_end(launch, nproc):
    """The same skip, but rank 0 exits when its loop ends: the others then fail on a closed
    connection, and the check names rank 0, 1 call behind, as the root cause."""
    result, logs = _run(launch, "skip-end", nproc)
    err = result.stderr
    assert result.returncode == 1, err
    others = "rank 1" if nproc == 2 else "ranks 1-2"
    line = (f"desync in group 0: rank 0 is 1 call behind: rank 0 last called all_reduce #9 "
            f"(float[1024]); {others} last called all_reduce #10 (float[1024])")
    assert _said(err) == line, err
    assert "  rank       : 0 (local rank 0)" in err, err


DDP = SCRIPTS / "ddp_train.py"


@pytest.mark.timeout(150)
def test_torch_ddp_with_an_uneven_last_batch_is_named_within_5_s(launch):
    """torch's DDP, 3 ranks: rank 2 has one batch fewer and goes to the end-of-epoch barrier
    while ranks 0-1 wait in DDP's bucket all-reduce, issued from C++ (no Python frame names
    it): the check names both calls and rank 2 within 5 s, without --hang-timeout."""
    logs = launch.cwd / "logs"
    result = launch.run(["--nproc-per-node", "3", "--shutdown-timeout", "2", "--log-dir",
                         str(logs), "--desync-check", str(DDP), "uneven"], timeout=120)
    err = result.stderr
    assert result.returncode == 1, err
    assert re.fullmatch(r"desync in group 0 at call #\d+: rank 2 called barrier\(\), ranks 0-1 "
                        r"called all_reduce\(float\[\d+\]\)", _said(err)), err  # fmt: skip
    assert "  rank       : 2 (local rank 2)" in err, err
    event = _desync_event(logs)
    assert event["culprits"] == [2], event
    seconds = _seconds_to_report(logs, event)
    print(f"torch DDP uneven batch named {seconds:.2f} s after the last step began")
    assert seconds < 5, (seconds, err)


@pytest.mark.timeout(200)
def test_a_correct_torch_ddp_script_passes_with_the_check_and_trains_the_same(launch):
    """torch's DistributedDataParallel (its bucket all-reduces issued from C++), 2 ranks, gloo:
    the check stays silent, the job exits 0, and the trained weights are those of the run
    without the check; the record kept DDP's calls under the default group's name."""
    runs = {}
    for check in (False, True):
        logs = launch.cwd / f"logs_{check}"
        result = launch.run(["--nproc-per-node", "2", "--log-dir", str(logs),
                             *(["--desync-check"] if check else []), str(DDP)], timeout=150)
        assert result.returncode == 0, result.stderr
        assert "desync" not in result.stderr, result.stderr
        runs[check] = sorted(re.findall(r"ddp_train: rank \d checksum \S+", result.stdout))
        records = sorted(logs.rglob("collectives.json"))
        assert len(records) == 2, records
        for path in records:
            calls = json.loads(path.read_text())["calls"]
            assert any(c["group"] == "0" and c["op"] == "all_reduce" for c in calls), calls
    assert len(runs[True]) == 2 and runs[True] == runs[False], runs


@pytest.mark.timeout(150)
def test_two_nodes_a_reordered_call_on_the_other_node_is_named_through_the_store(tmp_path):
    """2 nodes x 2 ranks (c10d): rank 3, on node rank 1, reorders its calls. Node rank 0 reads
    node 1's digest from the store, names rank 3 within 5 s, and every node's report has rank
    3 as the root cause with the line."""
    from support import two_c10d_agents

    logs = tmp_path / "logs"
    agents = two_c10d_agents(tmp_path, "desync", ["--shutdown-timeout", "2", "--log-dir",
                                                  str(logs), "--desync-check", str(SCRIPT),
                                                  "reorder", "60"], nproc=2, timeout=120)  # fmt: skip
    outs = [(out, err) for _, out, err in agents]
    line = ("desync in group 0 at call #5: rank 3 called barrier(), ranks 0-2 called "
            "all_reduce(float[1024])")
    assert _said(outs[0][1]) == line, outs[0][1]
    for code, _, err in agents:
        assert code == 1, err
        report = err[err.index("Root cause") :]
        assert "  rank       : 3 (local rank 1)" in report, report
        assert "  host       : " in report and "(node rank 1)" in report, report
        assert "  message    : desync in group 0 at call #5: rank 3 called barrier()" in report
    events = [e for p in logs.rglob("events.jsonl")
              for e in map(json.loads, p.read_text().splitlines()) if e["kind"] == "desync"]
    assert len(events) == 1 and events[0]["culprits"] == [3], events
    seconds = _seconds_to_report(logs, events[0])
    print(f"two nodes: reorder named {seconds:.2f} s after the mismatched call")
    assert seconds < 5, seconds


@pytest.mark.timeout(150)
def test_a_script_that_destroys_its_group_and_works_on_is_no_desync(launch):
    """The record is written once more inside destroy_process_group, so a rank that finished
    all its calls never looks calls behind one that is still running (found by a breaker: 2
    of 3 runs were stopped as 'rank 0 is 9 calls behind')."""
    for _ in range(2):
        result = launch.run(["--nproc-per-node", "2", "--max-restarts", "0", "--desync-check",
                             str(SCRIPTS / "destroy_then_work.py")], timeout=120)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "desync in" not in result.stderr, result.stderr
        assert result.stdout.count("destroy_then_work: rank") == 2, result.stdout
