"""Seeded generators of hangs whose culprits are known, checked against the verdict.

Two levels, one ground truth each:

- **records**: every rank's collective record and stack place, as the agent reads them,
  generated for 2-6 ranks, gloo or NCCL, and the place each framework's stack gives a rank
  that waits (plain torch: a ``torch.distributed`` frame; torch's DDP and FSDP2: autograd's
  or FSDP's frames, which name no collective). Hundreds of cases, no processes.
- **real runs**: ``meshrun --hang-timeout`` over a training loop with one planted fault
  (``e2e_scripts/hang_cases.py``) under plain torch, torch's DDP, torch's fully_shard and
  meshrun.parallel.ddp, 2-4 ranks. ``MESHRUN_HANG_CASES=N`` runs N of them (default 6), and
  ``MESHRUN_HANG_SEED`` picks another draw.

Faults: a stall in the culprits' own code (any number of culprits short of all), one batch
fewer (the culprits go to the end-of-epoch barrier), another op, an extra call (the last three
leave the culprits a strict minority: with as many ranks on each side of a mismatch the
records cannot tell which side is wrong, and the verdict must then name nobody).
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest

from meshrun.agent.collective_record import ranges
from meshrun.agent.collectives import from_summary, summary
from meshrun.agent.errors import WorkerFailure, culprits, placed
from meshrun.agent.verdicts import Place, Rule

SCRIPT = Path(__file__).parent / "e2e_scripts" / "hang_cases.py"
SEED = int(os.environ.get("MESHRUN_HANG_SEED", "48"))

# --- records ---------------------------------------------------------------------------------

OPS = [("all_reduce", "float[81]"), ("all_reduce", "float[1]"), ("all_gather", "float[27]"),
       ("broadcast", "float[4]")]  # fmt: skip
KINDS = ("own", "fewer", "other_op", "extra", "skip_then_same")


def _draw(rng: random.Random) -> tuple[int, str, list[int]]:
    """(world size, fault, culprits): a strict minority where the fault is a mismatch."""
    kind = rng.choice(KINDS)
    if kind in ("own", "skip_then_same"):
        n = rng.randint(2, 6)
        k = rng.randint(1, n - 1)
    else:
        n = rng.randint(3, 6)
        k = rng.randint(1, (n - 1) // 2)
    return n, kind, sorted(rng.sample(range(n), k))


def _records(rng: random.Random, n: int, kind: str, bad: list[int], framework: str,
             backend: str) -> list[WorkerFailure]:  # fmt: skip
    """Every rank's record and place when the hang is seen, for a fault after ``prefix`` good
    calls: each call is (op, args); the culprits' sequences differ as ``kind`` says."""
    prefix = [rng.choice(OPS) for _ in range(rng.randint(0, 6))]
    step = rng.choice(OPS)
    good = [*prefix, step]  # the others issue the step's call and wait in it
    if kind == "own":
        mine = list(prefix)  # stalled in its own code before the step
    elif kind == "fewer":
        mine = [*prefix, ("barrier", "")]  # left the loop for the end-of-epoch barrier
    elif kind == "other_op":
        other = next(o for o in OPS if o[0] != step[0])
        mine = [*prefix, other]
    elif kind == "extra":
        mine = [*prefix, ("all_reduce", "float[3]")]  # an op and shape nobody else calls
    else:  # skipped one call, then made the others' next (identical) call, then stalled
        good = [*prefix, step, step, step]
        mine = [*prefix, step, step]
    failures = []
    for r in range(n):
        calls = mine if r in bad else good
        issued = len(calls)
        waits = r not in bad or kind not in ("own", "skip_then_same")
        done = issued - 1 if waits else issued
        if backend == "gloo" and framework in ("ddp", "fsdp2") and rng.random() < 0.8:
            done = max(0, issued - rng.randint(1, 3))  # async calls never marked completed
        raw = {"groups": {"0": {"ranks": f"0-{n - 1}", "issued": issued, "done": done,
                                "backend": backend}},
               "calls": [[ "0", i, op, args, f"train.py:{10 + i} in step"]
                         for i, (op, args) in enumerate(calls, 1)][-8:]}  # fmt: skip
        if not waits:
            state, op, at = Place.RUNNING, "", "train.py:5 in read_batch"
        elif framework == "plain":
            state, op, at = Place.WAITING, calls[-1][0], "train.py:30 in step"
        else:  # DDP's reducer and FSDP2's hooks: the main thread shows no collective
            state, op, at = Place.RUNNING, "", "train.py:30 in step (inside graph.py:9 in x)"
        failures.append(WorkerFailure(
            local_rank=r, global_rank=r, pid=1000 + r, exitcode=124, timestamp_ms=1000 + r,
            source="stack", stopped=r % 2 == 1, state=state, collective=op, at=at,
            calls=summary(from_summary(raw)),
        ))  # fmt: skip
    return failures


