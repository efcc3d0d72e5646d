"""In-place recovery (docs/design.md §3.8, issue 22): a node dies and the survivors keep their
processes.

Two `meshrun` agents on 127.0.0.1, c10d (the first hosts the store and survives): the
survivor runs two workers, the other node one. Once the three ranks train, the other node dies
whole (SIGKILL of its agent and its worker at once). Under ``examples/train_char_lm.py
--elastic in-place`` the survivor's agent joins the next round without stopping its workers
(`meshrun.in_place`), they change world (`meshrun.parallel.elastic`) and retry the step. A few
steps later a third node joins: the survivors change world again at a step boundary and the
joiner's fresh worker receives the state from them by broadcast. No survivor's worker is ever
started again (the events file lists the same two worker pids), every step's loss equals that
of one process training on the whole global batch (the reference), none lost and none
repeated, and at the end the three replicas' parameters are equal bit for bit. Two losses in
quick succession (the second while the survivor joins the round without the first) cost no
restart either. A worker that opted in but never confirms is stopped and started again in
the new round (the fallback).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import free_port

from tests.rendezvous.etcd_fixtures import ETCD, SKIP_REASON, EtcdCluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_char_lm.py"
IGNORER = Path(__file__).resolve().parent / "scripts" / "in_place_ignorer.py"
DIES_BEFORE_CONFIRMING = Path(__file__).resolve().parent / "scripts" / "dies_before_confirming.py"
STEPS, KILL_AFTER, JOIN_AFTER = 24, 4, 6
TRAIN = ("--steps", str(STEPS), "--batch-size", "4", "--global-batch-size", "12",
         "--log-every", "1")
STEP_LINE = re.compile(r"step (\d+) \| loss ([0-9.]+)")
# detection in 1 s (0.25 s x 4), a last call long enough for the second agent to join round 0
CONF = "keep_alive_interval=0.25,keep_alive_max_attempt=4,last_call_timeout=1.5,join_timeout=60"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "MESHRUN_"))
           and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            **extra}


class Node:
    """One agent in a session of its own; its output in ``<tmp>/<name>.out``."""

    def __init__(self, tmp: Path, name: str, port: int | None, nproc: int, is_host: bool,
                 script: list[str], nnodes: str = "1:2", etcd: str = "",
                 launcher_args: tuple[str, ...] = (), **env: str):
        self.out = tmp / f"{name}.out"
        self.log_dir = tmp / f"logs_{name}"
        rdzv = (["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd, "--rdzv-conf", CONF]
                if etcd else
                ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-conf", f"{CONF},is_host={int(is_host)}"])
        cmd = [sys.executable, "-m", "meshrun", "--nnodes", nnodes, "--nproc-per-node",
               str(nproc), *rdzv, "--rdzv-id", "inplace", *launcher_args,
               "--monitor-interval", "0.1", "--shutdown-timeout", "3", "--log-dir",
               str(self.log_dir), *script]
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(cmd, env=_env(**env), cwd=tmp, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.out.read_text()

    def events(self) -> list[dict]:
        return [json.loads(line) for f in self.log_dir.rglob("events.jsonl")
                for line in f.read_text().splitlines()]

    def kill(self) -> None:
        """SIGKILL the agent and every process under it at once: the host is gone."""
        try:
            agent = psutil.Process(self.proc.pid)
            victims = [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            victims = []
        for p in victims:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(10)


@contextlib.contextmanager
def _stopped_at_end(nodes: list[Node]):
    """Kill every node of ``nodes`` (appended to on the way too) still running at the end."""
    try:
        yield nodes
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _wait(predicate, what: str, timeout: float, nodes) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n.out.name} ---\n{n.text()}" for n in nodes)
            raise AssertionError(f"{what} did not happen in {timeout} s\n{logs}")
        time.sleep(0.05)


def _two_nodes(tmp: Path, script: list[str], survivor_nproc: int, **env: str):
    port = free_port()
    first = Node(tmp, "first", port, survivor_nproc, True, script,
                 launcher_args=("--node-rank", "0"), **env)
    _wait(lambda: _accepts(port), "the c10d store", 60, [first])
    second = Node(tmp, "second", port, 1, False, script, launcher_args=("--node-rank", "1"),
                  **env)
    first.port = port
    return first, second


def _checkpointed(tmp: Path, every: int) -> tuple[Path, list[str]]:
    """The example in place with a pause per step and a checkpoint every ``every`` steps."""
    checkpoints = tmp / "ckpt"
    return checkpoints, [str(EXAMPLE), "--elastic", "in-place", *TRAIN, "--sleep-per-step",
                         "0.25", "--checkpoint-dir", str(checkpoints), "--checkpoint-every",
                         str(every)]


def _losses(text: str) -> dict[int, list[float]]:
    found: dict[int, list[float]] = {}
    for m in STEP_LINE.finditer(text):
        found.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    return found


def _worker_pids(node: Node) -> dict[int, set[int]]:
    """round -> the worker pids the agent started in it (its ``worker_start`` events; those
    of a process that took a round in place say so and are left out)."""
    pids: dict[int, set[int]] = {}
    for e in node.events():
        if e["kind"] == "worker_start" and not e.get("in_place"):
            pids.setdefault(e["round"], set()).add(e["worker_pid"])
    return pids


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[int, float]:
    """Each step's loss of one process training on the whole global batch (the reference)."""
    reference = subprocess.run([sys.executable, str(EXAMPLE), *TRAIN], env=_env(),
                               cwd=tmp_path_factory.mktemp("reference"), capture_output=True,
                               text=True, timeout=120)
    assert reference.returncode == 0, reference.stderr
    losses = {s: v[0] for s, v in _losses(reference.stdout).items()}
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _same_curve(text: str, expected: dict[int, float]) -> None:
    """Every step logged once, each loss the reference's (none lost, none repeated)."""
    got = _losses(text)
    assert sorted(got) == list(range(1, STEPS + 1)), f"steps lost or repeated: {got}"
    assert all(len(v) == 1 for v in got.values()), f"a step printed twice: {got}"
    for step, value in expected.items():
        assert all(v == pytest.approx(value, abs=2e-4) for v in got[step]), (step, got)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp_mode", ["ddp", "fsdp"])
