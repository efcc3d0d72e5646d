"""checkpoint.save's filesystem guarantees, with real processes, real kills and a real lock:
replacing a fixed path is atomic at any kill moment, two jobs cannot write one directory, a
background save killed mid-write leaves the previous checkpoint, and a damaged checkpoint is
one error naming the file."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.parallel.harness import REPO, kill_once_writing

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

REPLACING = textwrap.dedent("""
    import sys, torch
    from meshrun.parallel import checkpoint
    for version in range(1, 1000):  # every version: 20 tensors, all equal to the version
        state = {f"w{i}": torch.full((500_000,), float(version)) for i in range(20)}
        state["version"] = version
        checkpoint.save(state, sys.argv[1] + "/latest")
        print(version, flush=True)
""")


def _load_latest(directory):
    import torch

    from meshrun.parallel import checkpoint

    state = {f"w{i}": torch.zeros(500_000) for i in range(20)}
    state["version"] = 0
    checkpoint.load(state, os.path.join(directory, "latest"))
    return state


@pytest.mark.timeout(150)
def test_replacing_a_fixed_path_survives_kill_9_at_any_moment(tmp_path):
    """Saves that replace ``latest`` over and over, killed at random moments (seeded): after
    each kill the next start sweeps, and ``latest`` loads whole, one version throughout."""
    rng = random.Random(7)
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", REPLACING, str(tmp_path)], env=ENV,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip(), "the first save never finished"
        time.sleep(rng.uniform(0.0, 1.0))  # somewhere inside a later save or replace
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        state = _load_latest(tmp_path)
        v = state["version"]
        assert v >= 1, f"attempt {attempt}: version {v}"
        for i in range(20):
            assert bool((state[f"w{i}"] == v).all()), f"attempt {attempt}: w{i} is not all {v}"


def test_fallback_replace_left_half_done_is_repaired(tmp_path):
    """Where the filesystem cannot exchange two names, a replace is two renames; a kill
    between them leaves ``<path>.old`` only, which the next save's sweep puts back."""
    import torch

    from meshrun.parallel import atomic_dir, checkpoint

    checkpoint.save({"w": torch.arange(4.0), "version": 1}, tmp_path / "latest")
    os.rename(tmp_path / "latest", tmp_path / "latest.old")  # the kill moment
    atomic_dir.begin(str(tmp_path / "step_9"))  # a save killed while writing
    atomic_dir.sweep(str(tmp_path))
    assert not (tmp_path / "latest.old").exists() and not (tmp_path / "step_9.partial").exists()
    state = {"w": torch.zeros(4), "version": 0}
    checkpoint.load(state, tmp_path / "latest")
    assert state["version"] == 1 and torch.equal(state["w"], torch.arange(4.0))


HOLDER = textwrap.dedent("""
    import sys
    from meshrun.parallel import atomic_dir
    lock = atomic_dir.DirLock(sys.argv[1])  # what a save in progress holds
    print("locked", flush=True)
    sys.stdin.read()
""")


@pytest.mark.timeout(60)
def test_a_second_job_saving_into_the_same_directory_is_refused(tmp_path):
    import torch

    from meshrun.parallel import checkpoint

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(checkpoint.SaveInProgress,
                           match=rf"another save is writing into {tmp_path} \(held by .* pid "
                                 rf"{holder.pid}\)"):
            checkpoint.save({"w": torch.ones(2)}, tmp_path / "step_1")
        assert not any(tmp_path.glob("step_1*")), "the refused save left files"
    finally:
        holder.communicate("", timeout=30)
    checkpoint.save({"w": torch.ones(2)}, tmp_path / "step_1")  # the holder is gone: free
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_1")


KILLED_ASYNC = textwrap.dedent("""
    import sys, time, torch
    from meshrun.parallel import checkpoint
    checkpoint.save({"w": torch.arange(10.0), "step": 1}, sys.argv[1] + "/step_1")
    big = {f"w{i}": torch.randn(4_000_000) for i in range(25)}  # 400 MB: seconds to write
    big["step"] = 2
    handle = checkpoint.save(big, sys.argv[1] + "/step_2", async_=True)
    print("returned", flush=True)
    for t in big.values():  # training goes on while the background writes
        if torch.is_tensor(t):
            t.zero_()
    handle.wait()
    print("second saved", flush=True)
""")


