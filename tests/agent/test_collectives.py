"""The collective record: torch's flight-recorder dump -> the record file -> the first call the
ranks disagree on (meshrun.agent.collectives). Pure logic here; real processes in
test_collective_record.py."""

from __future__ import annotations

import json
import random
import time

import pytest

from meshrun.agent.collective_record import INTERVAL_S, Recorder, make_record, parse_ranges, ranges
from meshrun.agent.collectives import (
    desync_call,
    first_disagreement,
    from_summary,
    read_record,
    summary,
    wait_current,
)

pytestmark = pytest.mark.timeout(30)


def _entry(pg_id, name, seq, op, sizes=((4,),), dtype="Float", p2p=False, t=0):
    """One entry as torch 2.13's _dump_fr_trace_json writes it (the keys the record reads)."""
    return {"pg_id": pg_id, "process_group": [name, "undefined"], "collective_seq_id": seq,
            "profiling_name": f"gloo:{op}", "input_sizes": [list(s) for s in sizes],
            "input_dtypes": [dtype] * len(sizes), "is_p2p": p2p, "time_created_ns": t}  # fmt: skip


def _status(issued, done):
    return {"last_enqueued_collective": str(issued), "last_completed_collective": str(done),
            "last_started_collective": "-1"}  # fmt: skip


def test_make_record_keys_groups_by_name_and_leaves_out_p2p_and_foreign_groups():
    # rank 0 of 4 is in group "2" (ranks 0-1), which its pg_id 1 names; a desync check's
    # helper group "" and p2p calls are not the script's collectives
    dump = {
        "entries": [
            _entry(0, "0", 1, "all_reduce", t=5_000_000),
            _entry(1, "2", 1, "all_gather", sizes=((4, 3),)),
            _entry(1, "2", 0, "send", p2p=True),
            _entry(3, "", 7, "all_gather"),
            _entry(1, "2", 2, "broadcast"),
        ],
        "pg_status": {"0": _status(1, 1), "1": _status(2, 1), "3": _status(7, 7)},
    }
    record = make_record(dump, {"0": "0-3", "2": "0-1"})
    assert record["groups"] == {"0": {"ranks": "0-3", "issued": 1, "done": 1, "backend": "gloo"},
                                "2": {"ranks": "0-1", "issued": 2, "done": 1,
                                      "backend": "gloo"}}  # fmt: skip
    assert [(c["group"], c["seq"], c["op"], c["args"]) for c in record["calls"]] == [
        ("0", 1, "all_reduce", "float[4]"), ("2", 1, "all_gather", "float[4, 3]"),
        ("2", 2, "broadcast", "float[4]"),
    ]  # fmt: skip
    assert record["calls"][0]["issued_ms"] == 5


