"""End to end: real ``meshrun`` processes launching real workers. The torchrun environment
contract (one node and two static nodes), gloo collectives through the agent's store, two jobs
on one host, and the entry point forms (-m, --no-python, --run-path)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from meshrun.agent.worker_env import WORKER_SITE

SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"
ENV_DUMP = str(SCRIPTS / "env_dump.py")

CONTRACT = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",  # torchrun's launcher sets it in its own environment
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "MESHRUN_ROUND",
    # meshrun's own: the progress counters and stack file the agent reads (hang detection,
    # straggler check, failure reports), meshrun.parallel writes
    "MESHRUN_PROGRESS_FILE",
    "MESHRUN_STACK_FILE",
    "MESHRUN_STACK_SIGNAL",
    # the in-place recovery channel (meshrun.in_place): the rank's log directory, where a
    # worker running meshrun.parallel.elastic opts in and takes a new round's environment
    "MESHRUN_IN_PLACE_DIR",
    # torch's flight recorder, for the collective record (meshrun.agent.collectives); the
    # record's own MESHRUN_COLLECTIVE_RECORD is taken out of the environment at start-up
    "TORCH_FR_BUFFER_SIZE",
}


def read_dumps(out: Path, world_size: int) -> dict[int, dict]:
    dumps = {}
    for rank in range(world_size):
        path = out / f"env_{rank}.json"
        assert path.exists(), f"rank {rank} wrote no env file; files: {sorted(os.listdir(out))}"
        dumps[rank] = json.loads(path.read_text())
    assert sorted(p.name for p in out.glob("env_*.json")) == [
        f"env_{r}.json" for r in range(world_size)
    ]
    return dumps


def check_contract(
    dumps: dict[int, dict], launch_env: dict[str, str], *, nnodes: int, nproc: int
) -> None:
    world = nnodes * nproc
    assert sorted(int(d["env"]["RANK"]) for d in dumps.values()) == list(range(world))
    shared = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
    for name in shared:
        values = {d["env"][name] for d in dumps.values()}
        assert len(values) == 1 and values != {""}, (name, values)
    error_files = set()
    for rank, d in dumps.items():
        env = d["env"]
        assert CONTRACT <= set(env), f"rank {rank} lacks {sorted(CONTRACT - set(env))}"
        # exactly the launcher's environment plus the contract: nothing the agent set for
        # itself (e.g. TORCH_CPP_LOG_LEVEL for its own store) leaks to the workers
        assert set(env) - set(launch_env) == CONTRACT, sorted(set(env) - set(launch_env))
        changed = {k for k in launch_env if k not in CONTRACT and env.get(k) != launch_env[k]}
        # ...but PYTHONPATH, led by the worker site (meshrun's exit guard and collective record)
        assert env["PYTHONPATH"] == os.pathsep.join([WORKER_SITE, launch_env["PYTHONPATH"]])
        assert changed <= {"PYTHONPATH"}, {k: (launch_env[k], env.get(k)) for k in changed}
        node, local = divmod(rank, nproc)
        expected = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(nnodes),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": "1",
            "MESHRUN_ROUND": "0",
        }
        assert {k: env[k] for k in expected} == expected, f"rank {rank}"
        assert 0 < int(env["MASTER_PORT"]) < 65536
        err = Path(env["TORCHELASTIC_ERROR_FILE"])
        assert err.name == "error.json" and err.parent.name == str(local), err
        assert err.parent.parent.name == "attempt_0", err
        error_files.add(str(err))
        # gloo through the agent's bootstrap store, as a torchrun script would do it
        assert d["launched"] is True
        assert (d["rank"], d["world"]) == (rank, world)
        assert d["sum"] == sum(range(world))
    assert len(error_files) == world


@pytest.mark.timeout(90)
def test_env_contract_one_node_two_procs(launch):
    """Standalone 1x2: each worker sees torchrun's exact contract, OMP_NUM_THREADS=1, and a
    gloo all_reduce over init_process_group("gloo") works; is_torchelastic_launched() is True."""
    out = launch.cwd / "out"
    out.mkdir()
    res = launch.run(["--nproc-per-node", "2", ENV_DUMP, str(out), "--dist"], timeout=75)
    assert res.returncode == 0, res.stderr
    check_contract(read_dumps(out, 2), res.launch_env, nnodes=1, nproc=2)


@pytest.mark.timeout(120)
def test_env_contract_two_static_nodes(launch):
    """Two agents, --rdzv-backend static, node ranks 0 and 1: ranks 0..3 exactly once, node
    rank -> GROUP_RANK, contiguous global ranks per node, one all_reduce over 4 workers."""
    out = launch.cwd / "out"
    out.mkdir()
    port = launch.free_port()
    common = [
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "static",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    procs = [
        launch.start([*common, "--node-rank", str(n), ENV_DUMP, str(out), "--dist"]) for n in (0, 1)
    ]
    results = [p.communicate(timeout=100) for p in procs]
    for n, (p, (_, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, f"node {n}: {err}"
    check_contract(read_dumps(out, 4), procs[0].launch_env, nnodes=2, nproc=2)


@pytest.mark.timeout(120)
def test_two_standalone_jobs_on_one_host(launch):
    """Two standalone jobs started together on one host do not collide: both succeed and each
    job's gloo all_reduce sums only its own two ranks."""
    outs = [launch.cwd / f"out{i}" for i in (0, 1)]
    procs = []
    for out in outs:
        out.mkdir()
        procs.append(launch.start(["--nproc-per-node", "2", ENV_DUMP, str(out), "--dist"]))
    results = [p.communicate(timeout=100) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    dumps = [read_dumps(out, 2) for out in outs]
    for d, p in zip(dumps, procs, strict=True):
        check_contract(d, p.launch_env, nnodes=1, nproc=2)
    ids = [d[0]["env"]["TORCHELASTIC_RUN_ID"] for d in dumps]
    ports = [d[0]["env"]["MASTER_PORT"] for d in dumps]
    assert ids[0] != ids[1] and ports[0] != ports[1]


@pytest.mark.timeout(60)
def test_module_entry_point(launch):
    """-m MODULE runs the module (found on PYTHONPATH) as __main__ in every worker."""
    mods = launch.cwd / "mods"
    mods.mkdir()
    (mods / "e2e_mod_worker.py").write_text(
        "import os, sys\nprint(f'module {__name__} rank {os.environ[\"RANK\"]} {sys.argv[1:]}')\n"
    )
    res = launch.run(
        ["--nproc-per-node", "2", "-m", "e2e_mod_worker", "--flag", "x"],
        env={"PYTHONPATH": str(mods)},
    )
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert f"module __main__ rank {rank} ['--flag', 'x']" in res.stdout


@pytest.mark.timeout(60)
def test_no_python_entry_point(launch):
    """--no-python runs an executable directly (here a shell script), with the contract env."""
    script = launch.cwd / "run.sh"
    script.write_text('#!/bin/sh\necho "shell rank $RANK of $WORLD_SIZE args $*"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    res = launch.run(["--nproc-per-node", "2", "--no-python", "./run.sh", "a", "b"])
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert f"shell rank {rank} of 2 args a b" in res.stdout


@pytest.mark.timeout(60)
def test_run_path_entry_point(launch):
    """--run-path runs the script as __main__ with its arguments, like torchrun's runpy."""
    res = launch.run(["--nproc-per-node", "1", "--run-path", str(SCRIPTS / "say_rank.py"), "z"])
    assert res.returncode == 0, res.stderr
    assert "name=__main__ rank=0 args=['z']" in res.stdout
