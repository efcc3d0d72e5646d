"""In-place recovery across hosts (issue 22): the two nodes are network namespaces joined by
a veth link (`netns_pair`), c10d hosted by node A, gloo on each namespace's veth. Node A runs
two workers, node B one; once the three ranks train, B dies whole (SIGKILL of its agent and
its worker) or B's link is cut (its veth goes down: no reset reaches A, a peer that is
silent, not gone). Either way A's agent joins the next round without stopping its workers,
they change world and retry the step: the same two worker processes train every step, and
each step's loss equals one process training on the whole global batch. Fully sharded too
(``--dp-mode fsdp``, the cut link: the lost node's shards come from the neighbour copies,
whose exchange waits on a peer that no reset will end)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.faults.test_elastic_in_place import (
    CONF,
    EXAMPLE,
    KILL_AFTER,
    TRAIN,
    Node,
    _env,
    _same_curve,
    _wait,
    expected,  # noqa: F401 - the reference curve, a fixture
)

PORT = 29417  # inside namespace A only


class NsNode(Node):
    """One agent inside a namespace; its output in ``<tmp>/<name>.out`` (the rest as `Node`)."""

    def __init__(self, pair, host, tmp: Path, name: str, job: str, nproc: int,
                 is_host: bool, dp_mode: str = "ddp"):
        self.out, self.name = tmp / f"{name}.out", name
        argv = [sys.executable, "-m", "meshrun", "--nnodes", "1:2", "--nproc-per-node",
                str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{pair.a.addr}:{PORT}", "--rdzv-conf", f"{CONF},is_host={int(is_host)}",
                "--rdzv-id", job, "--node-rank", "0" if is_host else "1",
                "--monitor-interval", "0.1", "--shutdown-timeout", "3",
                "--log-dir", str(tmp / f"logs_{name}"),
                str(EXAMPLE), "--elastic", "in-place", "--dp-mode", dp_mode, *TRAIN,
                "--sleep-per-step", "0.1"]
        with open(self.out, "w") as out:
            self.proc = pair.popen(host, argv, env=_env(GLOO_SOCKET_IFNAME=host.ifname),
                                   cwd=tmp, stdout=out, stderr=out)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("fault", "dp_mode"), [("kill", "ddp"), ("cut", "ddp"), ("cut", "fsdp")])
def test_survivor_keeps_its_processes_across_hosts(netns_pair, tmp_path, expected, fault,  # noqa: F811
                                                    dp_mode):
    pair = netns_pair
    a = NsNode(pair, pair.a, tmp_path, "A", fault, 2, True, dp_mode)
    b = NsNode(pair, pair.b, tmp_path, "B", fault, 1, False, dp_mode)
    nodes = [a, b]
    try:
        _wait(lambda: re.search(rf"step {KILL_AFTER} \| loss [0-9.]+ .*\| world 3", a.text()),
              f"step {KILL_AFTER} at world 3", 90, nodes)
        if fault == "kill":
            b.kill()
        else:
            pair.cut()
        assert a.proc.wait(90) == 0, a.text()
    finally:
        if fault == "cut":
            from tests.faults.conftest import _ip

            _ip("-n", pair.b.ns, "link", "set", pair.b.ifname, "up")
        for n in nodes:
            if n.proc.poll() is None:
                n.kill()
    text = a.text()
    assert "every worker confirmed in place" in text, text
    assert "restarting the worker group" not in text, text
    _same_curve(text, expected)
    worlds = [int(w) for w in re.findall(r"step \d+ \| loss .*\| world (\d+) ", text)]
    assert worlds[0] == 3 and worlds[-1] == 2, worlds
    if dp_mode == "fsdp":
        assert "restored the fully sharded state of step" in text, text
