"""``meshrun timeline``: the agents' event logs as an SVG/HTML picture and a Chrome trace."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from meshrun.agent import events as events_module
from meshrun.agent.events import EventLog
from meshrun.launcher.subcommands import SUBCOMMANDS
from meshrun.launcher.timeline import schedule_svg

pytestmark = pytest.mark.timeout(30)
REPO = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"
T0 = 1_700_000_000.0


class Clock:
    now = T0

    def time(self) -> float:
        return self.now


def write_job(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """Two nodes x two ranks: round 0 fails on node B (rank 3), round 1 loses node B, round 2
    runs on node A alone and succeeds. Each node's log under its own directory."""
    clock = Clock()
    monkeypatch.setattr(events_module, "time", clock)
    dirs = tmp_path / "a", tmp_path / "b"
    paths = [d / "job" / f"{h}_1" for d, h in zip(dirs, ("nodeA", "nodeB"), strict=True)]
    for p in paths:
        p.mkdir(parents=True)
    a = EventLog(paths[0] / "events.jsonl", "nodeA")
    b = EventLog(paths[1] / "events.jsonl", "nodeB")

    def at(t: float, log: EventLog, kind: str, **fields) -> None:
        clock.now = T0 + t
        log.emit(kind, **fields)

    for i, log in enumerate((a, b)):
        at(0.0 + i / 10, log, "agent_start", node=f"node{'AB'[i]}:1:x", nproc=2, run_id="job")
    for rnd, t in ((0, 1.0), (1, 6.0)):
        for i, log in enumerate((a, b)):
            at(t, log, "round_start", round=rnd, node_rank=i, num_nodes=2, world_size=4,
               rank_offset=2 * i, local_world_size=2, restart_count=rnd)  # fmt: skip
            for local in (0, 1):
                at(t + 0.1, log, "worker_start", round=rnd, rank=2 * i + local, local_rank=local,
                   worker_pid=100 * (rnd + 1) + 2 * i + local)  # fmt: skip
        if rnd == 0:
            at(5.0, b, "failure", round=0, rank=3, exitcode=1, message="ValueError: boom")
            at(5.0, b, "worker_exit", round=0, rank=3, local_rank=1, exitcode=1)
            at(5.1, b, "worker_exit", round=0, rank=2, local_rank=0, exitcode=None,
               signal="SIGTERM", stopped=True)  # fmt: skip
            at(5.2, b, "restart", round=0, reason="worker failure on nodeB", spent=True)
            for rank in (0, 1):
                at(5.3, a, "worker_exit", round=0, rank=rank, local_rank=rank, exitcode=None,
                   signal="SIGTERM", stopped=True)  # fmt: skip
            at(5.4, a, "restart", round=0, reason="worker failure on nodeB", spent=True)
    at(8.0, a, "straggler", round=1, rank=1, step_s=0.2, busy_s=0.19, median_s=0.05, steps=5)
    # node B is killed at 9 s: its round-1 workers never get an exit line
    at(10.0, a, "node_lost", node="nodeB:1:x", round=1)
    for rank in (0, 1):
        at(10.1, a, "worker_exit", round=1, rank=rank, local_rank=rank, exitcode=None,
           signal="SIGTERM", stopped=True)  # fmt: skip
    at(10.2, a, "restart", round=1, reason="node nodeB:1:x lost", spent=False)
    at(11.0, a, "round_start", round=2, node_rank=0, num_nodes=1, world_size=2, rank_offset=0,
       local_world_size=2, restart_count=1)  # fmt: skip
    for rank in (0, 1):
        at(11.1, a, "worker_start", round=2, rank=rank, local_rank=rank, worker_pid=300 + rank)
        at(15.0, a, "worker_exit", round=2, rank=rank, local_rank=rank, exitcode=0)
    at(15.1, a, "agent_exit", code=0)
    a.close()
    b.close()
    return dirs


def meshrun_timeline(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshrun", "timeline", *map(str, args)],
                          capture_output=True, text=True, timeout=25, cwd=cwd)  # fmt: skip


def classes(svg: ET.Element, prefix: str) -> list[ET.Element]:
    return [g for g in svg.iter(f"{SVG}g") if g.get("class", "").startswith(prefix)]


def test_registered():
    assert "timeline" in SUBCOMMANDS


def test_svg_has_lanes_bands_bars_and_marks_in_order(tmp_path, monkeypatch):
    dirs = write_job(tmp_path, monkeypatch)
    out = tmp_path / "t.svg"
    done = meshrun_timeline(*dirs, "-o", out)
    assert done.returncode == 0, done.stderr
    assert "2 node(s), 3 round(s)" in done.stdout
    svg = ET.fromstring(out.read_text())  # valid XML
    lanes = [g.find(f"{SVG}text").text for g in classes(svg, "lane")]
    assert lanes == ["nodeA (node rank 0)", "local rank 0", "local rank 1",
                     "nodeB (node rank 1)", "local rank 0", "local rank 1"]  # fmt: skip

    def x(g: ET.Element) -> float:
        return float(g.get("data-t") or g.get("data-start"))

    bands = classes(svg, "band")
    assert [b.find(f"{SVG}text").text for b in bands] == ["round 0", "round 1", "round 2"]
    assert [x(b) for b in bands] == sorted(x(b) for b in bands)
    assert "restart count 1" in bands[1].find(f"{SVG}title").text

    bars = classes(svg, "bar")
    assert len(bars) == 10
    styles = [b.get("class").split()[1] for b in bars]
    assert styles.count("failed") == 1 and styles.count("ok") == 2
    assert styles.count("running") == 2 and styles.count("stopped") == 5
    failed = next(b for b in bars if "failed" in b.get("class"))
    assert "rank 3 (local rank 1) on nodeB, round 0" in failed.find(f"{SVG}title").text
    assert "exit code 1" in failed.find(f"{SVG}title").text

    marks = {}
    for g in classes(svg, "mark"):
        marks.setdefault(g.get("class").split()[1], []).append(g)
    assert set(marks) == {"failure", "restart", "straggler", "node_lost"}
    (failure,), (lost,), (straggler,) = marks["failure"], marks["node_lost"], marks["straggler"]
    assert x(failure) < x(straggler) < x(lost)
    assert x(failure) == pytest.approx(5.0) and x(lost) == pytest.approx(10.0)
    assert failure.get("data-lane") == "5" and straggler.get("data-lane") == "2"
    assert lost.get("data-lane") == "0"  # node A's agent saw it
    assert "ValueError: boom" in failure.find(f"{SVG}title").text
    assert "nodeB:1:x" in lost.find(f"{SVG}title").text
    assert len(marks["restart"]) == 3
    legend = [t.text for t in svg.iter(f"{SVG}text") if t.text in ("failure", "node lost")]
    assert legend == ["failure", "node lost"]


