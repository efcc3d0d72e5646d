"""build_config: the merge (file < env < flag), PET_* fallbacks, and each option's semantics."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from meshrun.launcher import ConfigError, Std, StdSpec, build_config
from meshrun.launcher.values import count_gpus

pytestmark = pytest.mark.timeout(30)


def cfg(*argv: str, env: dict[str, str] | None = None):
    return build_config(list(argv), env or {})


# -- the worker command ---------------------------------------------------------------------


def test_script_args_pass_through_untouched(workdir):
    c = cfg("--nproc-per-node", "2", "train.py", "--lr", "3e-4", "--nnodes", "5", "--", "-m")
    assert c.entrypoint == (sys.executable, "-u", "train.py")
    assert c.args == ("--lr", "3e-4", "--nnodes", "5", "--", "-m")
    assert (c.max_nodes, c.nproc_per_node) == (1, 2)


def test_help_after_the_script_belongs_to_the_script(workdir):
    assert cfg("train.py", "--help", "--version").args == ("--help", "--version")


def test_equals_spellings(workdir):
    c = cfg("--nproc_per_node=3", "--nnodes=1:2", "--rdzv-backend=c10d", "-r3", "train.py")
    assert (c.nproc_per_node, c.max_nodes, c.redirects) == (3, 2, StdSpec(Std.ALL))


def test_local_rank_macro_is_kept(workdir):
    assert cfg("train.py", "--local-rank=${local_rank}").args == ("--local-rank=${local_rank}",)


def test_module_no_python_run_path(workdir):
    assert cfg("-m", "pkg.train", "x").entrypoint == (sys.executable, "-u", "-m", "pkg.train")
    assert cfg("--no-python", "echo", "hi").entrypoint == ("echo",)
    c = cfg("--run_path", "train.py")
    assert c.run_path and c.entrypoint == (sys.executable, "-u", "train.py")
    assert cfg("train.py", env={"PYTHON_EXEC": "/opt/py"}).entrypoint[0] == "/opt/py"


def test_script_named_like_an_option_value_is_still_the_script(workdir):
    c = cfg("--nnodes", "1", "train.py", "-r", "3")
    assert c.args == ("-r", "3") and c.redirects == StdSpec()


# -- sources and precedence -----------------------------------------------------------------


def test_pet_fallbacks(workdir):
    env = {
        "PET_NPROC_PER_NODE": "3",
        "PET_NNODES": "2:4",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "h:29400",
        "PET_NODE_RANK": "1",
        "PET_MAX_RESTARTS": "5",
        "PET_VIRTUAL_LOCAL_RANK": "1",
        "PET_TEE": "3",
        "PET_NO_PYTHON": "0",
    }
    c = cfg("train.py", env=env)
    assert (c.nproc_per_node, c.min_nodes, c.max_nodes) == (3, 2, 4)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.node_rank) == ("c10d", "h:29400", 1)
    assert c.max_restarts == 5 and c.virtual_local_rank and c.tee == StdSpec(Std.ALL)
    assert c.entrypoint[0] == sys.executable


def test_pet_boolean_flags(workdir):
    assert cfg("pkg", env={"PET_MODULE": "1"}).entrypoint[-2:] == ("-m", "pkg")
    assert cfg("train.py", env={"PET_STANDALONE": "1"}).standalone
    with pytest.raises(ConfigError, match="PET_STANDALONE=yes"):
        cfg("train.py", env={"PET_STANDALONE": "yes"})


def test_precedence_file_then_env_then_flag(workdir: Path):
    (workdir / "job.toml").write_text(
        'nproc-per-node = 2\nmax_restarts = 1\nrole = "file"\nrdzv_id = "file"\n'
    )
    env = {"PET_MAX_RESTARTS": "4", "PET_ROLE": "env", "PET_RDZV_BACKEND": "c10d"}
    c = cfg("--config", "job.toml", "--role", "flag", "train.py", env=env)
    assert c.nproc_per_node == 2  # file only
    assert c.max_restarts == 4  # env beats file
    assert c.role == "flag"  # flag beats env
    assert c.rdzv_id == "file"


def test_config_file_structured_values(workdir: Path):
    (workdir / "job.toml").write_text(
        "standalone = false\n"
        "nnodes = 1\n"
        'rdzv_backend = "c10d"\n'
        "signals_to_handle = ['SIGTERM', 'USR1']\n"
        "local_ranks_filter = [0, 1]\n"
        "duplicate_stdout_filters = ['a,b', 'c']\n"
        "[rdzv_conf]\njoin_timeout = 60\nis_host = true\n"
    )
    c = cfg("--config", "job.toml", "train.py")
    assert c.rdzv_conf == {"join_timeout": "60", "is_host": "true"}
    assert c.signals_to_handle == (signal.SIGTERM, signal.SIGUSR1)
    assert c.local_ranks_filter == {0, 1}
    assert c.duplicate_stdout_filters == ("a,b", "c")


@pytest.mark.parametrize(
    "text, match",
    [
        ("nprocs = 2", "unknown key 'nprocs'"),
        ("standalone = 1", "is a flag"),
        ("nnodes = true", "takes a value"),
        ("nnodes = [1, 2]", "takes a string or a number"),
        ("nnodes = '3:2'", "MIN must not exceed MAX"),
        ("nnodes = ", "not valid TOML"),
    ],
)
def test_bad_config_files(workdir: Path, text: str, match: str):
    (workdir / "job.toml").write_text(text + "\n")
    with pytest.raises(ConfigError, match=match) as info:
        cfg("--config", "job.toml", "train.py")
    assert "\n" not in str(info.value)


def test_example_configs_load(workdir: Path):
    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))
    assert len(configs) >= 4
    for path in configs:
        c = cfg("--config", str(path), "--node-rank", "0", "train.py",
                env={"CUDA_VISIBLE_DEVICES": "0,1"})  # fmt: skip
        assert c.nproc_per_node >= 1, path


# -- size -----------------------------------------------------------------------------------


def test_nnodes(workdir):
    assert (cfg("--nnodes", "3", "train.py").min_nodes, cfg("--nnodes", "3", "train.py").max_nodes) == (3, 3)
    c = cfg("--nnodes", "1:4", "--rdzv-backend", "c10d", "train.py")
    assert (c.min_nodes, c.max_nodes) == (1, 4)
    for bad in ("0", "3:2", "1:2:3", "x", "0:2", ""):
        with pytest.raises(ConfigError, match="--nnodes"):
            cfg("--nnodes", bad, "train.py")


def test_nproc_per_node_special_values(workdir, monkeypatch):
    env = {"CUDA_VISIBLE_DEVICES": "0,3,5", "PATH": ""}
    assert cfg("--nproc-per-node", "auto", "train.py", env=env).nproc_per_node == 3
    assert cfg("--nproc-per-node", "gpu", "train.py", env=env).nproc_per_node == 3
    assert cfg("--nproc-per-node", "cpu", "train.py", env=env).nproc_per_node >= 1
    no_gpu = {"CUDA_VISIBLE_DEVICES": "", "PATH": ""}
    cpus = cfg("--nproc-per-node", "cpu", "train.py", env=no_gpu).nproc_per_node
    assert cfg("--nproc-per-node", "auto", "train.py", env=no_gpu).nproc_per_node == cpus
    with pytest.raises(ConfigError, match="no GPU found"):
        cfg("--nproc-per-node", "gpu", "train.py", env=no_gpu)
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ConfigError, match="--nproc-per-node"):
            cfg("--nproc-per-node", bad, "train.py")


def test_count_gpus(tmp_path):
    assert count_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}) == 2
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}) == 2
    assert count_gpus({"PATH": ""}) == 0
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: H100 (UUID: x)'\necho 'GPU 1: H100 (UUID: y)'\n")
    smi.chmod(0o755)
    assert count_gpus({"PATH": str(tmp_path)}) == 2


def test_node_rank(workdir):
    assert cfg("train.py").node_rank is None
    assert cfg("--nnodes", "2", "--node-rank", "1", "train.py").node_rank == 1
    with pytest.raises(ConfigError, match="node rank must be below"):
        cfg("--nnodes", "2", "--node_rank", "2", "train.py")


# -- rendezvous -----------------------------------------------------------------------------


def test_standalone_flag(workdir):
    c = cfg("--standalone", "--rdzv-backend", "etcd", "--rdzv-id", "x", "train.py")
    assert c.standalone and (c.rdzv_backend, c.rdzv_endpoint) == ("c10d", "localhost:0")
    assert c.rdzv_id not in ("x", "none") and c.master_port is None


def test_standalone_is_implied_for_one_node_without_endpoint_or_port(workdir):
    a, b = cfg("train.py"), cfg("train.py")
    assert a.standalone and a.rdzv_backend == "c10d" and a.rdzv_id != b.rdzv_id
    assert not cfg("--master-port", "29500", "train.py").standalone
    assert cfg("--master-port", "29500", "train.py").master_port == 29500
    assert not cfg("--rdzv-endpoint", "h:1", "train.py").standalone
    assert not cfg("--nnodes", "2", "train.py").standalone
    assert not cfg("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
                   "train.py").standalone
    with pytest.raises(ConfigError, match="static rendezvous has a fixed node count"):
        cfg("--nnodes", "1:2", "train.py")  # no second node could ever join
    static = cfg("--nnodes", "2", "train.py")
    assert (static.rdzv_backend, static.master_port, static.master_addr) == ("static", None, "127.0.0.1")


def test_rdzv_backends(workdir):
    for name, want in (("static", "static"), ("c10d", "c10d"), ("etcd", "etcd"), ("etcd-v3", "etcd")):
        assert cfg("--nnodes", "2", "--rdzv-backend", name, "train.py").rdzv_backend == want
    with pytest.raises(ConfigError, match="unknown rendezvous backend"):
        cfg("--nnodes", "2", "--rdzv-backend", "zookeeper", "train.py")


def test_etcd_v2_runs_on_the_v3_api_with_a_note(workdir, capsys):
    assert cfg("--nnodes", "2", "--rdzv-backend", "etcd-v2", "train.py").rdzv_backend == "etcd"
    assert "etcd-v2 runs on etcd's v3 API" in capsys.readouterr().err


def test_rdzv_conf_keys_torch_reads_are_honoured_or_noted(workdir, capsys):
    """Kubeflow's operator passes the user's rdzvConf through PET_RDZV_CONF; torch ignores keys
    it does not read, so meshrun must run with them too (typos of a known key stay errors)."""
    conf = "heartbeat_timeout=30,ssl_cert=c.pem,ssl_cert_key=k.pem,ca_cert=ca.pem,etcd_prefix=/x,zzz=1"
    c = cfg("--nnodes", "2", "train.py", env={"PET_RDZV_CONF": conf})
    assert c.rdzv_conf == {"heartbeat_timeout": "30", "cert": "c.pem", "key": "k.pem",
                           "cacert": "ca.pem"}  # fmt: skip
    err = capsys.readouterr().err
    assert "ssl_cert is read as cert" in err and "etcd_prefix ignored" in err
    assert "zzz is not a key meshrun or torch reads; ignored" in err
    from meshrun.rendezvous import settings_from_conf

    settings = settings_from_conf({"heartbeat_timeout": "30", "keep_alive_interval": "5"},
                                  run_id="x", min_nodes=1, max_nodes=2, max_restarts=0)  # fmt: skip
    assert settings.dead_after == 30  # torch's heartbeat_timeout: a node lost after 30 s
    for typo in ("jion_timeout=5", "usr=me"):
        with pytest.raises(ConfigError, match="did you mean"):
            cfg("--rdzv-conf", typo, "train.py")


def test_rdzv_conf_timeout_as_the_jobs_backend_reads_it(workdir, capsys):
    """timeout= is read by the backend that runs the job: static (torchrun's default), etcd;
    a one-node job without --master-port runs on c10d, as torchrun's does, which ignores it."""
    c = cfg("--nnodes", "2", "--rdzv-conf", "timeout=60,read_timeout=5", "train.py")
    assert c.rdzv_conf == {"join_timeout": "60", "read_timeout": "5"}
    err = capsys.readouterr().err.splitlines()
    assert err == ["note: --rdzv-conf timeout=60 is read as join_timeout=60, as torch's static "
                   "backend reads it: the store's timeout: connecting and every wait, so how "
                   "long the nodes wait for each other (default 600 s)"]  # fmt: skip
    conf = "join_timeout=5,last_call_timeout=1,timeout=5"  # torch's launcher test's
    c = cfg("--rdzv-conf", conf, "train.py")  # standalone: c10d
    assert c.rdzv_backend == "c10d" and c.rdzv_conf == {"join_timeout": "5", "last_call_timeout": "1"}
    assert "timeout=5 ignored: torch's c10d backend" in capsys.readouterr().err
    c = cfg("--nnodes", "2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:2379",
            "--rdzv-conf", "timeout=7", "train.py")  # fmt: skip
    assert c.rdzv_backend == "etcd" and c.rdzv_conf == {}
    assert "timeout=7 ignored: torch's etcd-v2 backend" in capsys.readouterr().err
    c = cfg("--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379",
            "--rdzv-conf", "timeout=7", "train.py")  # fmt: skip
    assert c.rdzv_conf == {"join_timeout": "7"}
    assert "as torch's etcd backend reads it: the whole rendezvous's deadline" in capsys.readouterr().err


@pytest.mark.parametrize(
    "conf, match",
    [
        ("a", "'a' has no '='"),
        ("=b", "empty key"),
        ("a=", "empty value"),
        ("a=1,a=2", "given twice"),
        ("timeout=soon,join_timeout=2", "timeout=soon is not a number"),
        ("kye=k.pem", "did you mean key"),
        ("join_timeout=soon", "join_timeout=soon is not a number"),
    ],
)
def test_rdzv_conf_errors(workdir, conf, match):
    with pytest.raises(ConfigError, match=match):
        cfg("--rdzv-conf", conf, "train.py")


# -- supervision and output -----------------------------------------------------------------


def test_signals(workdir):
    assert cfg("train.py").signals_to_handle == (
        signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
    )  # fmt: skip
    c = cfg("--signals-to-handle", "SIGUSR1, term,SIGUSR1", "train.py")
    assert c.signals_to_handle == (signal.SIGUSR1, signal.SIGTERM)
    assert cfg("--signals-to-handle", "", "train.py").signals_to_handle == ()
    for bad in ("SIGFOO", "SIGKILL", "1"):
        with pytest.raises(ConfigError, match="--signals-to-handle"):
            cfg("--signals-to-handle", bad, "train.py")


def test_redirects_and_tee(workdir):
    assert cfg("-r", "3", "train.py").redirects == StdSpec(Std.ALL)
    spec = cfg("--redirects", "0:1,1:2", "train.py").redirects
    assert spec == StdSpec(Std.NONE, ((0, Std.OUT), (1, Std.ERR)))
    assert (spec.for_rank(1), spec.for_rank(5)) == (Std.ERR, Std.NONE)
    assert cfg("-t", "2", "train.py").tee == StdSpec(Std.ERR)
    for bad in ("4", "3x", "0:4", "a:1", "0:1,"):
        with pytest.raises(ConfigError, match="--redirects"):
            cfg("-r", bad, "train.py")


def test_filters_and_local_ranks(workdir):
    c = cfg("--local-ranks-filter", "0,2", "--duplicate_stderr_filters", "Error,,x,warn", "train.py")
    assert c.local_ranks_filter == frozenset({0, 2})
    assert c.duplicate_stderr_filters == ("Error,x", "warn")
    assert cfg("--local-ranks-filter", "", "train.py").local_ranks_filter is None
    assert cfg("train.py").duplicate_stdout_filters == ()
    with pytest.raises(ConfigError, match="--local-ranks-filter"):
        cfg("--local-ranks-filter", "0,x", "train.py")


def test_times(workdir):
    c = cfg("train.py")
    assert (c.shutdown_timeout, c.monitor_interval, c.hang_timeout, c.max_restarts) == (30.0, 0.1, None, 0)
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}
    assert cfg("train.py", env=env).shutdown_timeout == 7.0
    assert cfg("train.py", env={**env, "PET_SHUTDOWN_TIMEOUT": "8"}).shutdown_timeout == 8.0
    assert cfg("--shutdown-timeout", "2.5", "train.py", env=env).shutdown_timeout == 2.5
    assert cfg("--hang-timeout", "90", "train.py").hang_timeout == 90.0
    for flag, bad in (("--monitor-interval", "0"), ("--max-restarts", "-1"),
                      ("--hang-timeout", "0"), ("--shutdown-timeout", "x")):  # fmt: skip
        with pytest.raises(ConfigError, match=flag):
            cfg(flag, bad, "train.py")


def test_log_line_prefix_template(workdir):
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${rank}]"}
    assert cfg("train.py").log_line_prefix_template is None
    assert cfg("train.py", env=env).log_line_prefix_template == "[${rank}]"
    c = cfg("--log-line-prefix-template", "${role_name}:", "train.py", env=env)
    assert c.log_line_prefix_template == "${role_name}:"


def test_no_effect_options_are_stored(workdir):
    c = cfg("--start-method", "fork", "--event_log_handler", "x", "--logs-specs", "default",
            "--numa-binding", "node", "train.py")  # fmt: skip
    assert (c.start_method, c.event_log_handler, c.logs_specs, c.numa_binding) == ("fork", "x", "default", "node")
    with pytest.raises(ConfigError, match="--numa-binding"):
        cfg("--numa-binding", "all", "train.py")
