"""meshrun on a real SLURM cluster (`slurm_cluster.SlurmCluster`: a controller and two nodes in
network namespaces, Debian's slurm 22.05 unmodified), as SLURM users run it:

- ``sbatch -N2`` trains the example with no endpoint typed; the shipped
  ``configs/slurm_job.sh`` runs as is;
- SLURM's "save soon" warning reaches each worker exactly once and the job goes on: sent by
  SLURM's own timer (``--signal=USR1@N``) under proctrack/linuxproc, by ``scancel -s USR1``
  under proctrack/pgid (the plugin that signals only a process group);
- two tasks of a job array on the same two nodes at once, each a step where node k runs k+1
  workers (world size 3), do not collide: each has its own rendezvous port;
- the shipped script's requeue lines: a rendezvous failure (exit 3) is requeued, a bounded
  number of times; a script's own failure (exit 7) is not, and SLURM records its code;
- ``scancel`` leaves nothing behind.

Each test submits one job (the requeue test two, side by side), so the module costs about
2.5 minutes on 2 cores. Skipped, with the reason, where SLURM or namespaces are not available.
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
HOLD_ENV = REPO / "tests" / "agent" / "e2e_scripts" / "hold_env.py"
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


@pytest.mark.parametrize("proctrack,source", [("linuxproc", "--signal"), ("pgid", "scancel")])
def test_warning_signal_reaches_each_worker_once_and_the_job_goes_on(clusters, proctrack, source):
    """USR1 from ``--signal=USR1@N`` (linuxproc: SLURM's own timer) and from ``scancel -s USR1``
    (pgid): each of the four workers gets it once, and the job completes.

    slurmctld sends the timed warning only when it checks time limits, every 30 s, and then
    as soon as less than N + 30 s are left: with ``--time=1`` and ``@50`` that is the first
    check after the start, up to 30 s later. The job is submitted when the next check is at
    least 12 s away, so the workers (ready in 2-7 s here) have their handlers in by then.
    """
    cluster = clusters(proctrack)
    out_dir = cluster.work / f"warned_{cluster.proctrack}"
    out_dir.mkdir()
    timed = source == "--signal"
    if timed and cluster.next_limit_check() < 12:
        time.sleep(cluster.next_limit_check() + 1)
    job = cluster.sbatch(_script(cluster, "warned.sh", f"""\
#SBATCH -N2 --ntasks-per-node=1 -o warned_%j.out{" --time=1 --signal=USR1@50" if timed else ""}
srun meshrun --nproc-per-node 2 {WARNED} {out_dir}
"""))
    cluster.wait_running(job)
    started = time.time()
    _wait_files(out_dir, "ready_*", 4, 60, cluster)
    if not timed:
        cluster.run(["scancel", "-s", "USR1", str(job)])
    _wait_files(out_dir, "warned_*", 4, 45, cluster)
    time.sleep(1.5)  # the agents decide within 0.3 s whether to pass it on: a second would come
    (out_dir / "stop").touch()
    state = cluster.wait(job)
    out = (cluster.work / f"warned_{job}.out").read_text()
    assert state == "COMPLETED 0:0", f"{state}\n{out}"
    counts = sorted((out_dir / f"counts_{r}").read_text() for r in range(4))
    assert counts == ["1 0"] * 4, (counts, out)  # USR1 once, on every worker of both nodes
    if timed:
        first = min(float(p.read_text().split()[0]) for p in out_dir.glob("warned_*"))
        assert first - started < 35, first - started  # the first check after the start


def test_array_tasks_sharing_nodes_and_heterogeneous_nproc(cluster):
    """Two tasks of ``--array=0-1`` on the same two nodes at once (``--oversubscribe``), each a
    2-node step where node k runs k+1 workers: each task is its own job of world size 3 (ranks
    contiguous per node, a gloo all_reduce over the three), with its own rendezvous port.

    With one fixed port (29400, before) the second task's agent on the first node could not
    host, joined the first task's store, and exited 3 when that task ended: so task 0 is
    stopped first, and task 1 must still complete.
    """
    out_dir = cluster.work / "arrays"
    out_dir.mkdir()
    # exec: no shell stays between slurmstepd and meshrun (linuxproc signals every process of
    # the step; a bash without a handler would die of the warning meshrun passes on)
    array = cluster.sbatch(_script(cluster, "arrays.sh", f"""\
#SBATCH -N2 --ntasks-per-node=1 --array=0-1 --oversubscribe -o arrays_%A_%a.out
out={out_dir}/$SLURM_ARRAY_TASK_ID
mkdir -p "$out"
srun bash -c "exec meshrun --nproc-per-node \\$((SLURM_NODEID + 1)) {HOLD_ENV} $out --dist"
"""))
    envs = {}
    for task in (0, 1):  # both running at once: each waits for its stop file
        pids = _wait_files(out_dir / str(task), "pid_*", 3, 90, cluster)
        envs[task] = [_environ(int(p.read_text())) for p in pids]
    for task, workers in envs.items():
        seen = sorted((e["GROUP_RANK"], e["LOCAL_RANK"], e["RANK"], e["LOCAL_WORLD_SIZE"])
                      for e in workers)  # fmt: skip
        assert seen == [("0", "0", "0", "1"), ("1", "0", "1", "2"), ("1", "1", "2", "2")], seen
        assert {e["WORLD_SIZE"] for e in workers} == {"3"}, task
        assert len({e["TORCHELASTIC_RUN_ID"] for e in workers}) == 1, task
    assert envs[0][0]["TORCHELASTIC_RUN_ID"] != envs[1][0]["TORCHELASTIC_RUN_ID"]
    outs = {}
    for task in (0, 1):
        (out_dir / str(task) / "stop").touch()
        state = cluster.wait(f"{array}_{task}")
        outs[task] = (cluster.work / f"arrays_{array}_{task}.out").read_text()
        assert state == "COMPLETED 0:0", f"task {task}: {state}\n{outs[task][-3000:]}"
    ports = [set(re.findall(r"c10d rendezvous at (\S+)", outs[t])) for t in (0, 1)]
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1], ports


def test_requeue_only_when_retrying_may_help(cluster):
    """The shipped script's trailer: a rendezvous failure (exit 3: the job asks for 3 nodes of
    2, join timeout 2 s) is requeued, MAX_REQUEUES=1 time, then ends with 3; a script that
    fails (its worker exits 7, no restarts left) is not requeued and SLURM records 7. The two
    jobs share the nodes (``--oversubscribe``) to take the time of one."""
    retry, fail = cluster.work / "requeue_retry", cluster.work / "requeue_fail"
    (fail / "examples").mkdir(parents=True)
    retry.mkdir()
    os.symlink(REPO / "examples", retry / "examples")
    (fail / "examples" / "train_char_lm.py").write_text("import sys\nsys.exit(7)\n")
    env_before = dict(cluster.env)
    script, args = REPO / "configs" / "slurm_job.sh", ("--oversubscribe", "-o", "requeue_%j.out")
    cluster.env.update(PET_NNODES="3", PET_RDZV_CONF="join_timeout=2", MAX_REQUEUES="1")
    try:
        retried = cluster.sbatch(script, "-D", str(retry), *args)
    finally:
        cluster.env = env_before
    cluster.env.update(MAX_RESTARTS="0")  # no restarts left at once: one attempt, not four
    try:
        failed = cluster.sbatch(script, "-D", str(fail), *args)
    finally:
        cluster.env = env_before
    for job in (retried, failed):
        cluster.wait(job)
    info = {job: cluster.show(job) for job in (retried, failed)}
    out = {retried: (retry / f"requeue_{retried}.out").read_text(),
           failed: (fail / f"requeue_{failed}.out").read_text()}  # fmt: skip
    got = {job: (i["JobState"], i["ExitCode"], i["Restarts"]) for job, i in info.items()}
    assert got[retried] == ("FAILED", "3:0", "1"), (got, out[retried][-3000:])
    # each of the two runs: at least the store's host timed out joining (the other node may
    # see the store go first: "store ... lost")
    assert out[retried].count("rendezvous failed: join timeout") >= 2, out[retried][-3000:]
    assert "not requeued, 1 requeue(s) spent" in out[retried], out[retried][-3000:]
    assert got[failed] == ("FAILED", "7:0", "0"), (got, out[failed][-3000:])
    assert "requeue" not in out[failed], out[failed][-3000:]


def test_scancel_stops_the_job_and_leaves_no_process(clusters):
    cluster = clusters("pgid")  # the plugin that signals the least: meshrun must do the rest
    out_dir = cluster.work / "cancelled"
    out_dir.mkdir()
    job = cluster.sbatch(_script(cluster, "cancel.sh", f"""\
#SBATCH -N2 --ntasks-per-node=1 -o cancel_%j.out
srun meshrun --nproc-per-node 2 {WARNED} {out_dir}
"""))
    pids = [int(p.read_text()) for p in _wait_files(out_dir, "ready_*", 4, 60, cluster)]
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


def _wait_files(folder: Path, pattern: str, count: int, timeout: float, cluster) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(found := sorted(folder.glob(pattern))) < count:
        assert time.monotonic() < deadline, (pattern, found, cluster.logs())
        time.sleep(0.1)
    return found


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().decode(errors="replace").split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)