def test_the_verdict_names_the_planted_culprits_over_generated_records():
    rng = random.Random(SEED)
    seen = set()
    for case in range(600):
        n, kind, bad = _draw(rng)
        framework = rng.choice(("plain", "ddp", "fsdp2", "meshrun"))
        backend = rng.choice(("gloo", "nccl"))
        failures = _records(rng, n, kind, bad, framework, backend)
        blamed, why = culprits(failures)
        assert blamed == bad, (case, n, kind, framework, backend, bad, blamed, why)
        assert why.rule in (Rule.RECORD_BEHIND, Rule.RECORD_MISMATCH, Rule.OUTSIDE)
        # every rank that waits for the culprits is placed waiting, whatever its stack says
        for f in placed(failures):
            if f.global_rank not in bad and kind != "own":
                assert f.state == Place.WAITING, (case, f)
        seen.add((kind, len(bad) > 1))
    # the draw covers every fault, and minorities of several ranks
    assert {k for k, _ in seen} == set(KINDS) and ("own", True) in seen and ("fewer", True) in seen


def test_a_mismatch_with_equal_sides_names_nobody():
    rng = random.Random(SEED)
    failures = _records(rng, 4, "other_op", [0, 1], "ddp", "gloo")
    blamed, why = culprits(failures)
    assert blamed == [] and why.rule is Rule.NONE


# --- real runs -------------------------------------------------------------------------------

FRAMEWORKS = ("plain", "ddp", "fsdp2", "meshrun")
REAL_KINDS = ("own", "fewer", "other_op", "extra")


def _real_cases(count: int) -> list[tuple[str, str, int, list[int], int]]:
    rng = random.Random(SEED)
    cases = []
    combos = [(f, k) for f in FRAMEWORKS for k in REAL_KINDS]
    rng.shuffle(combos)
    for framework, kind in combos[:count]:
        if kind == "own":
            n = rng.randint(2, 4)
            bad = sorted(rng.sample(range(n), rng.randint(1, n - 1)))
        else:
            n = rng.randint(3, 4)
            bad = [rng.randrange(n)]
        cases.append((framework, kind, n, bad, rng.randint(1, 3)))
    if count >= 2 and not any(len(c[3]) > 1 for c in cases):  # several culprits at least once
        framework, _, _, _, step = cases[0]
        cases[0] = (framework, "own", 4, [0, 2], step)
    return cases


CASES = _real_cases(int(os.environ.get("MESHRUN_HANG_CASES", "6")))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("framework", "kind", "n", "bad", "step"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}ranks-bad{'_'.join(map(str, c[3]))}" for c in CASES])  # fmt: skip
def test_a_real_hang_names_its_planted_culprits(launch, framework, kind, n, bad, step):
    result = launch.run(
        ["--nproc-per-node", str(n), "--hang-timeout", "3", "--max-restarts", "0",
         "--shutdown-timeout", "2", str(SCRIPT), framework, kind, ",".join(map(str, bad)),
         str(step)], timeout=100,
    )  # fmt: skip
    err = result.stderr
    assert result.returncode == 124, err
    line = re.search(r"hang: likely cause (.*?) \(([^()]*)\); waiting: ranks (.*)$", err, re.M)
    assert line, err
    named = sorted(int(r) for r in re.findall(r"(?:^|; )rank (\d+) at", line[1]))
    assert named == bad, err
    waiting = sorted(set(range(n)) - set(bad))
    assert kind == "own" or line[3] == ranges(waiting, sep=", "), err
    report = err[err.index("Root cause") :]
    assert f"  rank       : {bad[0]} (" in report, report
    for r in waiting:  # placed by the record's pending call, wherever its Python frame was
        if kind != "own":
            assert re.search(rf"rank {r} \(host .*\): waiting in \w+ #\d+", report), report


