"""Prints, as JSON, what a worker's start-up left: sys.path, PYTHONPATH, whether the user's own
sitecustomize ran, and whether meshrun's exit guard is installed."""

import json
import os
import sys

print(json.dumps({
    "sys_path": sys.path,
    "pythonpath": os.environ.get("PYTHONPATH", ""),
    "user_site_ran": os.environ.get("USER_SITECUSTOMIZE_RAN") == "1",
    "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
    "guard": bool(getattr(sys.modules.get("_meshrun_exit_guard_owner"), "installed", False)),
}), flush=True)