def test_ranges_round_trip_and_bad_text():
    assert ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert parse_ranges("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    assert parse_ranges("") == []
    with pytest.raises(ValueError):
        parse_ranges("a-b")


def _record(calls, group_ranks="0-2", done=None):
    """A record of the default group "0" from ``calls`` [(op, args)], numbered from 1; the
    last ``done`` calls... all completed unless ``done`` says how many are."""
    n = len(calls)
    raw = {"groups": {"0": {"ranks": group_ranks, "issued": n, "done": n if done is None else done}},
           "calls": [{"group": "0", "seq": i, "op": op, "args": args}
                     for i, (op, args) in enumerate(calls, 1)]}  # fmt: skip
    return from_summary(summary_like(raw))


def summary_like(raw):
    return {"groups": raw["groups"],
            "calls": [[c["group"], c["seq"], c["op"], c["args"]] for c in raw["calls"]]}  # fmt: skip


AR = ("all_reduce", "float[4]")


def test_a_rank_in_another_collective_is_named_with_both_calls_and_sites():
    records = {0: _record([AR, AR], done=1), 1: _record([AR, ("broadcast", "float[4]")], done=1),
               2: _record([AR, AR], done=1)}  # fmt: skip
    found = first_disagreement(records, {1: "train.py:13 in step", 0: "train.py:15 in step"})
    assert found.culprits == (1,)
    assert found.line == (
        "in group 0, rank 1 is at broadcast #2 (float[4]) at train.py:13 in step while "
        "ranks 0, 2 are at all_reduce #2 (float[4]) at train.py:15 in step"
    )


def test_a_rank_that_skipped_is_behind_and_named():
    records = {0: _record([AR], done=1), 1: _record([AR, AR], done=1),
               2: _record([AR, AR], done=1)}  # fmt: skip
    found = first_disagreement(records, {1: "train.py:15 in step"})
    assert found.culprits == (0,)
    assert found.line == (
        "rank 0 never reached all_reduce #2 (float[4]) of group 0 (ranks 0-2), where ranks 1-2 "
        "wait at train.py:15 in step; last call there: rank 0: all_reduce #1"
    )


def test_agreeing_ranks_and_ops_whose_arguments_may_differ_give_nothing():
    same = {r: _record([AR, AR]) for r in range(3)}
    assert first_disagreement(same) is None
    # the root's list in scatter is not the others' argument: not a mismatch
    scatter = {0: _record([("scatter", "float[3, 4]")]), 1: _record([("scatter", "float[4]")])}
    assert first_disagreement(scatter) is None
    # everyone has finished call 2: a rank still at 1 with nobody waiting is not "behind"
    assert first_disagreement({0: _record([AR]), 1: _record([AR, AR])}) is None


def test_only_members_of_a_group_are_compared():
    # rank 2 is not in group "5" (ranks 0-1): it has no status for it and is not behind
    def rec(calls5, done5):
        raw = {"groups": {"0": {"ranks": "0-2", "issued": 1, "done": 1}},
               "calls": [["0", 1, *AR]]}  # fmt: skip
        if calls5:
            raw["groups"]["5"] = {"ranks": "0-1", "issued": len(calls5), "done": done5}
            raw["calls"] += [["5", i, *c] for i, c in enumerate(calls5, 1)]
        return from_summary(raw)

    records = {0: rec([AR, AR], 1), 1: rec([AR, AR], 1), 2: rec([], 0)}
    assert first_disagreement(records) is None
    records[1] = rec([AR], 1)
    found = first_disagreement(records)
    assert found.culprits == (1,) and "of group 5 (ranks 0-1)" in found.line


@pytest.mark.parametrize("seed", range(20))
def test_random_call_sequences_with_one_mistake_name_the_mistaken_rank(seed):
    """Seeded: W ranks make the same random sequence of collectives; one rank, at a random
    call, either skips it (then stops, as a rank that went on with its own work) or makes
    another op there (a mismatch). The finding names that rank and that call number."""
    rng = random.Random(seed)
    world = rng.randint(3, 6)
    ops = [("all_reduce", f"float[{rng.randint(1, 9)}]"), ("broadcast", "float[2]"),
           ("barrier", ""), ("all_gather", "bfloat16[3, 4]")]  # fmt: skip
    calls = [rng.choice(ops) for _ in range(rng.randint(2, 12))]
    bad, at = rng.randrange(world), rng.randrange(len(calls))
    skip = rng.random() < 0.5
    records = {}
    for r in range(world):
        mine = list(calls[: at + 1])
        if r == bad:
            mine = mine[:at] if skip else mine[:at] + [("reduce_scatter", "float[7]")]
        # every rank is stuck in its last call (none completed); the one that skipped is
        # not inside any
        raw = {"groups": {"0": {"ranks": f"0-{world - 1}", "issued": len(mine),
                                "done": max(0, len(mine) - 1)}},
               "calls": [["0", i, *c] for i, c in enumerate(mine, 1)]}  # fmt: skip
        if r == bad and skip:
            raw["groups"]["0"]["done"] = len(mine)
        records[r] = from_summary(raw)
    found = first_disagreement(records)
    assert found is not None and found.culprits == (bad,), (found, bad, at, skip)
    assert f"#{at + 1} " in found.line


def test_summary_keeps_each_groups_last_call_and_rejects_garbage():
    raw = {"groups": {"0": {"ranks": "0-1", "issued": 30, "done": 30},
                      "1": {"ranks": "0-1", "issued": 1, "done": 1}},
           "calls": [{"group": "1", "seq": 1, "op": "barrier", "args": ""}]
           + [{"group": "0", "seq": i, "op": "all_reduce", "args": "float[4]"}
              for i in range(1, 31)]}  # fmt: skip
    record = from_summary(summary_like(raw))
    small = summary(record)
    assert len(json.dumps(small)) < 700
    kept = [tuple(c[:2]) for c in small["calls"]]
    assert ("1", 1) in kept and ("0", 30) in kept and len(kept) == 9
    assert from_summary(small) == from_summary(summary(from_summary(small)))
    for garbage in ({}, [], "x", {"groups": 1, "calls": []}, {"groups": {}, "calls": [[1]]}):
        assert from_summary(garbage) is None


def test_read_record_of_a_missing_or_torn_file_is_none(tmp_path):
    assert read_record(tmp_path / "nope.json") is None
    (tmp_path / "torn.json").write_text('{"groups": {"0": ')
    assert read_record(tmp_path / "torn.json") is None


def test_recorder_writes_nothing_before_torch_distributed_is_initialized(tmp_path):
    recorder = Recorder(str(tmp_path / "collectives.json"), interval=0.05)
    assert recorder.write_once() is False  # no torch.distributed here, or not initialized
    assert not (tmp_path / "collectives.json").exists()


# torch 2.13's own words on rank 1 (the second fingerprint, of rank 0, is decoded wrongly by
# torch when the two differ in their tensors: only the raising rank's own is read)
TORCH_MISMATCH = (
    "RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
    "CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float, "
    "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu)), but Rank 0 is running "
    "collective: CollectiveFingerPrint(SequenceNumber=0OpType=REDUCE).Collectives differ"
)


def test_desync_call_reads_the_raising_ranks_own_fingerprint():
    rank, call = desync_call(TORCH_MISMATCH)
    assert (rank, call.op, call.seq, call.args) == (1, "all_reduce", 2, "float[4]")
    rank, call = desync_call("Detected mismatch between collectives on ranks. Rank 0 is running "
                             "collective: CollectiveFingerPrint(SequenceNumber=1OpType=BARRIER), "
                             "but Rank 1 ...")  # fmt: skip
    assert (rank, call.op, call.seq, call.args) == (0, "barrier", 2, "")
    assert desync_call("RuntimeError: Timed out waiting 4000ms for recv") is None


def test_a_rank_that_died_by_itself_inside_a_call_makes_nobody_behind():
    # rank 0 was SIGKILLed inside all_reduce #2 (the OOM killer); rank 1, slower, had not
    # reached it yet: rank 1 is not the cause (the breaker's find)
    records = {0: _record([AR, AR], done=1), 1: _record([AR], done=1)}
    assert first_disagreement(records).culprits == (1,)  # as if rank 0 still waited
    assert first_disagreement(records, died={0}) is None


def test_uneven_gathers_are_compared_by_op_only():
    records = {0: _record([("all_gather", "float[3]")]), 1: _record([("all_gather", "float[5]")])}
    assert first_disagreement(records) is None
    records[1] = _record([("all_reduce", "float[5]")])
    assert first_disagreement(records).line.startswith("in group 0, ")


def test_entries_of_destroyed_groups_are_left_out():
    dump = {"entries": [{**_entry(0, "0", 1, "barrier", sizes=()), "record_id": 0},
                        {**_entry(0, "0", 2, "barrier", sizes=()), "record_id": 1},
                        {**_entry(2, "0", 1, "all_reduce"), "record_id": 2}],
            "pg_status": {"0": _status(2, 2), "2": _status(1, 0)}}  # fmt: skip
    record = make_record(dump, {"0": "0-1"}, cutoff=1)
    assert [(c["seq"], c["op"]) for c in record["calls"]] == [(1, "all_reduce")]
    assert record["groups"] == {"0": {"ranks": "0-1", "issued": 1, "done": 0, "backend": "gloo"}}


def test_desync_line_names_the_call_within_its_own_group():
    from meshrun.agent.collectives import desync_line

    _, call = desync_call(TORCH_MISMATCH)
    assert desync_line({1: call}, {1: "t.py:3 in f"}) == (
        "rank 1 called all_reduce #2 of its group (float[4]) at t.py:3 in f, which another "
        "rank did not (torch's fingerprint check, TORCH_DISTRIBUTED_DEBUG=DETAIL)")


def test_recorder_leaves_out_the_calls_of_a_destroyed_group(tmp_path, monkeypatch, launch):
    """A real gloo group of one, in this process: two calls, destroy, init again, one call;
    the record then holds the new group's call only (the ring outlives the group)."""
    import torch
    import torch.distributed as dist

    free_port = launch.free_port

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    path = tmp_path / "collectives.json"
    recorder = Recorder(str(path))
    init = dict(backend="gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dist.init_process_group(**init)
    try:
        dist.all_reduce(torch.ones(2))
        dist.barrier()
        assert recorder.write_once()
        assert [c.op for c in read_record(path).calls] == ["all_reduce", "barrier"]
        dist.destroy_process_group()
        init["init_method"] = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group(**init)
        dist.all_reduce(torch.ones(3))
        assert recorder.write_once()
        record = read_record(path)
        assert [(c.seq, c.op, c.args) for c in record.calls] == [(1, "all_reduce", "float[3]")]
        assert record.groups["0"].issued == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_agent_waits_for_a_look_after_it_began_stopping(tmp_path, monkeypatch, launch):
    """A rank about to be stopped may have entered its last call since its thread's last look:
    `wait_current` returns once the thread looked again (an unchanged ring marks the file
    current), and gives up after one interval and a margin where nobody looks."""
    import torch
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    path = tmp_path / "collectives.json"
    init_method = f"tcp://127.0.0.1:{launch.free_port()}"
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    recorder = Recorder(str(path), interval=0.1).start()
    try:
        dist.all_reduce(torch.ones(2))
        deadline = time.time() + 10
        while read_record(path) is None and time.time() < deadline:
            time.sleep(0.02)
        since = time.time() + 0.05  # after the first write: only a later look counts
        wait_current([path], since)
        assert path.stat().st_mtime >= since and time.time() < since + 0.4
        last = read_record(path).calls[-1]  # (this process's ring holds earlier tests' too)
        assert (last.op, last.args) == ("all_reduce", "float[2]")
    finally:
        recorder.stop()
        dist.destroy_process_group()
    began = time.time()
    wait_current([tmp_path / "never-written.json"], began)
    assert INTERVAL_S + 0.3 <= time.time() - began < INTERVAL_S + 1.0


def test_a_new_group_at_a_destroyed_groups_address_ends_the_old_calls():
    """CPython hands a freed object's address to the next one of its size, so a group made
    right after another was destroyed may have its ``id()``: the recorder must still see the
    old group gone (CI once kept a destroyed group's calls this way). Groups here are plain
    objects in a stand-in of torch's ``_world``, so the address is reused on purpose."""
    from types import SimpleNamespace

    class Group:  # weakly referenceable, as torch's ProcessGroup is
        pass

    world = SimpleNamespace(pg_names={})
    dist = SimpleNamespace(distributed_c10d=SimpleNamespace(_world=world),
                           get_process_group_ranks=lambda pg: [0])  # fmt: skip
    ring = {"entries": [{"record_id": 0}, {"record_id": 1}]}
    # another thread of the test process (pytest-xdist's) may take the freed address first:
    # the case is tried until the address is reused, as it nearly always is at once
    for _ in range(50):
        recorder = Recorder("unused")
        old = Group()
        world.pg_names = {old: "0"}
        recorder._group_ranks(dist, ring)
        address = id(old)
        world.pg_names = {}
        del old
        new = Group()
        if id(new) == address:
            break
    assert id(new) == address, "the allocator did not reuse the address: the case is not made"
    world.pg_names = {new: "0"}
    recorder._group_ranks(dist, {"entries": ring["entries"] + [{"record_id": 2}]})
    assert recorder._cutoff == {"0": 1}


def test_recorder_keeps_each_group_to_its_own_lifetime(tmp_path, monkeypatch, launch):
    """A real gloo group of one: a call after the recorder's last look, destroy, init again,
    one call: the record holds the new group's call only (its sequence numbers start again);
    a subgroup destroyed meanwhile takes only its own calls with it, not the world group's."""
    import torch
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    path = tmp_path / "collectives.json"
    recorder = Recorder(str(path))
    init = dict(backend="gloo", rank=0, world_size=1)
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{launch.free_port()}", **init)
    try:
        dist.all_reduce(torch.ones(3))
        assert recorder.write_once()
        dist.all_reduce(torch.ones(5))  # not looked at before the group goes
        dist.destroy_process_group()
        dist.init_process_group(init_method=f"tcp://127.0.0.1:{launch.free_port()}", **init)
        dist.all_reduce(torch.ones(2))
        assert recorder.write_once()
        assert [(c.group, c.seq, c.args) for c in read_record(path).calls] == [
            ("0", 1, "float[2]")]

        sub = dist.new_group([0])
        dist.all_reduce(torch.ones(4), group=sub)
        dist.all_reduce(torch.ones(6))
        assert recorder.write_once()
        dist.destroy_process_group(sub)
        dist.all_reduce(torch.ones(7))
        assert recorder.write_once()
        calls = [(c.group, c.seq, c.args) for c in read_record(path).calls]
        assert calls == [("0", 1, "float[2]"), ("0", 2, "float[6]"), ("0", 3, "float[7]")]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_worker_without_the_torch_door_runs_on_unrecorded(tmp_path):
    """The recorder loaded by path (as meshrun's sitecustomize does) where meshrun/_torch.py
    is not beside it: one line on stderr, no recorder, and the worker carries on."""
    import shutil
    import subprocess
    import sys

    import meshrun.agent.collective_record as worker_side

    (tmp_path / "agent").mkdir()  # the door would be tmp_path/_torch.py: absent
    copy = tmp_path / "agent" / "collective_record.py"
    shutil.copy(worker_side.__file__, copy)
    script = ("import importlib.util, sys\n"
              f"spec = importlib.util.spec_from_file_location('_meshrun_collectives', {str(copy)!r})\n"
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
              "print(m.start_recorder_from_env(), 'ran on')\n")  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "MESHRUN_COLLECTIVE_RECORD": str(tmp_path / "rec.json")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=20, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "None ran on", done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrun: the collective record is off"), lines


def test_an_all_gather_of_another_dtype_is_a_mismatch_and_uneven_shapes_are_not():
    """Found by a breaker: rank 1 all-gathers int32 where rank 0 gathers float32 of the same
    bytes; gloo returns garbage and nothing failed. Shapes of an all_gather may differ (lists,
    NCCL's uneven gathers), dtypes never do."""
    same_bytes = {0: _record([AR, ("all_gather", "float[4]")]),
                  1: _record([AR, ("all_gather", "int[4]")])}  # fmt: skip
    found = first_disagreement(same_bytes)
    assert found is not None and "all_gather #2" in found.line, found
    uneven = {0: _record([AR, ("all_gather", "float[4]")]),
              1: _record([AR, ("all_gather", "float[6]")])}  # fmt: skip
    assert first_disagreement(uneven) is None