# --- shapes the generator does not draw (found by a breaker, 2026-12-08) -----------------------


def _rank(r, groups, calls, state=Place.RUNNING, op="", stopped=True):
    """One rank's record: ``groups`` {name: (ranks, issued, done)}, ``calls`` [(group, op)]
    numbered per group from 1."""
    seq: dict[str, int] = {}
    rows = []
    for g, o in calls:
        seq[g] = seq.get(g, 0) + 1
        rows.append([g, seq[g], o, "float[4]", ""])
    raw = {"groups": {n: {"ranks": ranks, "issued": i, "done": d, "backend": "gloo"}
                      for n, (ranks, i, d) in groups.items()}, "calls": rows}  # fmt: skip
    return WorkerFailure(local_rank=r, global_rank=r, pid=100 + r, exitcode=124,
                         timestamp_ms=1000 + r, source="stack", stopped=stopped, state=state,
                         collective=op, at="t.py:1 in f", calls=summary(from_summary(raw)))  # fmt: skip


def test_a_rank_waiting_for_its_stuck_partner_in_a_pair_group_is_not_the_cause():
    """World all_reduce then a pair all_reduce each step; rank 3 stalls in its own code. Rank 2
    waits in the pair group for rank 3, ranks 0-1 in the world group for ranks 2-3: only rank
    3 is waited for and waits for nobody."""
    step = [("0", "all_reduce"), ("p", "all_reduce")]
    world = "0-3"
    f = [
        _rank(0, {"0": (world, 5, 4), "q": ("0-1", 4, 4)}, [("0", "all_reduce"), ("q", "all_reduce")] * 4 + [("0", "all_reduce")], Place.WAITING, "all_reduce"),
        _rank(1, {"0": (world, 5, 4), "q": ("0-1", 4, 4)}, [("0", "all_reduce"), ("q", "all_reduce")] * 4 + [("0", "all_reduce")], Place.WAITING, "all_reduce"),
        _rank(2, {"0": (world, 4, 4), "p": ("2-3", 4, 3)}, step * 4, Place.WAITING, "all_reduce"),
        _rank(3, {"0": (world, 4, 4), "p": ("2-3", 3, 3)}, step * 3 + [("0", "all_reduce")]),
    ]  # fmt: skip
    blamed, why = culprits(f)
    assert blamed == [3] and why.rule is Rule.OUTSIDE, (blamed, why)


def test_calls_in_another_order_across_two_groups_name_the_odd_rank():
    """DDP on a second all-ranks group, the loss on the default one; rank 1 has a batch fewer
    and waits in the default group's barrier while ranks 0 and 2 wait in DDP's all-reduce."""
    ddp, loss = ("1", "all_reduce"), ("0", "all_reduce")
    f = [
        _rank(0, {"0": ("0-2", 5, 5), "1": ("0-2", 6, 5)}, [ddp, loss] * 5 + [ddp], Place.RUNNING),
        _rank(1, {"0": ("0-2", 6, 5), "1": ("0-2", 5, 5)}, [ddp, loss] * 5 + [("0", "barrier")], Place.WAITING, "barrier"),
        _rank(2, {"0": ("0-2", 5, 5), "1": ("0-2", 6, 5)}, [ddp, loss] * 5 + [ddp], Place.RUNNING),
    ]  # fmt: skip
    blamed, why = culprits(f)
    assert blamed == [1] and why.rule is Rule.RECORD_MISMATCH, (blamed, why)


def test_a_running_rank_that_made_every_call_is_not_outside():
    """One node's view: both local DDP ranks made all_reduce #11, which broke under them when
    the other node stopped (counted completed); one stack shows a collective frame, the other
    autograd. Nobody here is the cause."""
    groups = {"0": ("0-3", 11, 11)}
    calls = [("0", "all_reduce")] * 11
    f = [_rank(0, groups, calls, Place.RUNNING), _rank(1, groups, calls, Place.WAITING, "all_reduce")]
    blamed, why = culprits(f)
    assert blamed == [] and why.rule is Rule.NONE, (blamed, why)
