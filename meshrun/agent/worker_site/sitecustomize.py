"""Run at the start of every Python worker meshrun spawns (this folder leads its PYTHONPATH).

1. Installs `meshrun.exit_guard` (loaded by path: the worker's interpreter need not have
   meshrun installed, and the ``meshrun`` package is not imported), so a script that finished
   its work is not killed by torch's native threads at interpreter exit.
2. Takes this folder off ``sys.path`` again and runs the ``sitecustomize`` the worker would
   have run without it (the next one on ``sys.path``), so the script sees the path and the
   start-up it would see under torchrun.

Kept to the standard library and to names that cannot clash with the script's; an error here
is printed as one line and never stops the worker.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _meshrun_worker_site() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    guard_file = os.path.join(os.path.dirname(os.path.dirname(here)), "exit_guard.py")
    try:
        spec = importlib.util.spec_from_file_location("_meshrun_exit_guard", guard_file)
        guard = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = guard
        spec.loader.exec_module(guard)
        guard.install()
    except Exception as e:  # the worker runs on without the guard
        sys.modules.pop("_meshrun_exit_guard", None)
        print(f"meshrun: exit guard not installed ({type(e).__name__}: {e})", file=sys.stderr)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    theirs = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = theirs  # what `import sitecustomize` now returns
    spec.loader.exec_module(theirs)


_meshrun_worker_site()
del _meshrun_worker_site