def test_html_page_and_chrome_trace(tmp_path, monkeypatch):
    write_job(tmp_path, monkeypatch)
    page, trace = tmp_path / "t.html", tmp_path / "trace.json"
    done = meshrun_timeline(tmp_path, "-o", page, "--trace", trace)  # one shared dir
    assert done.returncode == 0, done.stderr
    html = page.read_text()
    assert (
        html.startswith("<!DOCTYPE html>")
        and "<script" not in html
        and "http" not in (html.replace("http://www.w3.org/2000/svg", ""))
    )
    ET.fromstring(html[html.index("<svg") : html.index("</svg>") + 6])
    assert "ValueError: boom" in html

    data = json.loads(trace.read_text())
    evs = data["traceEvents"]
    names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"nodeA", "nodeB"}
    timed = [e for e in evs if e["ph"] != "M"]
    assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed)
    workers = [e for e in timed if e["ph"] == "X" and e["cat"] == "worker"]
    assert len(workers) == 10 and all(e["dur"] > 0 and e["tid"] in (1, 2) for e in workers)
    rounds = [e["name"] for e in timed if e["ph"] == "X" and e["cat"] == "round"]
    assert rounds == ["round 0", "round 0", "round 1", "round 1", "round 2"]
    instants = [e["name"] for e in timed if e["ph"] == "i"]
    assert instants == ["failure", "restart", "restart", "straggler", "node_lost", "restart"]
    assert data["otherData"]["t0_unix_s"] == T0


def test_without_torch_and_with_one_file(tmp_path, monkeypatch):
    dirs = write_job(tmp_path, monkeypatch)
    probe = ("import sys; from meshrun.launcher.cli import run_subcommand; "
             "rc = run_subcommand('timeline', sys.argv[1:]); "
             "sys.exit(99 if 'torch' in sys.modules else rc)")  # fmt: skip
    file = next(dirs[0].rglob("events.jsonl"))
    done = subprocess.run([sys.executable, "-c", probe, str(file), "-o", str(tmp_path / "x.svg")],
                          capture_output=True, text=True, timeout=25, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1 node(s)" in done.stdout


def test_malformed_lines_are_skipped_with_a_count(tmp_path, monkeypatch):
    dirs = write_job(tmp_path, monkeypatch)
    with open(next(dirs[1].rglob("events.jsonl")), "a") as f:
        f.write('{"t": 1, "kind": "agent_exit", "host": "nodeB", "pid": 1\n[1, 2]\n\n')
    done = meshrun_timeline(*dirs, "-o", tmp_path / "t.svg")
    assert done.returncode == 0, done.stderr
    assert "warning: skipped 2 malformed line(s)" in done.stderr


@pytest.mark.parametrize("case", ["empty dir", "missing", "garbage only"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    where = tmp_path / "logs"
    if case != "missing":
        where.mkdir()
    if case == "garbage only":
        (where / "events.jsonl").write_text("not json\n{}\n")
    done = meshrun_timeline(where, "-o", tmp_path / "t.html")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrun timeline: error: ")
    assert str(where) in lines[0] or "no well-formed event" in lines[0]
    assert not (tmp_path / "t.html").exists()


def test_schedule_svg_draws_a_pipeline_step():
    # 1F1B over 2 stages and 2 microbatches, forward 1, backward 2
    step = [(0, 0, "F", 0, 1), (0, 1, "F", 1, 2), (1, 0, "F", 1, 2), (1, 0, "B", 2, 4),
            (0, 0, "B", 4, 6), (1, 1, "F", 4, 5), (1, 1, "B", 5, 7), (0, 1, "B", 7, 9)]  # fmt: skip
    svg = ET.fromstring(schedule_svg(step, title="1F1B", unit="units"))
    lanes = [g.find(f"{SVG}text").text for g in classes(svg, "lane")]
    assert lanes == ["stage 0", "stage 1"]
    bars = classes(svg, "bar")
    assert len(bars) == 8
    assert {b.get("class") for b in bars} == {"bar F", "bar B"}
    assert "stage 1: B of microbatch 0, 2 to 4 units" in [b.find(f"{SVG}title").text for b in bars]


def test_schedule_svg_of_the_simulator():
    pipelining = pytest.importorskip("meshrun.parallel.pipelining")
    order = pipelining.one_f_one_b_order(4, 8)
    sim = pipelining.simulate(order)
    rows = [(r, a.microbatch, a.kind, *sim.times[a]) for r, acts in order.items() for a in acts]
    svg = ET.fromstring(schedule_svg(rows, lane_label="rank", unit="units"))
    assert len(classes(svg, "bar")) == 4 * 8 * 2
