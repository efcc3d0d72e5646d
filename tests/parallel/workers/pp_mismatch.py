"""Stage 0 outputs 16 features, stage 1 takes 12: run 1F1B and let it fail (argv[1] picks
whether stage 1 declares its input shape with ``input_args``). Expected: stage 1 raises an
error naming itself; the launcher stops stage 0, which would otherwise wait for a gradient."""

import sys

import torch
from torch import nn

from meshrun.parallel import init
from meshrun.parallel.pipelining import PipelineStage, Schedule1F1B


def main():
    ctx = init(timeout=60)
    torch.manual_seed(0)
    modules = [nn.Linear(6, 16), nn.Linear(12, 3)]  # wrong split: 16 out, 12 in
    declared = sys.argv[1] == "declared"
    input_args = torch.empty(2, 12) if declared and ctx.rank == 1 else None
    stage = PipelineStage(modules[ctx.rank], ctx.rank, 2, input_args=input_args)
    schedule = Schedule1F1B(stage, 4, nn.functional.mse_loss)
    schedule.step(torch.randn(8, 6), target=torch.randn(8, 3))
    print("the mismatch was not detected", flush=True)


if __name__ == "__main__":
    main()
