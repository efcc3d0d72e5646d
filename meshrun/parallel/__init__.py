"""meshrun.parallel: the worker-side library (DESIGN.md §4).

Imported by training scripts, never by the launcher. Each strategy is a function applied to a
model with an explicit process group or mesh; there are no module-level global groups.

- `init()` -> `ParallelContext`: join the process group described by the torchrun env.
- `Mesh`: named N-D mesh of ranks, one process group per axis.
- `ddp()`: data parallelism with bucketed, overlapped gradient all-reduce.
- `agree_num_batches()`: uneven inputs; every rank runs the minimum number of batches.
- `heartbeat()`: progress for ``meshrun --hang-timeout`` (the strategies call it every step).
"""

from meshrun.parallel.context import ParallelContext, init
from meshrun.parallel.ddp import agree_num_batches, ddp
from meshrun.parallel.heartbeat import heartbeat
from meshrun.parallel.mesh import Mesh

__all__ = ["Mesh", "ParallelContext", "agree_num_batches", "ddp", "heartbeat", "init"]
