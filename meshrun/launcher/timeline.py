"""``meshrun timeline``: a job's event logs, merged, as a picture and a Chrome trace.

    meshrun timeline LOGDIR... [-o timeline.html] [--trace trace.json]

Finds every ``events.jsonl`` under the given directories (recursively: give each node's
``--log-dir``, or one shared directory), merges the agents' events by time
(`meshrun.agent.events` has the kinds and fields) and writes

- ``-o FILE``: a self-contained HTML page (default ``timeline.html``) with one inline SVG
  picture: time on x; one lane per node (its agent) and, below it, one per local rank; the
  rounds as shaded bands; each worker's life as a bar (green: exited 0, red: failed, grey:
  stopped by the agent, blue: no exit recorded); failures, hangs, stragglers, lost and
  joining nodes, restarts and non-zero agent exits as marks, with a legend and a tooltip
  (``<title>``) on every bar and mark. No script, no external style. ``-o x.svg`` writes the
  bare SVG.
- ``--trace FILE``: the same in the Trace Event Format (Chrome's ``chrome://tracing``,
  Perfetto's ui.perfetto.dev): process = node, thread 0 = its agent (rounds as complete
  events), thread 1 + local rank = that rank (worker lives as complete ``X`` events, faults
  as instant ``i`` events); times in microseconds from the first event.

A rank's lane is its local rank on its node: global ranks move when the membership changes,
so each bar is labelled with the global rank it had in that round.

Exit codes: 0 written; 2 bad input (no ``events.jsonl`` found, a file that cannot be read,
no well-formed event at all), one line on stderr. Malformed lines are skipped, with one
warning that counts them. stdlib only: no torch, nothing to install.

`schedule_svg` draws a pipeline schedule (the simulator's, or a measured step's) as the same
kind of picture.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

import click

from meshrun.launcher.errors import ConfigError
from meshrun.launcher.lanechart import Band, Bar, Lane, Mark, render

EVENT_FILE = "events.jsonl"  # as meshrun.agent.events.EVENT_FILE
MARK_KINDS = ("failure", "hang", "straggler", "node_lost", "join", "restart", "agent_exit")
_LEGEND = (
    ("bar", "ok", "exited 0"), ("bar", "failed", "failed"),
    ("bar", "stopped", "stopped by the agent"), ("bar", "running", "no exit recorded"),
    ("mark", "failure", "failure"), ("mark", "hang", "hang"),
    ("mark", "straggler", "straggler"), ("mark", "node_lost", "node lost"),
    ("mark", "join", "node joining"), ("mark", "restart", "restart"),
    ("mark", "agent_exit", "agent exit != 0"),
)  # fmt: skip


@click.command(
    "timeline",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    help="Draw a job's timeline from the agents' events.jsonl files: an HTML/SVG picture of "
    "nodes, ranks, rounds and faults, and optionally a Chrome trace.",
)
@click.argument("log_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=Path("timeline.html"),
    show_default=True,
    help="The picture: .html (self-contained) or .svg.",
)
@click.option("--trace", type=click.Path(path_type=Path), default=None,
              help="Also write a Chrome trace (Trace Event Format JSON) here.")  # fmt: skip
def timeline(log_dirs: tuple[Path, ...], output: Path, trace: Path | None) -> int:
    files = find_event_files(log_dirs)
    events, skipped = read_events(files)
    if skipped:
        click.echo(
            f"meshrun timeline: warning: skipped {skipped} malformed line(s) in {len(files)} "
            "event file(s)",
            err=True,
        )
    job = build(events)
    try:
        if output.suffix.lower() == ".svg":
            output.write_text(timeline_svg(job))
        else:
            output.write_text(timeline_html(job))
        if trace is not None:
            trace.write_text(json.dumps(chrome_trace(job)))
    except OSError as e:
        raise ConfigError(f"cannot write {e.filename}: {e.strerror or e}") from None
    written = str(output) + (f" and {trace}" if trace is not None else "")
    click.echo(
        f"{len(events)} events of {len(job.nodes)} node(s), {len(job.rounds)} round(s) from "
        f"{len(files)} file(s) -> {written}"
    )
    return 0


# -- reading -------------------------------------------------------------------------------------
def find_event_files(dirs: Iterable[Path]) -> list[Path]:
    """Every ``events.jsonl`` under ``dirs`` (a file given itself counts), sorted, no repeats.

    Raises:
        ConfigError: a path that does not exist, or no event file found at all.
    """
    found: set[Path] = set()
    dirs = list(dirs)
    for d in dirs:
        if d.is_file():
            found.add(d.resolve())
        elif d.is_dir():
            for root, _, names in os.walk(d):
                if EVENT_FILE in names:
                    found.add((Path(root) / EVENT_FILE).resolve())
        else:
            raise ConfigError(f"{d}: no such file or directory; give the job's log directories")
    if not found:
        shown = " ".join(str(d) for d in dirs)
        raise ConfigError(
            f"no {EVENT_FILE} under {shown}; give the --log-dir of the job's nodes (each agent "
            f"writes <log dir>/<run id>/<host>_<pid>/{EVENT_FILE})"
        )
    return sorted(found)


def read_events(files: Sequence[Path]) -> tuple[list[dict], int]:
    """The events of ``files``, merged by time (stable: a file's order is kept on ties), and
    the number of malformed lines skipped (not JSON, not an object, no numeric ``t``, no
    string ``kind`` and ``host``; a ``t`` that is NaN or infinite).

    Raises:
        ConfigError: a file that cannot be read, or no well-formed event at all.
    """
    events, skipped = [], 0
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            ok = isinstance(event, dict) and isinstance(event.get("t"), (int, float))
            ok = ok and isinstance(event.get("kind"), str) and isinstance(event.get("host"), str)
            if not ok or isinstance(event["t"], bool) or not math.isfinite(event["t"]):
                skipped += 1
                continue
            events.append(event)
    if not events:
        raise ConfigError(
            f"no well-formed event in {len(files)} {EVENT_FILE} file(s)"
            + (f" ({skipped} malformed line(s))" if skipped else "")
        )
    events.sort(key=lambda e: e["t"])
    return events, skipped


# -- the model -------------------------------------------------------------------------------------
@dataclass
class Node:
    """One agent: its events' ``(host, pid)``."""

    host: str
    pid: int
    label: str = ""
    node_id: str = ""  # from its agent_start
    node_rank: int | None = None  # in the first round it took part in
    local_ranks: set[int] = field(default_factory=set)
    first_t: float = 0.0
    last_t: float = 0.0


@dataclass
class Job:
    """What `build` made of the events: the drawing's and the trace's data (times in
    seconds, wall clock)."""

    events: list[dict]
    nodes: list[Node]
    rounds: list[tuple[int, float, float, int | None]]  # round, start, end, restart count
    workers: list[dict]  # node, local_rank, rank, round, start, end, style, title, fields
    marks: list[dict]  # node, local_rank (None: the agent lane), t, kind, title, event
    t0: float
    t1: float


def build(events: list[dict]) -> Job:
    """Pair each worker's start with its exit, place every mark on its lane, span the rounds."""
    nodes: dict[tuple[str, int], Node] = {}
    for e in events:
        key = (e["host"], _int(e.get("pid"), 0))
        node = nodes.setdefault(key, Node(key[0], key[1], first_t=e["t"]))
        node.last_t = e["t"]
        if e["kind"] == "agent_start" and isinstance(e.get("node"), str):
            node.node_id = e["node"]
        if e["kind"] == "round_start" and node.node_rank is None:
            node.node_rank = _int(e.get("node_rank"), None)
        if e["kind"] == "worker_start" and _int(e.get("local_rank"), None) is not None:
            node.local_ranks.add(_int(e["local_rank"], 0))
    hosts = [n.host for n in nodes.values()]
    for n in nodes.values():
        n.label = n.host if hosts.count(n.host) == 1 else f"{n.host}:{n.pid}"
    order = sorted(nodes.values(), key=lambda n: (n.node_rank is None, n.node_rank or 0, n.first_t))
    t0, t1 = events[0]["t"], events[-1]["t"]

    starts: dict[int, float] = {}
    restarts: dict[int, int | None] = {}
    for e in events:
        if e["kind"] == "round_start" and (r := _int(e.get("round"), None)) is not None:
            starts.setdefault(r, e["t"])
            restarts.setdefault(r, _int(e.get("restart_count"), None))
    ids = sorted(starts)
    rounds = [
        (r, starts[r], starts[ids[i + 1]] if i + 1 < len(ids) else t1, restarts[r])
        for i, r in enumerate(ids)
    ]

    workers: list[dict] = []
    open_: dict[tuple, dict] = {}
    local_of: dict[tuple, int] = {}  # (node key, round, rank) -> local rank
    marks = []
    for e in events:
        key, kind = (e["host"], _int(e.get("pid"), 0)), e["kind"]
        rnd, rank = _int(e.get("round"), None), _int(e.get("rank"), None)
        local = _int(e.get("local_rank"), None)  # as the node's lanes were made (above)
        if kind == "worker_start" and rank is not None and local is not None:
            local_of[(key, rnd, rank)] = local
            open_[(key, rnd, rank)] = {
                "node": nodes[key], "local_rank": local, "rank": rank, "round": rnd,
                "start": e["t"], "end": None, "style": "running", "start_event": e,
            }  # fmt: skip
        elif kind == "worker_exit" and (w := open_.pop((key, rnd, rank), None)) is not None:
            w["end"], w["exit_event"] = e["t"], e
            code = e.get("exitcode")
            w["style"] = "stopped" if e.get("stopped") else ("ok" if code == 0 else "failed")
            workers.append(w)
        elif kind in ("round_start", "agent_exit"):  # a new round ends what was left open
            for k in [k for k in open_ if k[0] == key]:
                w = open_.pop(k)
                w["end"] = e["t"]
                workers.append(w)
        if kind in MARK_KINDS and not (kind == "agent_exit" and e.get("code") == 0):
            lane = local_of.get((key, rnd, rank)) if kind in ("failure", "straggler") else None
            marks.append({"node": nodes[key], "local_rank": lane, "t": e["t"], "kind": kind,
                          "title": _describe(e, t0), "event": e})  # fmt: skip
            if kind == "hang":  # on the culprits' lanes too
                culprits = e.get("culprits")
                for culprit in culprits if isinstance(culprits, list) else []:
                    if (local := local_of.get((key, rnd, _int(culprit, None)))) is not None:
                        marks.append({"node": nodes[key], "local_rank": local, "t": e["t"],
                                      "kind": kind, "title": _describe(e, t0), "event": e})  # fmt: skip
    lost_at: dict[str, float] = {}
    for e in events:
        if e["kind"] == "node_lost" and isinstance(e.get("node"), str):
            lost_at.setdefault(e["node"], e["t"])
    for w in open_.values():  # its agent wrote no more: until the others saw it lost, or the end
        w["end"] = max(w["start"], lost_at.get(w["node"].node_id, t1))
        workers.append(w)
    for w in workers:
        w["title"] = _worker_title(w, t0)
    workers.sort(key=lambda w: w["start"])
    return Job(events, order, rounds, workers, marks, t0, t1)


# -- writing ---------------------------------------------------------------------------------------
def timeline_svg(job: Job) -> str:
    """The job's picture, one ``<svg>`` element (see the module docstring)."""
    lanes, index = [], {}
    for n in job.nodes:
        rank = f" (node rank {n.node_rank})" if n.node_rank is not None else ""
        index[(id(n), None)] = len(lanes)
        lanes.append(Lane(f"{n.label}{rank}", header=True))
        for local in sorted(n.local_ranks):
            index[(id(n), local)] = len(lanes)
            lanes.append(Lane(f"local rank {local}"))
    bands = [
        Band(start, end, f"round {r}",
             f"round {r}: {start - job.t0:.3f} s to {end - job.t0:.3f} s"
             + (f", restart count {rc}" if rc is not None else ""))
        for r, start, end, rc in job.rounds
    ]  # fmt: skip
    bars = [
        Bar(index[(id(w["node"]), w["local_rank"])], w["start"], w["end"], w["style"],
            f"rank {w['rank']}", w["title"])
        for w in job.workers
    ]  # fmt: skip
    marks = [
        Mark(index.get((id(m["node"]), m["local_rank"]), index[(id(m["node"]), None)]), m["t"],
             m["kind"], m["title"])
        for m in job.marks
    ]  # fmt: skip
    run_ids = sorted({str(e["run_id"]) for e in job.events if "run_id" in e})
    title = f"meshrun timeline{' of ' + ', '.join(run_ids) if run_ids else ''}: " + (
        f"{len(job.nodes)} node(s), {len(job.rounds)} round(s), {job.t1 - job.t0:.1f} s"
    )
    return render(lanes, bars, marks, bands, title=title, legend=_LEGEND, t0=job.t0,
                  t1=max(job.t1, job.t0 + 1e-3))  # fmt: skip


def timeline_html(job: Job) -> str:
    """A self-contained HTML page around `timeline_svg` (no script, no external style)."""
    svg = timeline_svg(job)
    rows = "\n".join(
        f"<tr><td>{e['t'] - job.t0:.3f}</td><td>{escape(e['host'])}</td>"
        f"<td>{escape(e['kind'])}</td><td>{escape(_fields(e))}</td></tr>"
        for e in job.events
        if e["kind"] in MARK_KINDS or e["kind"] == "round_start"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>meshrun timeline</title>\n<style>body{font-family:sans-serif;margin:16px}"
        "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;"
        "padding:2px 6px;text-align:left}</style></head>\n<body>\n"
        f"{svg}"
        "<h3>Rounds and faults</h3>\n<table><tr><th>s</th><th>host</th><th>event</th>"
        f"<th>fields</th></tr>\n{rows}\n</table>\n</body></html>\n"
    )


def chrome_trace(job: Job) -> dict:
    """The job in the Trace Event Format (JSON object form), events sorted by ``ts``.

    pid = 1 + the node's index, tid 0 = its agent, tid 1 + local rank = that rank; ``ts`` and
    ``dur`` in microseconds from the first event (``otherData.t0_unix_s`` is that moment).
    """

    def us(t: float) -> float:
        return round((t - job.t0) * 1e6, 1)

    meta, timed = [], []
    pid_of = {id(n): i + 1 for i, n in enumerate(job.nodes)}
    for n in job.nodes:
        pid = pid_of[id(n)]
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0,
                     "args": {"name": n.label}})  # fmt: skip
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0,
                     "args": {"sort_index": pid}})  # fmt: skip
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "ts": 0,
                     "args": {"name": "agent"}})  # fmt: skip
        for local in sorted(n.local_ranks):
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1 + local,
                         "ts": 0, "args": {"name": f"local rank {local}"}})  # fmt: skip
        starts = [e for e in job.events
                  if (e["host"], _int(e.get("pid"), 0)) == (n.host, n.pid)
                  and e["kind"] in ("round_start", "agent_exit")]  # fmt: skip
        # starts is empty for an agent still in rendezvous (or killed there)
        for e, nxt in zip(starts, [*starts[1:], None], strict=False):
            if e["kind"] != "round_start":
                continue
            end = nxt["t"] if nxt is not None else n.last_t
            timed.append({"ph": "X", "name": f"round {e.get('round')}", "cat": "round",
                          "pid": pid, "tid": 0, "ts": us(e["t"]),
                          "dur": round(max(0.0, end - e["t"]) * 1e6, 1), "args": _args(e)})  # fmt: skip
    for w in job.workers:
        args = {"round": w["round"], "rank": w["rank"], "state": w["style"]}
        args.update(_args(w.get("exit_event", {})))
        timed.append({"ph": "X", "name": f"rank {w['rank']}", "cat": "worker",
                      "pid": pid_of[id(w["node"])], "tid": 1 + w["local_rank"],
                      "ts": us(w["start"]), "dur": round(max(0.0, w["end"] - w["start"]) * 1e6, 1),
                      "args": args})  # fmt: skip
    for m in job.marks:
        tid = 0 if m["local_rank"] is None else 1 + m["local_rank"]
        timed.append({"ph": "i", "s": "t", "name": m["kind"], "cat": "fault",
                      "pid": pid_of[id(m["node"])], "tid": tid, "ts": us(m["t"]),
                      "args": _args(m["event"])})  # fmt: skip
    timed.sort(key=lambda e: e["ts"])
    return {
        "traceEvents": meta + timed,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "meshrun timeline", "t0_unix_s": job.t0},
    }