def test_survivors_keep_their_processes_and_every_step(tmp_path, expected, dp_mode):
    # a pause per step: the joiner's agent (seconds to start) must come before the last step
    # with checkpoints: the saves are collectives of the changing world, and the joiner takes
    # the survivors' state without reading the disk. fsdp: the lost node's shards come from
    # the neighbour copies (meshrun.parallel.fsdp.copies), refreshed at every step's end
    checkpoints, script = _checkpointed(tmp_path, every=4)
    script += ["--dp-mode", dp_mode]
    first, second = _two_nodes(tmp_path, script, 2)
    nodes = [first, second]
    with _stopped_at_end(nodes):
        _wait(lambda: re.search(rf"step {KILL_AFTER} \| loss [0-9.]+ .*\| world 3",
                                first.text()), f"step {KILL_AFTER} at world 3", 90, nodes)
        before = _worker_pids(first)
        second.kill()
        _wait(lambda: re.search(rf"step {JOIN_AFTER} \| loss [0-9.]+ .*\| world 2",
                                first.text()), f"step {JOIN_AFTER} at world 2", 60, nodes)
        # the newest "checkpoint" is damaged: a joiner that read the disk would fail on it
        (checkpoints / "step_999").mkdir()
        (checkpoints / "step_999" / ".metadata").write_bytes(b"not a checkpoint")
        third = Node(tmp_path, "third", first.port, 1, False, script)
        nodes.append(third)
        assert first.proc.wait(90) == 0, first.text()
        assert third.proc.wait(30) == 0, third.text()

    text = first.text()
    assert text.count("every worker confirmed in place") == 2, text
    assert "restarting the worker group" not in text.split("world size 3")[1], text
    after = _worker_pids(first)
    assert after == before, (before, after)  # no worker started after the kill or the join
    rounds = [e for e in first.events() if e["kind"] == "round_start"]
    assert [(r["world_size"], r.get("in_place", False)) for r in rounds[-2:]] == [
        (2, True), (3, True)], rounds
    kept = {e["worker_pid"] for e in first.events() if e["kind"] == "worker_start"
            and e.get("in_place") and e["round"] == rounds[-1]["round"]}
    assert kept == before[rounds[0]["round"]], (kept, before)  # the same two processes
    worlds = [int(w) for w in re.findall(r"step \d+ \| loss .*\| world (\d+) ", text)]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3, worlds  # lost, then joined
    if dp_mode == "ddp":
        _same_curve(text, expected)
        assert "parameters identical on all 3 ranks: yes" in text, text
    else:  # the lost rank's rows from its keeper, at the failed step's start; then the join
        restored = re.findall(r"restored the fully sharded state of step (\d+) from memory "
                              r"\(the rows of the old world's (\d) shards", text)
        assert [int(n) for _, n in restored] == [3, 2], text
        # a step is printed once its copies are out: the restore is of a printed step or
        # later, and no printed step is trained again
        assert KILL_AFTER <= int(restored[0][0]) <= KILL_AFTER + 2, restored
        _same_curve(text, expected)
    kept = sorted(n for n in os.listdir(checkpoints) if n.startswith("step_"))
    assert kept == [f"step_{STEPS}", "step_999"], kept  # the saves went on; nobody loaded


