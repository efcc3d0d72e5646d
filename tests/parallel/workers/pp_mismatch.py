"""Shapes that do not fit between two stages; run 1F1B and let it fail. argv[1]:

- "declared" / "undeclared": stage 0 outputs 16 features, stage 1 takes 12 (declared with
  ``input_args``, or not). Expected: stage 1 raises an error naming itself; the launcher stops
  stage 0, which would otherwise wait for a gradient.
- "changed": a right split, but the second step's batch is half the first's. Expected: stage
  0 raises on its batch, the last stage on its target (shapes are fixed by the first step),
  both before any message, so neither waits for the other.
"""

import sys

import torch
from torch import nn

from meshrun.parallel import init
from meshrun.parallel.pipelining import PipelineStage, Schedule1F1B


def main():
    ctx = init(timeout=60)
    torch.manual_seed(0)
    mode = sys.argv[1]
    width = 16 if mode == "changed" else 12  # else a wrong split: 16 out, 12 in
    modules = [nn.Linear(6, 16), nn.Linear(width, 3)]
    input_args = torch.empty(2, 12) if mode == "declared" and ctx.rank == 1 else None
    stage = PipelineStage(modules[ctx.rank], ctx.rank, 2, input_args=input_args)
    schedule = Schedule1F1B(stage, 4, nn.functional.mse_loss)
    for batch in (8, 4) if mode == "changed" else (8,):
        schedule.step(torch.randn(batch, 6), target=torch.randn(batch, 3))
    print("the mismatch was not detected", flush=True)


if __name__ == "__main__":
    main()
