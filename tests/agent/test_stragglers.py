"""`StepTimes` and `Stragglers`: busy time per step, and the rank its peers wait for; from
meshrun.parallel's wait counter, or from the arrivals in the collective record (any script
that calls ``heartbeat()``: torch's own DDP, end to end)."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from meshrun.agent.stragglers import (
    Arrivals,
    StepTime,
    StepTimes,
    Stragglers,
    arrival_waits,
    arrivals_from_record,
    decode_arrivals,
    decode_step_times,
    encode_step_times,
    with_arrival_waits,
)

pytestmark = pytest.mark.timeout(30)


class Job:
    """A synchronous job: every step lasts as long as the slowest rank's compute; the others
    wait for it inside collectives. ``busy(rank, step)`` -> seconds of compute."""

    def __init__(self, ranks: int, busy, window: int = 8):
        self.ranks, self.busy = ranks, busy
        self.times = StepTimes(window)
        self.now, self.step = 100.0, 0
        self.wait_ns = [0] * ranks
        for r in range(ranks):
            self.times.observe(r, 0, 0, self.now)  # the baseline

    def run_step(self) -> dict[int, StepTime]:
        busy = [self.busy(r, self.step) for r in range(self.ranks)]
        interval = max(busy)
        self.now += interval
        self.step += 1
        for r in range(self.ranks):
            self.wait_ns[r] += round((interval - busy[r]) * 1e9)
            self.times.observe(r, self.step, self.wait_ns[r], self.now)
        return self.times.step_times()


def test_step_and_busy_time_from_counters():
    times = StepTimes(window=4)
    times.observe(0, 0, 0, 10.0)
    assert times.step_times() == {}  # a baseline only
    times.observe(0, 0, 0, 10.05)  # no heartbeat: nothing
    times.observe(0, 2, 60_000_000, 10.2)  # two steps of 0.1 s, 30 ms waiting in each
    (st,) = times.step_times().values()
    assert st.step_s == pytest.approx(0.1) and st.busy_s == pytest.approx(0.07)
    assert st.steps == 2
    times.observe(0, 1, 0, 11.0)  # counters went back (a new worker): a new baseline
    assert times.step_times() == {}


def test_median_shrugs_off_one_slow_step():
    times = StepTimes(window=5)
    times.observe(0, 0, 0, 0.0)
    now = 0.0
    for step, dt in enumerate([0.1, 0.1, 2.0, 0.1, 0.1], start=1):  # a checkpoint at step 3
        now += dt
        times.observe(0, step, 0, now)
    assert times.step_times()[0].step_s == pytest.approx(0.1)


def test_a_rank_with_constant_extra_busy_time_is_flagged_after_min_steps():
    job = Job(4, lambda r, s: 0.02 + (0.05 if r == 2 else 0.0))
    detect = Stragglers(factor=1.5, min_steps=5)
    flagged_at = []
    for _ in range(20):
        for s in detect.check(job.run_step()):
            flagged_at.append((job.step, s))
    ((step, straggler),) = flagged_at
    assert step == 5 and straggler.rank == 2 and straggler.steps == 5
    assert straggler.step_s == pytest.approx(0.07)
    assert straggler.busy_s == pytest.approx(0.07)
    assert straggler.median_s == pytest.approx(0.02)
    assert "rank 2 is a straggler" in straggler.describe() and "70.0 ms" in straggler.describe()


def test_equal_ranks_are_never_flagged():
    rng = random.Random(0)
    job = Job(8, lambda r, s: 0.05 * (1 + 0.05 * rng.random()))
    detect = Stragglers()
    assert not any(detect.check(job.run_step()) for _ in range(50))


def test_noise_within_the_factor_is_not_flagged():
    rng = random.Random(1)
    # rank 0 is 30 % slower, with noise: under 1.5 x the others' median
    job = Job(4, lambda r, s: 0.04 * (1.3 if r == 0 else 1.0) * (1 + 0.1 * rng.random()))
    detect = Stragglers(factor=1.5)
    assert not any(detect.check(job.run_step()) for _ in range(50))


def test_tiny_steps_need_a_real_excess():
    job = Job(2, lambda r, s: 0.003 if r == 1 else 0.0005)  # 6 x, but only 2.5 ms more
    detect = Stragglers(min_busy_s=0.005)
    assert not any(detect.check(job.run_step()) for _ in range(30))


def test_a_slow_rank_that_recovers_is_flagged_once_then_again_only_after_recovering():
    slow_steps = set(range(0, 15)) | set(range(40, 55))
    job = Job(3, lambda r, s: 0.08 if r == 1 and s in slow_steps else 0.02, window=4)
    detect = Stragglers(min_steps=5)
    flagged = []
    for _ in range(70):
        flagged += [(job.step, s.rank) for s in detect.check(job.run_step())]
    assert [rank for _, rank in flagged] == [1, 1]  # once per slow spell
    first, second = (step for step, _ in flagged)
    assert 5 <= first <= 8 and 45 <= second <= 48


def test_across_nodes_and_through_the_store():
    node_a = {0: StepTime(0.1, 0.02, 9), 1: StepTime(0.1, 0.03, 9)}
    node_b = {2: StepTime(0.1, 0.09, 9), 3: StepTime(0.1, 0.02, 9)}
    merged = decode_step_times(encode_step_times(node_a)) | decode_step_times(
        encode_step_times(node_b)
    )
    assert merged == node_a | node_b
    detect = Stragglers(min_steps=1)
    assert [s.rank for s in detect.check(merged)] == [2]
    assert detect.check(merged) == []  # once
    detect.reset()  # a new round
    assert [s.rank for s in detect.check(merged)] == [2]


def test_a_rank_that_is_not_reported_is_forgotten():
    detect = Stragglers(min_steps=3)
    slow = {0: StepTime(0.1, 0.02, 1), 1: StepTime(0.1, 0.09, 1)}
    detect.check(slow)
    detect.check({0: StepTime(0.1, 0.02, 2)})  # rank 1 missing: its streak ends
    assert detect.check({0: StepTime(0.1, 0.02, 3), 1: StepTime(0.1, 0.09, 3)}) == []


@pytest.mark.parametrize(
    "text",
    ["nope", "[]", '{"x": [1, 0, 1]}', '{"0": [1, 0]}', '{"0": [0.1, 0.2, 1]}',
     '{"0": [-1, 0, 1]}', '{"0": [1, 0, -1]}', '{"0": ["1", 0, 1]}', '{"0": [NaN, 0, 1]}'],
)  # fmt: skip
def test_bad_store_values_are_refused(text):
    with pytest.raises(ValueError, match="step times"):
        decode_step_times(text)


def test_bad_arguments():
    with pytest.raises(ValueError):
        StepTimes(window=0)
    with pytest.raises(ValueError):
        Stragglers(factor=1.0)
    with pytest.raises(ValueError):
        Stragglers(min_steps=0)


# --- arrivals: any script that beats (torch's DDP, fully_shard, plain dist calls) -----------


def _arrivals(groups, issued):
    """``issued``: {(group, seq): seconds}; ``groups``: {name: ranks}."""
    return Arrivals({n: tuple(m) for n, m in groups.items()}, issued)


def test_the_last_to_arrive_waits_least_and_the_others_wait_for_it():
    # rank 2 issues every call 0.15 s after ranks 0 and 1
    arrivals = {
        r: _arrivals({"0": [0, 1, 2]},
                     {("0", seq): 10.0 + seq * 0.2 + (0.15 if r == 2 else 0.001 * r)
                      for seq in range(1, 9)})
        for r in range(3)
    }  # fmt: skip
    waits = arrival_waits(arrivals)
    assert waits[2] == pytest.approx(0.0)
    assert waits[0] == pytest.approx(0.15) and waits[1] == pytest.approx(0.149)
    times = {r: StepTime(0.2, 0.2, 40) for r in range(3)}  # no counter: busy = the interval
    adjusted = with_arrival_waits(times, waits)
    assert adjusted[2].busy_s == pytest.approx(0.2) and adjusted[0].busy_s == pytest.approx(0.05)
    detect = Stragglers(min_steps=1)
    assert [s.rank for s in detect.check(adjusted)] == [2]
    assert Stragglers(min_steps=1).check(times) == []  # without arrivals: nothing to tell


def _steps_of(ranks, steps, calls, late_rank, extra, *, first_only, per_step):
    """Arrivals of a synchronous job: each step ``calls`` calls; ``late_rank`` issues them
    ``extra`` s late. ``first_only``: the others wait at the step's first call and are in
    step after it (FSDP's all-gathers, each waited on before the next); else every call of
    the step is issued early and all wait together (DDP's buckets)."""
    out = {}
    for r in range(ranks):
        issued = {}
        for step in range(steps):
            t0 = 100.0 + step * (0.05 + extra)
            for k in range(calls):
                seq = step * calls + k + 1
                if first_only:  # after the first call everybody is in step
                    issued[("0", seq)] = t0 + (extra if k == 0 and r == late_rank else 0.0) + (
                        extra if k > 0 else 0.0) + 0.001 * k  # fmt: skip
                else:  # the late rank issues all of the step's calls late
                    issued[("0", seq)] = t0 + (extra if r == late_rank else 0.0) + 0.001 * k
        out[r] = Arrivals({"0": tuple(range(ranks))}, issued, per_step=per_step)
    return out


@pytest.mark.parametrize("first_only", [True, False], ids=["fsdp-like", "ddp-like"])
def test_a_steps_wait_counts_once_whether_its_calls_wait_in_turn_or_together(first_only):
    arrivals = _steps_of(3, 5, 6, 1, 0.15, first_only=first_only, per_step=6)
    waits = arrival_waits(arrivals)
    assert waits[1] == pytest.approx(0.0, abs=1e-9)
    # DDP-like: from the first bucket issued to the late rank's last (5 ms later than its first)
    expected = 0.15 if first_only else 0.155
    assert waits[0] == pytest.approx(expected) and waits[2] == pytest.approx(expected)
    if first_only:  # without calls per step, a median over calls misses the first one
        unknown = {r: replace(a, per_step=0.0) for r, a in arrivals.items()}
        assert arrival_waits(unknown)[0] == pytest.approx(0.0, abs=1e-9)


def test_a_one_off_pause_is_not_a_steady_wait():
    # rank 0 pauses 5 s once (a checkpoint); the others wait for it at that one call only
    arrivals = _steps_of(2, 30, 1, -1, 0.0, first_only=False, per_step=1)
    for r in (0, 1):
        arrivals[r] = replace(arrivals[r], calls={
            k: t + (5.0 if k[1] >= 10 else 0.0) + (0.0 if r == 0 or k[1] != 10 else -5.0)
            for k, t in arrivals[r].calls.items()})  # fmt: skip
    waits = arrival_waits(arrivals)
    assert waits[1] == pytest.approx(0.0, abs=1e-9) and waits[0] == pytest.approx(0.0, abs=1e-9)


def test_arrivals_compare_only_calls_every_member_recorded():
    # rank 1's record lags: its newest calls are not in it yet; rank 0's oldest fell out
    a0 = _arrivals({"0": [0, 1]}, {("0", s): 1.0 * s for s in range(3, 10)})
    a1 = _arrivals({"0": [0, 1]}, {("0", s): 1.0 * s + 0.1 for s in range(1, 7)})
    waits = arrival_waits({0: a0, 1: a1})
    assert waits == {0: pytest.approx(0.1), 1: pytest.approx(0.0)}
    # a member without a record: its group cannot be compared (its arrival is unknown)
    three = _arrivals({"0": [0, 1, 2]}, {("0", s): 1.0 * s for s in range(1, 9)})
    assert arrival_waits({0: three, 1: three}) == {}
    # too few common calls
    few = {0: _arrivals({"0": [0, 1]}, {("0", 1): 1.0, ("0", 2): 2.0}),
           1: _arrivals({"0": [0, 1]}, {("0", 1): 1.1, ("0", 2): 2.1})}  # fmt: skip
    assert arrival_waits(few) == {}


def test_arrivals_per_group_and_through_the_store():
    # two groups: in "1" (ranks 0, 1) rank 1 is late; in "2" (ranks 2, 3) nobody is
    def rank(r):
        group = "1" if r < 2 else "2"
        late = 0.08 if r == 1 else 0.0
        return _arrivals(
            {group: [0, 1] if r < 2 else [2, 3]},
            {(group, s): 5.0 + s * 0.1 + late for s in range(1, 6)},
        )

    arrivals = {r: rank(r) for r in range(4)}
    text = encode_step_times({r: StepTime(0.1, 0.1, 5) for r in range(4)}, arrivals)
    assert decode_step_times(text) == {r: StepTime(0.1, 0.1, 5) for r in range(4)}
    back = decode_arrivals(text)
    assert back.keys() == arrivals.keys()
    assert back[1].groups == {"1": (0, 1)} and back[1].calls[("1", 3)] == pytest.approx(5.38)
    assert back[1].per_step == 0.0
    waits = arrival_waits(back)
    assert waits[0] == pytest.approx(0.08) and waits[1] == pytest.approx(0.0)
    assert waits[2] == pytest.approx(0.0) and waits[3] == pytest.approx(0.0)
    assert decode_arrivals(encode_step_times({0: StepTime(0.1, 0.1, 5)})) == {}


def test_arrivals_from_a_record_file():
    raw = {"pid": 1, "written_ms": 0, "groups": {"0": {"ranks": "0-2", "issued": 9, "done": 8}},
           "calls": [{"group": "0", "seq": s, "op": "all_reduce", "args": "float[8]",
                      "issued_ms": 1000 + s} for s in range(1, 21)]}  # fmt: skip
    a = arrivals_from_record(raw, last=4)
    assert a.groups == {"0": (0, 1, 2)} and a.issued == 9
    assert sorted(a.calls) == [("0", s) for s in range(17, 21)]
    assert a.calls[("0", 20)] == pytest.approx(1.020)
    assert arrivals_from_record({"groups": {}, "calls": []}) is None
    assert arrivals_from_record("garbage") is None


@pytest.mark.parametrize(
    "text",
    ['{"calls": []}', '{"calls": {"x": {"g": {}, "c": []}}}', '{"calls": {"0": {"g": {}}}}',
     '{"calls": {"0": {"g": {"0": [-1]}, "c": []}}}', '{"calls": {"0": {"g": {}, "c": [[1]]}}}',
     '{"calls": {"0": {"g": {}, "c": [["0", 1, "x"]]}}}', "nope",
     '{"calls": {"0": {"g": {}, "c": [], "s": -1}}}', '{"calls": {"0": {"g": {}, "c": [], "s": "2"}}}'],
)  # fmt: skip
def test_bad_arrivals_from_the_store_are_refused(text):
    with pytest.raises(ValueError, match="step times"):
        decode_arrivals(text)


SCRIPTS = Path(__file__).parent / "e2e_scripts"


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "script, ranks, slow",
    [("ddp_straggler.py", 3, 2), ("ddp_straggler.py", 3, -1), ("fsdp_straggler.py", 2, 1),
     ("fsdp_straggler.py", 2, -1)],
    ids=["ddp-slow", "ddp-balanced", "fsdp2-slow", "fsdp2-balanced"],
)  # fmt: skip
def test_torch_ddp_and_fsdp2_that_beat_get_a_straggler_line_and_a_balanced_run_none(
    launch, script, ranks, slow
):
    """torch's own DistributedDataParallel (3 ranks) or fully_shard (2 ranks) on gloo,
    heartbeat() each step and nothing else of meshrun: one rank sleeps 0.15 s more before
    each forward. Every rank's step interval is the same and no meshrun counter measures a
    wait; the arrivals in the collective record name the slow rank, once (DDP's buckets are
    waited on together, FSDP2's all-gathers in turn); a balanced run gets no line."""
    result = launch.run(["--nproc-per-node", str(ranks), "--hang-timeout", "30",
                         str(SCRIPTS / script), str(slow), "60"], timeout=140)  # fmt: skip
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "is a straggler" in line]
    if slow < 0:
        assert warnings == [], result.stderr
        return
    assert len(warnings) == 1, result.stderr
    m = re.search(rf"rank {slow} is a straggler: busy ([\d.]+) ms of each ([\d.]+) ms step, the "
                  r"other ranks' median ([\d.]+) ms", warnings[0])  # fmt: skip
    assert m, warnings
    busy, step, median = map(float, m.groups())
    assert busy >= 150 and median < busy / 2 and step >= busy, warnings


@pytest.mark.timeout(180)
def test_torch_ddp_straggler_on_another_node_through_the_store(launch):
    """Two agents on 127.0.0.1 (c10d), one rank each: rank 1's arrivals reach node rank 0
    through the store (published with its step times), which names it, on another node."""
    port = launch.free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "straggle",
              "--rdzv-conf", "last_call_timeout=0.5", "--hang-timeout", "30",
              str(SCRIPTS / "ddp_straggler.py"), "1", "80"]  # fmt: skip
    first = launch.start(common)
    launch.wait_for(lambda: first.poll() is not None or _listening(port), 30, what="the store")
    second = launch.start(common)
    outs = [p.communicate(timeout=160) for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], [err for _, err in outs]
    lines = [line for _, err in outs for line in err.splitlines() if "is a straggler" in line]
    assert len(lines) == 1, [err for _, err in outs]
    assert re.search(r"rank 1 is a straggler: busy [\d.]+ ms .* \(rank 1 is on another node\)",
                     lines[0]), lines  # fmt: skip


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
