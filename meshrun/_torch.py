"""torch's private names, behind one door: the only module of meshrun that touches them.

torch keeps some of what meshrun needs under names with a leading underscore: no promise of
stability comes with them, and a torch release may move or drop any. So every use is here, as
a small function that says what it relies on and which torch versions were checked
(`tests/test_private_torch.py` fails on a private torch name anywhere else in the package;
`tests/test_torch_door.py` calls every function here against the installed torch, and is part
of ``make compat``, so a new torch is tried against each of them).

Checked: torch 2.13.0, run (the CPU wheel the suite runs on; every function is called by
tests/test_torch_door.py); torch 2.14.1, read, not run (the Python sources of the CUDA 2.14.1
wheel, and the names its ``libtorch_python.so`` exports: every name below is there, with the
same signature where it is Python). torch 2.15 was not checked (no copy of it was at hand).
``make compat TORCH=<version>`` runs tests/test_torch_door.py against another torch; it has not
been run on 2.14.1 or 2.15.0 since these functions were gathered here.

Stdlib only at import, and nothing of meshrun: workers load this file by path before the
script imports torch (``meshrun/agent/collective_record.py``), so torch is imported inside each
function, when it is called.
"""

from __future__ import annotations

import importlib


def _module(name: str):
    return importlib.import_module(name)


# -- torch.distributed's process-group registry ------------------------------------------------


def process_group_names(dist=None) -> list[tuple[object, str]]:
    """Every live process group of this process with its global name, as torch's flight
    recorder names it: ``[(ProcessGroup, "0"), ...]``. ``dist`` is ``torch.distributed``
    (the default), or a stand-in of it with the same shape (tests).

    Relies on ``torch.distributed.distributed_c10d._world.pg_names`` (a dict of group ->
    name); torch 2.13.0, 2.14.1."""
    dist = dist if dist is not None else _module("torch.distributed")
    return list(dist.distributed_c10d._world.pg_names.items())


def all_process_groups() -> list:
    """Every process group of this process, the default one included (to abort them all).

    Relies on ``torch.distributed.distributed_c10d._world.pg_map``; torch 2.13.0, 2.14.1."""
    return list(_module("torch.distributed.distributed_c10d")._world.pg_map)


def group_count() -> int:
    """How many process groups torch has numbered in this process (the next group's default
    name derives from it).

    Relies on ``torch.distributed.distributed_c10d._world.group_count``; torch 2.13.0,
    2.14.1."""
    return _module("torch.distributed.distributed_c10d")._world.group_count


def set_group_count(count: int) -> None:
    """Put torch's group count back to ``count``: a failed ``init_process_group`` counts a
    group that never formed, and a fresh process joining the same world would name its groups
    from 0 while this one names them from 1 (torch resets the count only in destroy).

    Relies on ``torch.distributed.distributed_c10d._world.group_count`` being writable (a
    property with a setter); torch 2.13.0, 2.14.1."""
    _module("torch.distributed.distributed_c10d")._world.group_count = count


