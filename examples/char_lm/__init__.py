"""The char LM that examples/train_char_lm.py trains, in three files: `model` (the
transformer), `data` (windows, epochs, the global batch split into microbatches) and
`parallelize` (one mesh, the strategies in a fixed order, one step's forward / backward and
gradient clip). Their public names are re-exported here.

The script's plumbing sits beside them, imported by module: `flags` (the options and their
checks), `checkpointing` (saves, resume, the stop request), `optim` (the optimizer and the
learning rate) and `in_place` (the ``--elastic in-place`` loop)."""

from char_lm.data import (
    DATA,
    accumulation_steps,
    batch_summary,
    ceil_div,
    check_batch,
    epoch_order,
    load_text,
    microbatches,
    window_ids,
    windows,
)
from char_lm.model import N_EMBD, N_HEAD, N_LAYER, Block, CharLM
from char_lm.parallelize import (
    Parallel,
    clip_gradients,
    forward_backward,
    layout_problem,
    parallelize_lm,
    tp_plan,
)

__all__ = ["DATA", "N_EMBD", "N_HEAD", "N_LAYER", "Block", "CharLM", "Parallel",
           "accumulation_steps", "batch_summary", "ceil_div", "check_batch", "clip_gradients",
           "epoch_order", "forward_backward", "layout_problem", "load_text", "microbatches",
           "parallelize_lm", "tp_plan", "window_ids", "windows"]
