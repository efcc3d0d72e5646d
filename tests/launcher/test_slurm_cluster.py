"""meshrun on a real SLURM cluster (`slurm_cluster.SlurmCluster`: a controller and two nodes in
network namespaces, Debian's slurm 22.05 unmodified): ``sbatch -N2`` trains the example with no
endpoint typed, the shipped ``configs/slurm_job.sh`` runs as is, ``scancel`` leaves nothing
behind, and SLURM's "save soon" warning (``scancel -s USR1``, as ``--signal=USR1@N`` sends it)
reaches each worker exactly once under proctrack/linuxproc and proctrack/pgid, and the job goes
on. Skipped, with the reason, where SLURM or namespaces are not available.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, missing

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
WARNED = REPO / "tests" / "agent" / "e2e_scripts" / "warned.py"
pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(missing() is not None,
                                                           reason=str(missing()))]  # fmt: skip


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """One cluster per proctrack plugin, started on first use, stopped at the module's end."""
    made: dict[str, SlurmCluster] = {}

    def get(proctrack: str) -> SlurmCluster:
        if proctrack not in made:
            work = tmp_path_factory.mktemp(f"slurm_{proctrack}")
            env = {"PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(REPO)}
            made[proctrack] = SlurmCluster(work, proctrack=proctrack, env=env)
            made[proctrack].start()
        return made[proctrack]

    yield get
    for c in made.values():
        c.stop()


@pytest.fixture
def cluster(clusters):
    return clusters("linuxproc")


def _script(c: SlurmCluster, name: str, body: str) -> Path:
    path = c.work / name
    path.write_text("#!/bin/bash\n" + body)
    return path


def test_sbatch_two_nodes_trains_the_example_with_no_endpoint(cluster):
    job = cluster.sbatch(_script(cluster, "train.sh", f"""\
#SBATCH -N2 --ntasks-per-node=1 -o train_%j.out
srun meshrun --nproc-per-node 1 {REPO}/examples/train_char_lm.py --steps 6 --log-every 2
"""))
    state = cluster.wait(job)
    out = (cluster.work / f"train_{job}.out").read_text()
    assert state.startswith("COMPLETED"), f"{state}\n{out}\n{cluster.logs()}"
    assert "world size 2" in out and "node rank 1 of 2" in out, out
    assert re.search(r"\]: step 6 \| loss \d", out), out  # the last step, logged by rank 0


def test_shipped_slurm_job_script_runs_as_is(cluster):
    env_before = dict(cluster.env)
    cluster.env.update(STEPS="4", EXAMPLE_ARGS="--log-every 2")
    try:
        os.symlink(REPO / "examples", cluster.work / "examples")
        job = cluster.sbatch(REPO / "configs" / "slurm_job.sh", "-o", "job_%j.out")
    finally:
        cluster.env = env_before
    state = cluster.wait(job)
    out = (cluster.work / f"job_{job}.out").read_text()
    assert state.startswith("COMPLETED"), f"{state}\n{out}\n{cluster.logs()}"
    assert "world size 4" in out, out  # 2 nodes x --nproc-per-node auto (2 CPUs each)
    assert re.search(r"\]: step 4 \| loss \d", out), out


@pytest.mark.parametrize("proctrack", ["linuxproc", "pgid"])
def test_warning_signal_reaches_each_worker_once_and_the_job_goes_on(clusters, proctrack):
    cluster = clusters(proctrack)
    out_dir = cluster.work / f"warned_{cluster.proctrack}"
    out_dir.mkdir()
    job = cluster.sbatch(_script(cluster, "warned.sh", f"""\
#SBATCH -N2 --ntasks-per-node=1 -o warned_%j.out
srun meshrun --nproc-per-node 2 {WARNED} {out_dir}
"""))
    cluster.wait_running(job)
    deadline = time.monotonic() + 60
    while len(list(out_dir.glob("ready_*"))) < 4:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    cluster.run(["scancel", "-s", "USR1", str(job)])
    time.sleep(1.5)  # the agents decide within 0.3 s whether to pass it on
    (out_dir / "stop").touch()
    state = cluster.wait(job)
    out = (cluster.work / f"warned_{job}.out").read_text()
    assert state.startswith("COMPLETED"), f"{state}\n{out}"
    counts = sorted((out_dir / f"counts_{r}").read_text() for r in range(4))
    assert counts == ["1 0"] * 4, (counts, out)  # USR1 once, on every worker of both nodes


def test_scancel_stops_the_job_and_leaves_no_process(clusters):
    cluster = clusters("pgid")  # the plugin that signals the least: meshrun must do the rest
    out_dir = cluster.work / "cancelled"
    out_dir.mkdir()
    job = cluster.sbatch(_script(cluster, "cancel.sh", f"""\
#SBATCH -N2 --ntasks-per-node=1 -o cancel_%j.out
srun meshrun --nproc-per-node 2 {WARNED} {out_dir}
"""))
    deadline = time.monotonic() + 60
    while len(list(out_dir.glob("ready_*"))) < 4:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in out_dir.glob("ready_*")]
    cluster.run(["scancel", str(job)])
    state = cluster.wait(job)
    assert state.startswith("CANCELLED"), state
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, [p for p in pids if _alive(p)]
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
