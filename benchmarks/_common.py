"""Pieces the benchmarks share (not a benchmark by itself)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a benchmark's own gloo group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_char_lm():
    """The example's char LM with its batches and loss: ``(model, batch(step, rank), loss_fn)``.

    Needs ``examples/`` on ``sys.path``. Batches are the example's own (2 data-parallel ranks).
    """
    import train_char_lm as lm

    data, vocab = lm.load_text()
    model = lm.CharLM(vocab, lm.DEFAULTS["block_size"])

    def batch(step, rank):
        return lm.get_batch(data, step, 0, lm.DEFAULTS["batch_size"], lm.DEFAULTS["block_size"],
                            rank, 2)

    def loss_fn(m, x, y):
        return m(x, y)

    return model, batch, loss_fn