@pytest.mark.timeout(180)
@pytest.mark.parametrize("die_at", [KILL_AFTER, STEPS + 1])
def test_a_node_lost_between_its_copies_and_their_confirmation(tmp_path, expected, die_at):
    # fsdp: the node dies once the copies of step `die_at` were exchanged, before the
    # all-reduce that confirms them: every survivor holds them, so that step is restored
    # from memory as done and printed once (a rank that decided "not done" before the restore
    # skipped its line). STEPS + 1: the attempt after the last step (the example's end),
    # which has no collective of its own without checkpoints: the survivors leaving the loop
    # while their peer is being lost made the agent restart the group from step 0
    script = [str(DIES_BEFORE_CONFIRMING), "--elastic", "in-place", "--dp-mode", "fsdp",
              *TRAIN]
    first, second = _two_nodes(tmp_path, script, 2, DIE_AT_STEP=str(die_at))
    with _stopped_at_end([first, second]):
        assert first.proc.wait(120) == 0, first.text()
        second.proc.wait(30)
    text = first.text()
    assert f"restored the fully sharded state of step {die_at} from memory" in text, text
    assert "restarting the worker group" not in text, text
    _same_curve(text, expected)


@pytest.mark.timeout(180)
def test_a_group_restarted_after_all_resumes_from_the_newest_checkpoint(tmp_path, expected):
    """--elastic in-place with --checkpoint-dir, and a handover that fails (one survivor
    worker SIGSTOPped as the other node dies, so it cannot confirm within 1 s): the agent
    restarts the survivor's workers as without in-place recovery, and the fresh workers resume
    from the newest checkpoint (read by each rank alone), not from step 0. Every loss printed,
    before and after, is the reference's at its step."""
    checkpoints, script = _checkpointed(tmp_path, every=4)
    first, second = _two_nodes(tmp_path, script, 2, MESHRUN_IN_PLACE_TIMEOUT="1")
    nodes = [first, second]
    with _stopped_at_end(nodes):
        _wait(lambda: re.search(r"step 6 \| loss [0-9.]+ .*\| world 3", first.text()),
              "step 6 at world 3", 90, nodes)
        (survivors,) = _worker_pids(first).values()
        second.kill()
        os.kill(max(survivors), signal.SIGSTOP)  # the agent's stop sends SIGCONT after SIGTERM
        assert first.proc.wait(90) == 0, first.text()
    text = first.text()
    assert "in-place handover failed" in text, text
    resumed = re.search(r"resumed from step (\d+) .*; global batch 12", text)
    assert resumed and int(resumed.group(1)) in (4, 8), text
    got = _losses(text)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    for step, values in got.items():  # the steps after the checkpoint were trained twice
        assert all(v == pytest.approx(expected[step], abs=2e-4) for v in values), (step, got)
    assert any(len(v) == 2 for v in got.values()), got  # and the restart did happen