def release_mesh_groups(device_mesh) -> None:
    """Drop the process groups a ``DeviceMesh`` keeps, so their connections close although
    the mesh object may still be referenced (gloo closes a pair's socket only when its group
    object is freed).

    Relies on ``DeviceMesh._pg_registry`` (a dict; absent in other versions: then nothing is
    done); torch 2.13.0, 2.14.1."""
    registry = getattr(device_mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()


# -- the flight recorder -----------------------------------------------------------------------


def flight_recorder_dump(nccl: bool = False) -> str | bytes:
    """torch's flight recorder ring as JSON (entries, and per group the last sequence numbers
    enqueued and completed), without stack traces: ``_dump_fr_trace_json(True, False)``
    (include collectives, not only_active). With ``nccl=True`` and a CUDA build, NCCL's own
    ring (``_dump_nccl_trace_json(True, False)``: ProcessGroupNCCL records into a ring of its
    own, which the common one does not hold), else the common one.

    Relies on ``torch._C._distributed_c10d._dump_fr_trace_json`` and, for NCCL,
    ``_dump_nccl_trace_json`` (includeCollectives, onlyActive); torch 2.13.0 (the common ring,
    on gloo), 2.14.1 (both names exported by the CUDA build's libtorch_python.so, with those
    arguments). The NCCL variant is not in CPU builds and was not run here."""
    c10d = _module("torch._C._distributed_c10d")
    if nccl and hasattr(c10d, "_dump_nccl_trace_json"):
        return c10d._dump_nccl_trace_json(True, False)
    return c10d._dump_fr_trace_json(True, False)


def has_nccl_flight_recorder() -> bool:
    """Whether this torch has NCCL's own flight-recorder ring (a CUDA build with NCCL).

    Relies on ``torch._C._distributed_c10d._dump_nccl_trace_json`` being present; torch
    2.13.0 CPU (absent), 2.14.1 CUDA (present, read from its libtorch_python.so)."""
    return hasattr(_module("torch._C._distributed_c10d"), "_dump_nccl_trace_json")


def flight_recorder_frames(nccl: bool = False) -> dict[int, list[tuple[str, int, str]]]:
    """The Python stack of every call in the flight recorder ring, by the entry's
    ``record_id``: ``{record_id: [(filename, line, function), ...]}``, innermost first (as
    torch captured it when the call was issued). The JSON dump has no frames; this reads the
    pickle dump, ``_dump_fr_trace(True, True, False)`` (collectives, stack traces, not
    only_active), or NCCL's, ``_dump_nccl_trace(True, True, False)``, with ``nccl=True`` where
    torch has it. torch records Python frames of every call by default (C++ frames only with
    ``TORCH_NCCL_TRACE_CPP_STACK=1``, not needed here). Unpickling is of torch's own bytes, in
    this process.

    Relies on ``torch._C._distributed_c10d._dump_fr_trace`` / ``_dump_nccl_trace`` returning a
    pickled dict whose ``entries`` carry ``record_id`` and ``frames`` (dicts of ``filename``,
    ``line``, ``name``); torch 2.13.0 (run: the common ring, on gloo), 2.14.1 (both names in
    the CUDA build, same docstring and arguments; not run)."""
    import pickle

    c10d = _module("torch._C._distributed_c10d")
    dump = (c10d._dump_nccl_trace if nccl and hasattr(c10d, "_dump_nccl_trace")
            else c10d._dump_fr_trace)(True, True, False)  # fmt: skip
    out: dict[int, list[tuple[str, int, str]]] = {}
    for e in pickle.loads(dump).get("entries", []):
        frames = e.get("frames") or []
        out[int(e.get("record_id", -1))] = [
            (str(f.get("filename", "")), int(f.get("line", 0)), str(f.get("name", "")))
            for f in frames
        ]
    return out


# -- autograd ----------------------------------------------------------------------------------


def queue_backward_callback(fn) -> None:
    """Run ``fn()`` once the running backward pass has finished (all gradients computed),
    from inside that backward: DDP's and FSDP's end-of-backward work.

    Relies on ``torch.autograd.Variable._execution_engine.queue_callback`` (what torch's own
    DDP and FSDP use); torch 2.13.0, 2.14.1."""
    _module("torch").autograd.Variable._execution_engine.queue_callback(fn)


def dropout_base() -> type:
    """The base class of every dropout module (``nn.Dropout``, ``nn.Dropout2d``, ...).

    Relies on ``torch.nn.modules.dropout._DropoutNd``; torch 2.13.0, 2.14.1."""
    return _module("torch.nn.modules.dropout")._DropoutNd


# -- tensors -----------------------------------------------------------------------------------


def flatten_dense_tensors(tensors):
    """One flat 1-D tensor of ``tensors`` (all of one dtype and device), for one collective
    over many: ``torch._utils._flatten_dense_tensors``; torch 2.13.0, 2.14.1."""
    return _module("torch._utils")._flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat, tensors):
    """Views of ``flat`` shaped as ``tensors``: ``torch._utils._unflatten_dense_tensors``;
    torch 2.13.0, 2.14.1 (the same source)."""
    return _module("torch._utils")._unflatten_dense_tensors(flat, tensors)


def foreach_copy_(destinations, sources) -> None:
    """``destinations[i].copy_(sources[i])`` for every i, as one fused op:
    ``torch._foreach_copy_``; torch 2.13.0, 2.14.1."""
    _module("torch")._foreach_copy_(destinations, sources)


# -- pytrees -----------------------------------------------------------------------------------


def tree_flatten(tree):
    """``(leaves, spec)`` of a nested structure: ``torch.utils._pytree.tree_flatten``; torch
    2.13.0, 2.14.1."""
    return _module("torch.utils._pytree").tree_flatten(tree)


def tree_unflatten(leaves, spec):
    """The structure ``spec`` with ``leaves`` put back: ``torch.utils._pytree.tree_unflatten``;
    torch 2.13.0, 2.14.1."""
    return _module("torch.utils._pytree").tree_unflatten(leaves, spec)


def tree_map(fn, tree):
    """``tree`` with ``fn`` applied to every leaf: ``torch.utils._pytree.tree_map``; torch
    2.13.0, 2.14.1."""
    return _module("torch.utils._pytree").tree_map(fn, tree)


def tree_leaves(tree) -> list:
    """The leaves of ``tree``: ``torch.utils._pytree.tree_leaves``; torch 2.13.0, 2.14.1."""
    return _module("torch.utils._pytree").tree_leaves(tree)


# -- distributed checkpoints -------------------------------------------------------------------


def flatten_state_dict(state_dict):
    """``(flat, mappings)``: a nested state dict as one level of dotted keys, and how to undo
    it, as DCP's load planner expects them.

    Relies on ``torch.distributed.checkpoint._nested_dict.flatten_state_dict`` (what
    ``DefaultLoadPlanner.set_up_planner`` calls); torch 2.13.0, 2.14.1."""
    return _module("torch.distributed.checkpoint._nested_dict").flatten_state_dict(state_dict)


