"""``meshrun timeline`` on logs that are odd but real (found by the breaker): an agent that
wrote only its start (still in rendezvous, or killed there) crashed ``--trace``; fields of the
wrong type (a hand-edited or corrupt line) crashed the drawing; NaN/infinite times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)


def _timeline(tmp_path: Path, meshrun_env, lines: list[str]) -> subprocess.CompletedProcess:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.jsonl").write_text("\n".join(lines) + "\n")
    return subprocess.run(
        [sys.executable, "-m", "meshrun", "timeline", str(tmp_path / "logs"),
         "-o", str(tmp_path / "t.html"), "--trace", str(tmp_path / "t.json")],
        env=meshrun_env(), capture_output=True, text=True, timeout=25,
    )  # fmt: skip


def test_an_agent_that_wrote_only_its_start_is_drawn_and_traced(tmp_path, meshrun_env):
    done = _timeline(tmp_path, meshrun_env, [
        '{"t": 1.0, "host": "h", "pid": 1, "kind": "agent_start", "node": "n", "nproc": 2}',
        '{"t": 2.0, "host": "h", "pid": 1, "kind": "round_st',  # a line cut by kill -9
    ])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "skipped 1 malformed line" in done.stderr
    json.loads((tmp_path / "t.json").read_text())


def test_fields_of_the_wrong_type_and_odd_times_do_not_crash_it(tmp_path, meshrun_env):
    h = '"host": "h", "pid": 1'
    done = _timeline(tmp_path, meshrun_env, [
        f'{{"t": 1, {h}, "kind": "round_start", "round": 0, "node_rank": []}}',
        f'{{"t": 2, {h}, "kind": "worker_start", "round": 0, "rank": 5, "local_rank": {{}}}}',
        f'{{"t": 3, {h}, "kind": "hang", "round": 0, "culprits": 5, "waiting": "x"}}',
        f'{{"t": NaN, {h}, "kind": "failure", "round": 0, "rank": 0}}',
        f'{{"t": Infinity, {h}, "kind": "failure", "round": 0, "rank": 0}}',
        f'{{"t": 4, {h}, "kind": "failure", "round": 0, "rank": 0, "message": "<b>x</b>"}}',
    ])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "skipped 2 malformed line" in done.stderr
    assert "<b>x</b>" not in (tmp_path / "t.html").read_text()
    json.loads((tmp_path / "t.json").read_text())