@pytest.mark.timeout(180)
def test_a_node_lost_at_the_end_costs_no_restart(tmp_path, expected):
    """The other node dies right after the last step: the survivors' end (the last save, the
    replicas' check: collectives) is an attempt like a step, so it is retried in the new world
    instead of failing the workers (a restart from the last periodic checkpoint before)."""
    checkpoints, script = _checkpointed(tmp_path, every=10)
    first, second = _two_nodes(tmp_path, script, 2)
    nodes = [first, second]
    with _stopped_at_end(nodes):
        _wait(lambda: re.search(rf"step {STEPS} \| loss [0-9.]+ .*\| world 3", first.text()),
              f"step {STEPS} at world 3", 90, nodes)
        before = _worker_pids(first)
        second.kill()  # during the last step's pause: before the end's collectives
        assert first.proc.wait(60) == 0, first.text()
    text = first.text()
    assert "every worker confirmed in place" in text, text
    assert "restarting the worker group" not in text, text
    assert _worker_pids(first) == before
    after_loss = text.split("world size 2", 1)[1]
    assert f"saved {checkpoints / f'step_{STEPS}'}" in after_loss, text
    assert "parameters identical on all 2 ranks: yes" in after_loss, text
    _same_curve(text, expected)


@pytest.mark.timeout(180)
def test_two_losses_in_quick_succession(tmp_path, expected):
    # three nodes of one worker; the second dies, and the third's worker stops (SIGSTOP) at
    # once, so the survivor's worker waits in the new round's init_process_group for a rank
    # that never comes; then the third node dies too: the survivor's agent closes that
    # round's store as it moves on, and its worker takes the round after it
    script = [str(EXAMPLE), "--elastic", "in-place", *TRAIN, "--sleep-per-step", "0.1"]
    port = free_port()
    first = Node(tmp_path, "first", port, 1, True, script, nnodes="1:3",
                 launcher_args=("--node-rank", "0"))
    nodes = [first]
    with _stopped_at_end(nodes):
        _wait(lambda: _accepts(port), "the c10d store", 60, nodes)
        nodes += [Node(tmp_path, name, port, 1, False, script, nnodes="1:3",
                       launcher_args=("--node-rank", str(i)))
                  for i, name in ((1, "second"), (2, "third"))]
        _wait(lambda: re.search(rf"step {KILL_AFTER} \| loss [0-9.]+ .*\| world 3",
                                first.text()), f"step {KILL_AFTER} at world 3", 90, nodes)
        before = _worker_pids(first)
        nodes[1].kill()
        for worker in psutil.Process(nodes[2].proc.pid).children():
            if str(EXAMPLE) in " ".join(worker.cmdline()):
                worker.send_signal(signal.SIGSTOP)
        _wait(lambda: re.search(r"world size 2, .*handed to the running workers",
                                first.text()), "the round without the second node", 60, nodes)
        nodes[2].kill()
        assert first.proc.wait(90) == 0, first.text()
    text = first.text()
    assert _worker_pids(first) == before, first.events()  # never restarted
    assert "restarting the worker group" not in text.split("world size 3")[1], text
    assert re.search(r"world size 1, .*handed to the running workers", text), text
    assert text.count("every worker confirmed in place") == 2, text
    assert text.count("meshrun.parallel.elastic: a peer vanished") == 1, text  # one change
    _same_curve(text, expected)


@pytest.mark.timeout(90)
def test_a_worker_that_does_not_confirm_is_restarted(tmp_path):
    first, second = _two_nodes(tmp_path, [str(IGNORER)], 1, MESHRUN_IN_PLACE_TIMEOUT="1")
    nodes = [first, second]
    with _stopped_at_end(nodes):
        def opted_in_two_nodes():  # the survivor's worker of the two-node round opted in
            both = re.search(r"round (\d+): node rank 0 of 2", first.text())
            return both and f"round {both.group(1)}" in "".join(
                re.findall(r"opted in \d+ (round \d+)", first.text()))

        _wait(opted_in_two_nodes, "a two-node round whose worker opted in", 60, nodes)
        second.kill()
        assert first.proc.wait(60) == 0, first.text()
    text = first.text()
    assert re.search(r"in-place handover failed \(rank\(s\) 0 did not confirm within 1 s\)",
                     text), text
    fresh = re.search(r"fresh (\d+) round (\d+)", text)
    assert fresh, text
    opted = [int(p) for p in re.findall(r"opted in (\d+)", text)]
    assert int(fresh.group(1)) not in opted  # a new process, in the round after the loss
    pids = _worker_pids(first)
    assert int(fresh.group(1)) in pids[int(fresh.group(2))], pids


