"""Run at the start of every Python worker meshrun spawns (this folder leads its PYTHONPATH).

1. Installs `meshrun.exit_guard` (loaded by path: the worker's interpreter need not have
   meshrun installed, and the ``meshrun`` package is not imported), so a script that finished
   its work is not killed by torch's native threads at interpreter exit.
2. Arms ``faulthandler`` on meshrun's stack signal (`meshrun.worker_signals.arm_stack_dump`,
   loaded the same way), so the agent gets the worker's Python stacks without ptrace rights,
   for every Python worker, whether or not the script uses ``meshrun.parallel``.
3. Starts the collective record's thread (`meshrun.agent.collective_record.Recorder`, loaded the
   same way) when the agent asked for it (``MESHRUN_COLLECTIVE_RECORD``).
4. Has ``TORCHELASTIC_USE_AGENT_STORE`` honoured at MASTER_PORT only: once
   ``torch.distributed.rendezvous`` is executed (an import hook, `_AgentStoreAtMasterPort`:
   torch is not imported here), `meshrun._torch.agent_store_at_master_port_only` patches it, so
   a script's own ``init_method="tcp://host:P2"`` on another port gets a store that rank 0
   hosts instead of a client on every rank and a 30-minute wait (upstream's fix, pytorch PR
   192113, is not in torch 2.13).
5. Takes this folder off ``sys.path`` again and runs the ``sitecustomize`` the worker would
   have run without it (the next one on ``sys.path``), so the script sees the path and the
   start-up it would see under torchrun.

Kept to the standard library and to names that cannot clash with the script's; an error here
is printed as one line and never stops the worker.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _meshrun_load(name: str, path: str):
    """Load one of meshrun's standard-library-only modules by path (the ``meshrun`` package is
    not imported); None, with one line on stderr, when that fails (the worker runs on)."""
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    except Exception as e:
        sys.modules.pop(name, None)
        what = os.path.basename(path)
        print(f"meshrun: {what} not loaded ({type(e).__name__}: {e})", file=sys.stderr)
        return None


class _AgentStoreAtMasterPort:
    """A ``sys.meta_path`` finder for ``torch.distributed.rendezvous`` only: it finds the module
    with the finders after it, and once the module has executed, hands it to
    `meshrun._torch.agent_store_at_master_port_only` (loaded by path, as ``_meshrun_torch``).
    It leaves ``sys.meta_path`` at its first use; every other import costs a name comparison."""

    NAME = "torch.distributed.rendezvous"

    def __init__(self, door_file: str):
        self._door_file = door_file

    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, door_file = loader.exec_module, self._door_file

        def exec_and_patch(module) -> None:
            exec_module(module)
            try:
                door = sys.modules.get("_meshrun_torch") or _meshrun_load("_meshrun_torch",
                                                                           door_file)
                if door is not None:
                    door.agent_store_at_master_port_only(module)
            except Exception as e:  # the worker runs on with torch's own behaviour
                print(f"meshrun: the agent store flag stays torch's ({type(e).__name__}: {e})",
                      file=sys.stderr)

        loader.exec_module = exec_and_patch  # this spec's own loader object
        return spec


def _meshrun_worker_site() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    agent_dir = os.path.dirname(here)
    if os.environ.get("MESHRUN_EXIT_GUARD") != "0":
        guard_file = os.path.join(os.path.dirname(agent_dir), "exit_guard.py")
        guard = _meshrun_load("_meshrun_exit_guard", guard_file)
        if guard is not None:
            guard.install()
    signals = _meshrun_load("_meshrun_worker_signals",
                            os.path.join(os.path.dirname(agent_dir), "worker_signals.py"))
    if signals is not None:
        signals.arm_stack_dump()
    if os.environ.get("MESHRUN_COLLECTIVE_RECORD", "0") != "0":
        record = _meshrun_load("_meshrun_collectives",
                               os.path.join(agent_dir, "collective_record.py"))
        if record is not None:
            record.start_recorder_from_env()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        door_file = os.path.join(os.path.dirname(agent_dir), "_torch.py")
        sys.meta_path.insert(0, _AgentStoreAtMasterPort(door_file))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    theirs = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = theirs  # what `import sitecustomize` now returns
    spec.loader.exec_module(theirs)


_meshrun_worker_site()
del _meshrun_worker_site  # _meshrun_load stays: the worker site's functions call it (and the hook)
