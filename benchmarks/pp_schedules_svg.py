"""Pictures of meshrun's pipeline schedules, as `meshrun.parallel.pipelining.simulate` runs them.

    .venv/bin/python benchmarks/pp_schedules_svg.py [--ranks 4] [--microbatches 8]
                                                    [--chunks 2] [-o pp_schedules.html]

Simulates GPipe, 1F1B, interleaved 1F1B (``--chunks`` stages per rank) and the zero-bubble
ZB-H1 and ZB-V (two stages per rank in a V) with forward = 1 and backward = 2 cost units per
stage, the split ones as B = W = 1 (no message delay) and writes one self-contained HTML page with one
picture per schedule (`meshrun.launcher.timeline.schedule_svg`: the same kind of lane chart as
``meshrun timeline``), one lane per pipeline rank, each action a bar labelled with its kind and
microbatch. Prints each schedule's makespan and bubble next to the textbook formula. A
measured step's schedule is drawn the same way: pass ``(rank, microbatch, kind, start, end)``
rows with measured times to `schedule_svg`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshrun.launcher.timeline import schedule_svg  # noqa: E402
from meshrun.parallel.pipelining import (  # noqa: E402
    bubble_formula,
    gpipe_order,
    interleaved_1f1b_order,
    one_f_one_b_order,
    simulate,
    zb_h1_order,
    zbv_order,
    zero_bubble_formula,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=2, help="stages per rank (interleaved)")
    parser.add_argument("-o", "--output", type=Path, default=Path("pp_schedules.html"))
    args = parser.parse_args()
    p, m, v = args.ranks, args.microbatches, args.chunks
    schedules = [
        ("GPipe", gpipe_order(p, m), 1),
        ("1F1B", one_f_one_b_order(p, m), 1),
        (f"Interleaved 1F1B, {v} stages per rank", interleaved_1f1b_order(p, m, v), v),
        ("ZB-H1", zb_h1_order(p, m), 1),
        ("ZB-V, 2 stages per rank", zbv_order(p, m), 2),
    ]
    pictures = []
    print(f"{'schedule':<36} {'makespan':>9} {'bubble':>7} {'formula':>8}")
    for name, order, chunks in schedules:
        # each of a rank's v chunks costs 1/v of a whole stage
        sim = simulate(order, forward=1.0 / chunks, backward=2.0 / chunks,
                       weight=1.0 / chunks)
        rows = [(r, a.microbatch, a.kind, *sim.times[a]) for r, acts in order.items() for a in acts]
        formula = (zero_bubble_formula("zbh1" if chunks == 1 else "zbv", p, m)
                   if name.startswith("ZB") else bubble_formula(p, m, chunks))
        print(f"{name:<36} {sim.makespan:>9.3f} {sim.bubble_fraction:>7.3f} {formula:>8.3f}")
        title = f"{name}: p={p}, m={m}, bubble {sim.bubble_fraction:.3f}"
        pictures.append(schedule_svg(rows, title=title, unit="units", lane_label="rank"))
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>meshrun pipeline schedules</title></head>\n<body>\n"
        + "<br>\n".join(pictures)
        + "</body></html>\n"
    )
    args.output.write_text(page)
    print(f"-> {args.output}")


if __name__ == "__main__":
    main()
