"""SLURM defaults: node lists expanded here, and the config they give under srun."""

import pytest

from meshrun.launcher.build import build_config_and_notes
from meshrun.launcher.slurm import expand_nodelist, slurm_defaults


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,7],cpu5", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x-[001-002].cluster", ["x-001.cluster", "x-002.cluster"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["a[1-2", "a]1[", "a[x-2]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NODEID": "2",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "gpu[07-10]",
}


def test_srun_one_task_per_node_fills_in_the_rendezvous(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    config, notes = build_config_and_notes(["--nproc-per-node", "8", "train.py"], SRUN)
    assert (config.min_nodes, config.max_nodes, config.node_rank) == (4, 4, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "gpu07:24242")
    assert config.rdzv_id == "slurm-4242" and not config.standalone
    assert config.rdzv_conf["is_host"] == "false"  # node rank 2: gpu07 (node 0) hosts
    assert any("SLURM job 4242" in n and "gpu07:24242" in n for n in notes)


def test_jobs_sharing_a_first_node_get_their_own_ports_and_node_0_hosts(tmp_path, monkeypatch):
    """Job ids side by side (the tasks of an array) must not both aim at one port: the second
    job's agent would join the first job's store and lose it with that job."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    ends = set()
    for job in ("4242", "4243", "123456789"):
        env = {**SRUN, "SLURM_JOB_ID": job, "SLURM_NODEID": "0"}
        config, _ = build_config_and_notes(["train.py"], env)
        assert config.rdzv_conf["is_host"] == "true"
        ends.add(config.rdzv_endpoint)
    assert ends == {"gpu07:24242", "gpu07:24243", "gpu07:26789"}
    given = ["--rdzv-conf", "is_host=false", "train.py"]  # the user's word wins
    config, _ = build_config_and_notes(given, {**SRUN, "SLURM_NODEID": "0"})
    assert config.rdzv_conf["is_host"] == "false"


def test_explicit_options_win_over_slurm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "head:1234", "--nnodes", "2:4", "train.py"]
    config, notes = build_config_and_notes(argv, SRUN)
    assert config.rdzv_endpoint == "head:1234" and (config.min_nodes, config.max_nodes) == (2, 4)
    assert not any("SLURM" in n for n in notes)


def test_not_a_step_or_several_tasks_per_node_is_left_alone():
    batch_script = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert slurm_defaults(batch_script) is None
    assert slurm_defaults({**SRUN, "SLURM_STEP_NUM_TASKS": "32"}) is None
    assert slurm_defaults({}) is None