@pytest.mark.timeout(120)
def test_kill_during_background_save_leaves_previous_checkpoint(tmp_path):
    import torch

    from meshrun.parallel import checkpoint

    proc = subprocess.Popen([sys.executable, "-c", KILLED_ASYNC, str(tmp_path)], env=ENV,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "returned"
    out = kill_once_writing(proc, tmp_path / "step_2.partial", timeout=60)
    assert "second saved" not in out
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_1")
    state = {"w": torch.zeros(10), "step": 0}
    checkpoint.load(state, checkpoint.latest(tmp_path))
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(10.0))


def test_async_save_writes_the_values_at_the_call(tmp_path):
    import torch

    from meshrun.parallel import checkpoint

    state = {"w": torch.arange(6.0), "nested": {"b": torch.ones(2)}, "step": 3}
    handle = checkpoint.save(state, tmp_path / "step_3", async_=True)
    state["w"].mul_(-1)  # after the call: must not reach the file
    state["nested"]["b"].zero_()
    handle.wait()
    loaded = {"w": torch.zeros(6), "nested": {"b": torch.zeros(2)}, "step": 0}
    checkpoint.load(loaded, tmp_path / "step_3")
    assert torch.equal(loaded["w"], torch.arange(6.0)) and loaded["step"] == 3
    assert torch.equal(loaded["nested"]["b"], torch.ones(2))


def test_a_damaged_checkpoint_is_one_error_naming_the_file(tmp_path):
    import torch

    from meshrun.parallel import checkpoint

    for name in ("truncated", "garbled", "missing"):
        checkpoint.save({"w": torch.arange(1000.0), "step": 1}, tmp_path / name)
    data = next((tmp_path / "truncated").glob("*.distcp"))
    with open(data, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=rf"{data} is damaged \(truncated: 100 bytes"):
        checkpoint.load({"w": torch.zeros(1000), "step": 0}, tmp_path / "truncated")
    (tmp_path / "garbled" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=r"garbled/\.metadata is damaged"):
        checkpoint.load({"w": torch.zeros(1000), "step": 0}, tmp_path / "garbled")
    gone = next((tmp_path / "missing").glob("*.distcp"))
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{gone} is missing"):
        checkpoint.load({"w": torch.zeros(1000), "step": 0}, tmp_path / "missing")


@pytest.mark.timeout(90)
def test_a_failure_on_one_rank_raises_on_every_rank(tmp_path):
    from tests.parallel.harness import launch

    result = launch("save_fails_on_one_rank.py", 2, (str(tmp_path),), timeout=80)
    for rank, r in enumerate(result.results):
        assert r.get("every_rank_raises") == "ok", f"rank {rank}: {r}"


def test_save_never_replaces_or_sweeps_what_it_did_not_write(tmp_path):
    import torch

    from meshrun.parallel import checkpoint

    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    (project / "src" / "important.py").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        checkpoint.save({"w": torch.ones(2)}, project)
    assert (project / "src" / "important.py").read_text() == "keep me"
    for name in ("data.partial", "results.old", "notes.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text(name)
    (tmp_path / "results").mkdir()
    checkpoint.save({"w": torch.ones(2)}, tmp_path / "step_1")
    for name in ("data.partial", "results.old", "notes.old"):
        assert (tmp_path / name / "file").read_text() == name, name
    assert not (tmp_path / "notes").exists()
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(FileExistsError, match="symbolic link"):
        checkpoint.save({"w": torch.ones(2)}, tmp_path / "link")


def test_a_save_that_fails_early_releases_the_lock(tmp_path):
    import threading

    import torch

    from meshrun.parallel import checkpoint

    with pytest.raises(TypeError):
        checkpoint.save({"w": torch.ones(2), "bad": threading.Lock()}, tmp_path / "step_1",
                        async_=True)
    checkpoint.save({"w": torch.ones(2)}, tmp_path / "step_2")  # not SaveInProgress
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_2")
