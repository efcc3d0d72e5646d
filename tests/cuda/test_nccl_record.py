"""The collective record on NCCL (issue 48): at world size 1 on one GPU, meshrun's record
reads NCCL's own flight-recorder ring (``_dump_nccl_trace_json``; ProcessGroupNCCL does not
record into the common one that gloo uses) and decodes every call: op, sequence number,
arguments, call site, and the group's backend and completed count. Skipped without CUDA
(conftest.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "cuda" / "workers" / "nccl_record.py"


def _line(mark: str) -> int:
    return next(i for i, line in enumerate(WORKER.read_text().splitlines(), 1) if mark in line)


@pytest.mark.gpus(1)
@pytest.mark.timeout(200)
def test_nccl_calls_are_recorded_decoded(tmp_path):
    logs, done = tmp_path / "logs", tmp_path / "done"
    run = subprocess.run(
        [sys.executable, "-m", "meshrun", "--nproc-per-node", "1", "--log-dir", str(logs),
         str(WORKER), str(done)], cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0 and done.exists(), run.stderr[-4000:]
    (path,) = list(logs.rglob("collectives.json"))
    record = json.loads(path.read_text())
    calls = record["calls"]
    assert [(c["group"], c["seq"]) for c in calls] == [("0", 1), ("0", 2), ("0", 3)], calls
    assert [c["op"] for c in calls][:2] == ["all_reduce", "broadcast"], calls
    assert "gather" in calls[2]["op"], calls
    assert [c["args"] for c in calls][:2] == ["float[4]", "float[4]"], calls
    sites = [f"{WORKER}:{_line(m)}" for m in ("# ALL_REDUCE", "# BROADCAST", "# ALL_GATHER")]
    assert [c["at"] for c in calls] == [f"{sites[0]} in step", f"{sites[1]} in step",
                                        f"{sites[2]} in <module>"], calls  # fmt: skip
    group = record["groups"]["0"]
    assert group["backend"] == "nccl" and group["ranks"] == "0", group
    # NCCL's watchdog marks each call completed (gloo's ring cannot: docs/hangs.md)
    assert group["issued"] == 3 and group["done"] == 3, group