@contextlib.contextmanager
def _on_etcd(tmp: Path, script: list[str], **env: str):
    """A one-member etcd and two nodes on it: node rank 0 with one worker, node rank 1 with
    two; every node and the etcd member stopped at the end."""
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    (tmp / "etcd").mkdir()
    cluster = EtcdCluster(tmp / "etcd").start()
    try:
        with _stopped_at_end([]) as nodes:
            for name, nproc in (("first", 1), ("second", 2)):
                nodes.append(Node(tmp, name, None, nproc, False, script, etcd=cluster.endpoint,
                                  launcher_args=("--node-rank", str(nproc - 1)), **env))
            yield nodes
    finally:
        cluster.stop()


@pytest.mark.timeout(180)
def test_node_rank_0_lost_on_etcd(tmp_path, expected):
    # etcd has no store host: node rank 0 dies, and the survivor, node rank 1 with ranks 1-2,
    # becomes node rank 0 with ranks 0-1 and hosts the workers' store of the next round
    with _on_etcd(tmp_path, [str(EXAMPLE), "--elastic", "in-place", *TRAIN]) as nodes:
        first, second = nodes
        _wait(lambda: re.search(rf"step {KILL_AFTER} \| loss [0-9.]+ .*\| world 3",
                                first.text()), f"step {KILL_AFTER} at world 3", 90, nodes)
        before = _worker_pids(second)
        first.kill()
        assert second.proc.wait(90) == 0, second.text()
    text = second.text()
    assert _worker_pids(second) == before, second.events()  # never restarted
    rounds = [e for e in second.events() if e["kind"] == "round_start"]
    assert (rounds[0]["node_rank"], rounds[0]["rank_offset"]) == (1, 1), rounds
    last = rounds[-1]
    assert (last["in_place"], last["node_rank"], last["rank_offset"], last["world_size"]) == (
        True, 0, 0, 2), rounds
    # rank 0 logged on the first node until it died, then on the survivor. The steps in
    # between: the first node may have logged a step that the survivors, whose last
    # collective of it failed, trained again, or completed one and died before logging it.
    # Either way every step the survivor logs has the reference's loss, which a step lost or
    # trained twice would change (the state would differ from then on).
    before_kill, after = _losses(first.text()), _losses(text)
    assert sorted(after) == list(range(min(after), STEPS + 1)), after
    assert all(len(v) == 1 for v in after.values()), after
    assert max(before_kill) - 1 <= min(after) <= max(before_kill) + 2, (before_kill, after)
    for step, value in expected.items():
        for got in (before_kill, after):
            if step in got:
                assert got[step][0] == pytest.approx(value, abs=2e-4), (step, got, expected)


@pytest.mark.timeout(180)
def test_rank_0_lost_before_confirming_on_etcd(tmp_path, expected):
    # fsdp: node rank 0 (rank 0, the one that prints) dies once step 4's copies are out,
    # before their confirmation: the survivors restore step 4 as done, and their new rank 0
    # prints it (the line is built on every rank, printed by rank 0 of the world the step
    # ended in): every step printed once, by one node or the other
    script = [str(DIES_BEFORE_CONFIRMING), "--elastic", "in-place", "--dp-mode", "fsdp",
              *TRAIN]
    with _on_etcd(tmp_path, script, DIE_NODE="0", DIE_AT_STEP=str(KILL_AFTER)) as nodes:
        first, second = nodes
        assert second.proc.wait(120) == 0, second.text()
        first.proc.wait(30)
    text = second.text()
    assert f"restored the fully sharded state of step {KILL_AFTER} from memory" in text, text
    assert "restarting the worker group" not in text, text
    _same_curve(first.text() + text, expected)
