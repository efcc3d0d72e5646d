"""Worker: a Stateful whose state_dict raises on rank 1 only, saved sync then async: every rank
must raise (none waits for the others), and the next save must work."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from meshrun.parallel import checkpoint
from tests.parallel.harness import run_checks


class FailsOnRank1(Stateful):
    def state_dict(self):
        if dist.get_rank() == 1:
            raise KeyError("broken on rank 1")
        return {"x": torch.ones(2)}

    def load_state_dict(self, state_dict):
        pass


def main():
    directory = sys.argv[1]

    def every_rank_raises(ctx):
        for background in (False, True):
            try:
                checkpoint.save({"s": FailsOnRank1()}, f"{directory}/step_1", async_=background)
            except KeyError as e:
                assert ctx.rank == 1 and "broken on rank 1" in str(e), e
            except RuntimeError as e:
                assert ctx.rank == 0 and "rank 1 failed before writing: KeyError" in str(e), e
            else:
                raise AssertionError("the save did not raise")
        checkpoint.save({"w": torch.arange(3.0)}, f"{directory}/step_2")  # lock released
        assert checkpoint.latest(directory) == f"{directory}/step_2"

    run_checks([every_rank_raises])


if __name__ == "__main__":
    main()
