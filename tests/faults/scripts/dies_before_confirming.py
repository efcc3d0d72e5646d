"""``examples/train_char_lm.py``, except that the node of GROUP_RANK ``DIE_NODE`` (default 1)
dies whole in round 0 at the end of step ``DIE_AT_STEP``: once its neighbour copies of that step were exchanged
(its `Copies.settle` returned) and before the all-reduce that confirms them, it SIGKILLs its
agent and itself. The survivors then hold that step's copies without knowing whether every
rank does (tests/faults/test_elastic_in_place.py)."""

import os
import runpy
import signal
import sys
from pathlib import Path

from meshrun.parallel.fsdp.copies import Copies

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_char_lm.py"

if (os.environ.get("GROUP_RANK") == os.environ.get("DIE_NODE", "1")
        and os.environ.get("MESHRUN_ROUND") == "0"):
    die_at = int(os.environ["DIE_AT_STEP"])
    confirm = Copies.confirm

    def dies_before_the_confirmation(self: Copies) -> None:
        if self.held and max(step for _, step in self.held) == die_at:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: the node is gone
            os.kill(os.getpid(), signal.SIGKILL)
        confirm(self)

    Copies.confirm = dies_before_the_confirmation

sys.argv = [str(EXAMPLE), *sys.argv[1:]]
sys.path.insert(0, str(EXAMPLE.parent))
runpy.run_path(str(EXAMPLE), run_name="__main__")
