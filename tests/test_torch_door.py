"""Every function of meshrun/_torch.py, called against the installed torch (``make compat``
runs this file against other torch versions): each private name it relies on is still there
and does what meshrun needs of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from meshrun import _torch


@pytest.mark.timeout(60)
def test_tensors_pytrees_and_checkpoint_flattening():
    a, b = torch.arange(3.0), torch.ones(2, 2)
    flat = _torch.flatten_dense_tensors([a, b])
    assert flat.shape == (7,)
    back = _torch.unflatten_dense_tensors(flat, [a, b])
    assert all(torch.equal(x, y) for x, y in zip(back, [a, b], strict=True))
    dst = [torch.zeros(3), torch.zeros(2, 2)]
    _torch.foreach_copy_(dst, [a, b])
    assert torch.equal(dst[0], a) and torch.equal(dst[1], b)
    tree = {"x": a, "y": [b, (a,)]}
    leaves, spec = _torch.tree_flatten(tree)
    assert len(leaves) == 3 and len(_torch.tree_leaves(tree)) == 3
    assert torch.equal(_torch.tree_unflatten(leaves, spec)["y"][0], b)
    assert torch.equal(_torch.tree_map(lambda t: t * 2, tree)["x"], a * 2)
    flat_sd, mappings = _torch.flatten_state_dict({"model": {"w": a}, "step": 3})
    assert set(flat_sd) == {"model.w", "step"} and "model.w" in mappings


@pytest.mark.timeout(60)
def test_load_planner_set_up_keeps_what_is_not_a_tensor(tmp_path):
    """A tiny DCP save and load (one process, no process group) through a planner whose set-up
    is the door's: the tensor is loaded in place, a value that is not a tensor stays."""
    import warnings

    import torch.distributed.checkpoint as dcp

    class Planner(dcp.DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            _torch.set_up_load_planner(self, state_dict, metadata, is_coordinator)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "torch.distributed is disabled"
        dcp.save({"model": {"w": torch.arange(4.0)}}, checkpoint_id=str(tmp_path))
        marker = object()
        target = {"model": {"w": torch.zeros(4)}, "mine": marker}
        planner = Planner(flatten_state_dict=True, flatten_sharded_tensors=False)
        planner.set_up_planner(target, None, True)
        assert planner.original_state_dict is target and planner.state_dict["mine"] is marker
        dcp.load({"model": target["model"]}, checkpoint_id=str(tmp_path), planner=Planner(
            flatten_state_dict=True, flatten_sharded_tensors=False))
    assert torch.equal(target["model"]["w"], torch.arange(4.0))


@pytest.mark.timeout(60)
def test_module_slots_and_buffers():
    lin = torch.nn.Linear(2, 2)
    slots = _torch.parameter_slots(lin)
    assert set(slots) == {"weight", "bias"} and slots["weight"] is lin.weight
    plain = lin.weight.detach().clone()
    slots["weight"] = plain  # a plain tensor in the slot: what the strategies do for a forward
    assert lin.weight is plain
    lin.register_buffer("kept", torch.zeros(1))
    lin.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert _torch.non_persistent_buffers(lin) == {"scratch"}


@pytest.mark.timeout(60)
def test_autograd_callback_dropout_and_attention_ops():
    ran = []
    w = torch.ones(2, requires_grad=True)

    def hook(grad):
        _torch.queue_backward_callback(lambda: ran.append(w.grad is not None))
        return grad

    w.register_hook(hook)
    (w * 3).sum().backward()
    assert ran == [True]  # after the pass: the gradient is in place
    assert isinstance(torch.nn.Dropout2d(), _torch.dropout_base())
    forward, backward = _torch.cpu_flash_attention()
    assert forward is not None and backward is not None
    q = torch.randn(1, 2, 4, 8)
    out, lse = forward(q, q, q, 0.0, False, scale=None)[:2]
    assert out.shape == q.shape and lse.shape == (1, 2, 4)
    assert any(op is not None for op in _torch.attention_ops())


_DIST = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    sys.path.insert(0, sys.argv[1])
    import _torch
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(2)
    dist.all_reduce(t)
    out = {"names": [n for _, n in _torch.process_group_names()],
           "groups": len(_torch.all_process_groups())}
    count = _torch.group_count()
    _torch.set_group_count(count + 5)
    out["count_moved"] = _torch.group_count() == count + 5
    _torch.set_group_count(count)
    ring = json.loads(_torch.flight_recorder_dump())
    nccl = json.loads(_torch.flight_recorder_dump(nccl=True))  # NCCL's ring where built in
    out["nccl_dump"] = isinstance(nccl, dict)
    out["has_nccl"] = _torch.has_nccl_flight_recorder() == torch.distributed.is_nccl_available()
    frames = _torch.flight_recorder_frames()  # imports torch._inductor.codecache (symbolizing)
    out["frames"] = [[list(f) for f in frames[e["record_id"]]] for e in ring.get("entries", [])]
    out["ops"] = [e.get("profiling_name") for e in ring.get("entries", [])]
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    _torch.release_mesh_groups(mesh)
    out["released"] = mesh._pg_registry == {}  # torch 2.13 keeps it; an AttributeError fails
    dist.destroy_process_group()
    print(json.dumps(out))
""")


@pytest.mark.timeout(120)
def test_process_groups_flight_recorder_and_mesh(tmp_path):
    """In a fresh process, loading the door by path as the workers do (no meshrun package)."""
    script = tmp_path / "door.py"
    script.write_text(_DIST)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "16", "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, str(script), os.path.dirname(_torch.__file__)],
                          capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "0" in out["names"] and out["groups"] >= 1 and out["count_moved"]
    assert any("all_reduce" in str(op) for op in out["ops"]), out["ops"]
    assert out["has_nccl"]
    # every call's Python frames, innermost first: torch's all_reduce, ..., this script's line
    first = out["frames"][0]
    assert first[0][2] == "all_reduce" and first[-1][0].endswith("door.py"), first
    assert out["released"] and out["nccl_dump"]


@pytest.mark.timeout(60)
def test_agent_store_flag_holds_at_master_port_only():
    """With TORCHELASTIC_USE_AGENT_STORE=True, torch 2.13 makes every store a client; after
    `agent_store_at_master_port_only`, a store on another port is hosted by rank 0 (it answers
    at once, one process), and one on MASTER_PORT is still a client (nobody listens there: it
    fails within its timeout). In a fresh interpreter: the patch changes the module."""
    code = textwrap.dedent("""
        import os, socket, sys, time
        from datetime import timedelta
        import torch.distributed.rendezvous
        from meshrun import _torch

        rendezvous = sys.modules["torch.distributed.rendezvous"]  # the name is also a function

        def free_port():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]

        os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_PORT=str(free_port()))
        assert _torch.agent_store_at_master_port_only(rendezvous) is True
        assert _torch.agent_store_at_master_port_only(rendezvous) is False  # once
        own = rendezvous._create_c10d_store("127.0.0.1", free_port(), 0, 1, timedelta(seconds=20))
        own.set("k", "v")
        assert own.get("k") == b"v"
        assert rendezvous._torchelastic_use_agent_store()  # outside a store's making: the flag
        t0 = time.monotonic()
        try:
            rendezvous._create_c10d_store("127.0.0.1", int(os.environ["MASTER_PORT"]), 0, 1,
                                          timedelta(seconds=2))
        except Exception:
            pass
        else:
            raise AssertionError("a store on MASTER_PORT was hosted, not a client of the agent's")
        print("ok", round(time.monotonic() - t0, 1))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