def schedule_svg(
    actions: Iterable[tuple[int, int, str, float, float]],
    *,
    title: str = "pipeline schedule",
    unit: str = "s",
    lane_label: str = "stage",
) -> str:
    """A pipeline schedule as the same kind of picture as ``meshrun timeline``'s.

    Args:
        actions: ``(lane, microbatch, kind, start, end)`` per action: ``lane`` the pipeline
            rank or stage, ``kind`` ``"F"`` (forward), ``"B"`` (backward, or input gradient
            where weight gradients are split off) or ``"W"`` (weight gradient); ``start`` and
            ``end`` in ``unit`` (the simulator's cost units, or seconds measured).
        title: the line above the picture.
        unit: the time axis' unit.
        lane_label: how lanes are named (``"stage"`` or ``"rank"``).

    Returns one ``<svg>`` element: one lane per ``lane`` value, a bar per action labelled
    with its kind and microbatch (``F3``), coloured by kind.
    """
    actions = list(actions)
    ids = sorted({a[0] for a in actions})
    lane_of = {s: i for i, s in enumerate(ids)}
    bars = [
        Bar(lane_of[s], start, end, kind, f"{kind}{mb}",
            f"{lane_label} {s}: {kind} of microbatch {mb}, {start:.6g} to {end:.6g} {unit}")
        for s, mb, kind, start, end in actions
    ]  # fmt: skip
    legend = [("bar", k, name) for k, name in
              (("F", "forward"), ("B", "backward"), ("W", "weight gradient"))
              if any(a[2] == k for a in actions)]  # fmt: skip
    return render([Lane(f"{lane_label} {s}") for s in ids], bars, title=title, legend=legend,
                  unit=unit)  # fmt: skip


# -- helpers ---------------------------------------------------------------------------------------
def _int(value, default):
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _args(e: dict) -> dict:
    return {k: v for k, v in e.items() if k not in ("t", "host", "pid", "kind")}


def _fields(e: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in _args(e).items())


def _describe(e: dict, t0: float) -> str:
    return f"{e['kind']} at {e['t'] - t0:.3f} s on {e['host']}: {_fields(e)}"


def _worker_title(w: dict, t0: float) -> str:
    ev = w.get("exit_event")
    if ev is None:
        how = "no exit recorded"
    elif ev.get("signal"):
        how = f"killed by {ev['signal']}"
    else:
        how = f"exit code {ev.get('exitcode')}"
    if ev is not None and ev.get("stopped"):
        how += " (stopped by the agent)"
    pid = w["start_event"].get("worker_pid")
    return (
        f"rank {w['rank']} (local rank {w['local_rank']}) on {w['node'].label}, round "
        f"{w['round']}: {w['start'] - t0:.3f} s to {w['end'] - t0:.3f} s, {how}"
        + (f", pid {pid}" if pid else "")
    )