def set_up_load_planner(planner, state_dict, metadata, is_coordinator: bool) -> None:
    """``DefaultLoadPlanner.set_up_planner`` for ``planner`` (a ``DefaultLoadPlanner`` made
    with ``flatten_state_dict=True, flatten_sharded_tensors=False``), less its first step,
    ``_init_state_dict``: that one only materialises meta tensors and replaces every value
    that is not a tensor by None, which would drop a loader's own tensor-like values
    (meshrun's ``ShardedBlocks``). The rest of the planner then works as torch's.

    Relies on the attributes the default planner's other methods read (``original_state_dict``,
    ``state_dict``, ``mappings``, ``metadata``, ``is_coordinator``: none documented) and on
    `flatten_state_dict`; torch 2.13.0, 2.14.1 (``DefaultLoadPlanner`` up to
    ``create_local_plan`` has the same source in both)."""
    planner.original_state_dict = state_dict
    planner.state_dict, planner.mappings = flatten_state_dict(state_dict)
    planner.metadata, planner.is_coordinator = metadata, is_coordinator


# -- modules -----------------------------------------------------------------------------------


def parameter_slots(module) -> dict:
    """``module``'s own parameters as torch keeps them: the live dict of name -> Parameter
    (or None) behind ``named_parameters(recurse=False)``. A strategy puts a plain tensor in a
    slot for a forward (an all-gathered or differentiable view of the parameter), which
    ``setattr`` refuses (it takes only a Parameter there), and puts the parameter back after.

    Relies on ``torch.nn.Module._parameters`` (what torch's own FSDP writes); torch 2.13.0,
    2.14.1."""
    return module._parameters


def non_persistent_buffers(module) -> set[str]:
    """The names of ``module``'s own buffers registered with ``persistent=False`` (left out of
    its ``state_dict``; torch has no public question for it).

    Relies on ``torch.nn.Module._non_persistent_buffers_set``; torch 2.13.0, 2.14.1."""
    return module._non_persistent_buffers_set


# -- attention kernels -------------------------------------------------------------------------


def cpu_flash_attention():
    """``(forward, backward)``: torch's fused CPU attention kernel, which returns the
    log-sum-exp a ring-attention block needs, and its backward; ``(None, None)`` where torch
    has them not.

    Relies on ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its
    ``_backward``; torch 2.13.0, 2.14.1."""
    aten = _module("torch").ops.aten
    return (getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None),
            getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None))


def attention_ops() -> tuple:
    """The fused attention ops whose outputs selective activation checkpointing keeps (what
    ``F.scaled_dot_product_attention`` dispatches to), those this torch has.

    Relies on ``torch.ops.aten._scaled_dot_product_flash_attention``,
    ``_scaled_dot_product_flash_attention_for_cpu``, ``_scaled_dot_product_efficient_attention``
    and ``_scaled_dot_product_cudnn_attention`` (the op packets; None for one this torch
    lacks); torch 2.13.0, 2.14.1."""
    aten = _module("torch").ops.aten
    names = ("_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return tuple(getattr(aten, n, None) for n in names)


# -- torch.distributed.rendezvous: the agent's store flag -----------------------------------------


def agent_store_at_master_port_only(rendezvous) -> bool:
    """Make ``TORCHELASTIC_USE_AGENT_STORE=True`` mean "the agent hosts a store at
    ``MASTER_PORT``" only, in ``rendezvous`` (the module ``torch.distributed.rendezvous``, just
    executed); True when installed, False when it already was.

    torch 2.13's ``_create_c10d_store(hostname, port, rank, world_size, timeout, use_libuv)``
    gives every rank a client-only TCPStore whenever the flag is set
    (``_torchelastic_use_agent_store()``), whatever the port: a script's own
    ``init_method="tcp://host:P2"`` on a port other than MASTER_PORT then has no server, and every
    rank waits out the store timeout (30 minutes on gloo). As upstream's fix does (pytorch PR
    192113, not in 2.13; TCPStore's C++ constructor already honours the flag only where the port
    is MASTER_PORT), the flag holds here only while a store is made for the port in
    ``MASTER_PORT`` as the environment says it at that moment (in-place recovery moves it); for
    another port rank 0 hosts, as without an agent. ``env://`` is unchanged.

    Relies on: ``_create_c10d_store`` taking the port second and reading the flag through the
    module-level ``_torchelastic_use_agent_store()`` when called (torch 2.13.0, run).
    """
    import os
    import threading

    create, flag = rendezvous._create_c10d_store, rendezvous._torchelastic_use_agent_store
    if getattr(create, "_meshrun_agent_store_wrapper", False):
        return False
    making = threading.local()  # the port of the store being made on this thread

    def use_agent_store() -> bool:
        port = getattr(making, "port", None)
        if port is not None:
            try:
                if int(port) != int(os.environ.get("MASTER_PORT", "")):
                    return False
            except ValueError:
                return False
        return flag()

    def create_c10d_store(hostname, port, *args, **kwargs):
        making.port = port
        try:
            return create(hostname, port, *args, **kwargs)
        finally:
            making.port = None

    create_c10d_store._meshrun_agent_store_wrapper = True
    create_c10d_store.__doc__ = create.__doc__
    rendezvous._torchelastic_use_agent_store = use_agent_store
    rendezvous._create_c10d_store = create_c10d_store
    return True
