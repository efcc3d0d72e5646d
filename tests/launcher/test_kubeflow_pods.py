"""Kubeflow's pod layouts, as the controllers set them (training-operator v1 ``envvar.go`` and
``elastic.go``, Trainer v2's torch plugin): each pod runs ``meshrun train.py`` with no flags,
only the environment the operator gives it, here as processes on 127.0.0.1 (a pod's host name
replaced by the loopback address). Every layout forms one world with every rank once, in one
round: pods of an elastic job that start seconds apart join the same first round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "scripts" / "pod_worker.py"
pytestmark = pytest.mark.timeout(120)


def _static(port: int, pods: int, nproc: str) -> list[dict[str, str]]:
    """training-operator v1, non-elastic: one Master and Workers (Master = pod 0)."""
    world = str(pods * int(nproc)) if nproc.isdigit() else "1"
    return [{"MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port), "WORLD_SIZE": world,
             "RANK": str(i), "PET_NODE_RANK": str(i), "PET_NNODES": str(pods),
             "PET_NPROC_PER_NODE": nproc} for i in range(pods)]  # fmt: skip


def _elastic(port: int, pods: int, nproc: str) -> list[dict[str, str]]:
    """training-operator v1, elastic (Workers only, c10d)."""
    return [{"PET_NNODES": f"1:{pods}", "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
             "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ID": "kf-job", "PET_MAX_RESTARTS": "3",
             "PET_NPROC_PER_NODE": nproc} for _ in range(pods)]  # fmt: skip


def _trainer_v2(port: int, pods: int, nproc: str) -> list[dict[str, str]]:
    """Trainer v2's torch plugin: no elastic mode, the node rank is the completion index."""
    return [{"PET_NNODES": str(pods), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(i),
             "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
            for i in range(pods)]  # fmt: skip


def _standalone(port: int, pods: int, nproc: str) -> list[dict[str, str]]:
    """``standalone: true``: the operator sets PET_STANDALONE to the empty string."""
    return [{"PET_STANDALONE": "", "PET_NPROC_PER_NODE": nproc}]


LAYOUTS = {  # name -> (pods' environments, pods, nproc per pod, seconds between pod starts)
    "static": (_static, 2, "1", 0.0),
    "static nproc auto": (_static, 2, "auto", 0.0),
    "elastic c10d, pods 1.5 s apart": (_elastic, 2, "1", 1.5),
    "trainer v2": (_trainer_v2, 2, "1", 0.0),
    "standalone": (_standalone, 1, "2", 0.0),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pod_layout_forms_one_world_in_one_round(tmp_path, layout):
    make, pods, nproc, apart = LAYOUTS[layout]
    records = tmp_path / "records.jsonl"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MASTER_"))}
    base.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    procs = []
    try:
        for i, env in enumerate(make(free_port(), pods, nproc)):
            if i and apart:
                time.sleep(apart)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "meshrun", str(WORKER), str(records)],
                env={**base, **env}, cwd=tmp_path, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))  # fmt: skip
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    errs = "\n".join(err for _, err in outs)
    assert [p.returncode for p in procs] == [0] * len(procs), errs
    seen = [json.loads(line) for line in records.read_text().splitlines()]
    world = len(seen)
    per_pod = os.cpu_count() if nproc == "auto" else int(nproc)
    assert world == pods * per_pod, (seen, errs)
    assert sorted(int(r["rank"]) for r in seen) == list(range(world)), seen
    assert {r["world_size"] for r in seen} == {str(world)} and {r["sum"] for r in seen} == {world}
    assert {r["meshrun_round"] for r in seen} == {"0"}, (seen, errs)  # workers started once


def test_shipped_pytorchjob_is_in_the_operators_schema():
    """configs/pytorchjob.yaml: the fields training-operator v1 reads for an elastic job."""
    import yaml

    job = yaml.safe_load((REPO / "configs" / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] in ("c10d", "etcd", "etcd-v2")
    assert policy["minReplicas"] <= policy["maxReplicas"] and policy["maxRestarts"] >= 0
    assert all(set(item) == {"key", "value"} for item in policy["rdzvConf"])
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "pytorch" and container["command"][0] == "meshrun"
    assert isinstance(job["spec"]["nprocPerNode"], str)  # the operator's type: a string
