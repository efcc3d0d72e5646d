"""--desync-check's store traffic on several nodes (`meshrun.agent.desync.DesyncCheck`): one
write per node per second at most, reads by node rank 0 alone (one per other node per second),
while every rank's record changes on every look. Real record files, a real MemoryStore (the
store of one-node jobs; the contract is the same for c10d and etcd), real time."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrun.agent.collective_record import RECORD_FILE
from meshrun.agent.desync import PUBLISH_EVERY_S, DesyncCheck
from meshrun.rendezvous import MemoryStore
from meshrun.rendezvous.api import NodeDesc, RendezvousInfo


class Counting:
    """The real store, with each node's gets and writes counted."""

    def __init__(self, store: MemoryStore, node: int, counts: Counter):
        self.store, self.node, self.counts = store, node, counts

    def get(self, key):
        self.counts[(self.node, "get")] += 1
        return self.store.get(key)

    def compare_and_set(self, key, version, value):
        self.counts[(self.node, "write")] += 1
        return self.store.compare_and_set(key, version, value)


@dataclass(frozen=True)
class Spec:
    local_rank: int
    global_rank: int
    log_dir: Path
    node_rank: int


class Group:
    """The part of `WorkerGroup` the check reads: specs, pids, exit codes (all running)."""

    def __init__(self, specs):
        self.specs = specs
        self.pids = [1000 + s.global_rank for s in specs]

    def outcomes(self):
        return [(s, None, False) for s in self.specs]


def _write(path: Path, world: int, calls: int) -> None:
    record = {"pid": 1, "written_ms": 0,
              "groups": {"0": {"ranks": f"0-{world - 1}", "issued": calls, "done": calls}},
              "calls": [{"group": "0", "seq": s, "op": "all_reduce", "args": "float[4]",
                         "issued_ms": 0} for s in range(max(1, calls - 31), calls + 1)]}
    path.write_text(json.dumps(record))


@pytest.mark.timeout(60)
def test_each_node_writes_once_a_second_and_only_node_rank_0_reads(tmp_path):
    nodes, per_node = 8, 2
    world = nodes * per_node
    store, counts = MemoryStore(), Counter()
    members = tuple(NodeDesc(node_id=f"n{i}", addr="127.0.0.1", nproc=per_node)
                    for i in range(nodes))  # fmt: skip
    checks, groups, infos, rdzvs = [], [], [], []
    for n in range(nodes):
        specs = []
        for lr in range(per_node):
            d = tmp_path / f"n{n}" / str(lr)
            d.mkdir(parents=True)
            specs.append(Spec(lr, n * per_node + lr, d, n))
        groups.append(Group(specs))
        infos.append(RendezvousInfo(run_id="job", round=0, restart_count=0, node_rank=n,
                                    nodes=members, master_addr="127.0.0.1", master_port=1))
        rdzvs.append(SimpleNamespace(store=Counting(store, n, counts),
                                     settings=SimpleNamespace(run_id="job")))
        checks.append(DesyncCheck(f"h{n}", emit=lambda *a, **k: None))
    seconds, calls = 3.2, 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        calls += 1  # every rank made one more call since the last look: every digest changed
        for n in range(nodes):
            for s in groups[n].specs:
                _write(s.log_dir / RECORD_FILE, world, calls)
            assert checks[n].tick(rdzvs[n], infos[n], groups[n], lambda: [], None) is None
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    most = int(elapsed / PUBLISH_EVERY_S) + 1
    for n in range(nodes):
        assert 1 <= counts[(n, "write")] <= most, (n, counts)
        assert counts[(n, "get")] == (0 if n else counts[(0, "write")] * (nodes - 1)), counts
    # node rank 0 saw every rank of the job
    assert checks[0].ledger.ranks() == set(range(world))
    print(f"{nodes} nodes, {elapsed:.1f} s: writes per node {counts[(1, 'write')]}, "
          f"reads by node rank 0 {counts[(0, 'get')]}, by the others 0")
