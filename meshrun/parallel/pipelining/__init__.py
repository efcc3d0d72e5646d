"""meshrun.parallel.pipelining: pipeline parallelism, manual split, validated schedules.

- `PipelineStage`: one stage on this rank; `split_into_stages`: balanced stages from a list
  of blocks (first stage keeps the embedding, last keeps the head).
- `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`, and the zero-bubble
  `ScheduleZBH1` and `ScheduleZBV` (backward split into B and W): named as torch names them;
  ``schedule.step(x, target=y, losses=[])`` and ``schedule.eval(x)``.
- `PipelineSchedule(stages, n, loss_fn, order=...)`: any validated hand-written order.
- `Action`, `validate_schedule`, `simulate`: schedules as data, checked and costed in one
  process without a process group.
- `pipeline(stage_modules, group, schedule=..., n_microbatches=..., loss_fn=...)`.
"""

from meshrun.parallel.pipelining.actions import Action, format_order, parse_order
from meshrun.parallel.pipelining.orders import (
    forward_only,
    gpipe_order,
    interleaved_1f1b_order,
    one_f_one_b_order,
    zb_h1_order,
    zbv_order,
)
from meshrun.parallel.pipelining.runtime import PipelineSchedule
from meshrun.parallel.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBH1,
    ScheduleZBV,
    check_no_shared_parameters,
    pipeline,
)
from meshrun.parallel.pipelining.simulate import (
    Simulation,
    bubble_formula,
    simulate,
    zero_bubble_formula,
)
from meshrun.parallel.pipelining.stage import PipelineStage, StageModule, split_into_stages
from meshrun.parallel.pipelining.validate import ScheduleError, validate_schedule

__all__ = ["Action", "PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleError",
           "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleZBH1", "ScheduleZBV",
           "Simulation", "StageModule", "bubble_formula", "check_no_shared_parameters",
           "format_order", "forward_only", "gpipe_order", "interleaved_1f1b_order",
           "one_f_one_b_order", "parse_order", "pipeline", "simulate", "split_into_stages",
           "validate_schedule", "zb_h1_order", "zbv_order", "zero_bubble_formula"]
