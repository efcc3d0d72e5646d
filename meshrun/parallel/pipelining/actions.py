"""`Action`: one unit of pipeline work, and the dependency rules every schedule obeys.

A schedule is data: for each rank of the pipeline group, the ordered list of actions it runs
in one step. An action is (stage, kind, microbatch) with kind ``F`` (forward) or ``B``
(backward, input and weight gradients together), written compactly as ``"0F1"`` (stage 0,
forward, microbatch 1), as torch.distributed.pipelining writes its ``_Action``.

Placement is "loop" style, as in torch and Megatron-LM: with ``p`` ranks and ``p * v``
stages, stage ``s`` runs on rank ``s % p`` (rank r holds stages r, r + p, r + 2p, ...), so
neighbouring stages always sit on different ranks when p > 1 and the last stage is on rank
p - 1.

Dependencies (the only waits there are; the runtime's sends never block):

- ``F(s, m)`` needs the activation of ``F(s-1, m)`` (s > 0).
- ``B(s, m)`` needs ``F(s, m)`` (same rank) and the gradient of ``B(s+1, m)`` (s < last).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"
KINDS = (FORWARD, BACKWARD)

_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FB])\s*(\d+)\s*$")

Order = dict[int, list["Action"]]  # pipeline rank -> the actions it runs, in order


@dataclass(frozen=True)
class Action:
    """One action of a schedule: run ``kind`` of ``stage`` on ``microbatch``.

    Attributes:
        stage: global stage index, 0 <= stage < num_stages.
        kind: ``"F"`` (forward) or ``"B"`` (backward).
        microbatch: microbatch index, 0 <= microbatch < n_microbatches.

    ``str(Action(0, "F", 1)) == "0F1"``; `Action.parse` reads that form back. Mirrors
    ``torch.distributed.pipelining.schedules._Action`` (F and B only: no split backward).
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action: kind must be 'F' or 'B' (got {self.kind!r})")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action: stage and microbatch must be >= 0 (got stage "
                             f"{self.stage}, microbatch {self.microbatch})")

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"2B3"`` -> ``Action(2, "B", 3)``. Raises ValueError on any other form."""
        match = _ACTION_RE.match(text)
        if not match:
            raise ValueError(f"Action.parse: expected STAGE F|B MICROBATCH such as '0F1' "
                             f"(got {text!r})")
        return cls(int(match[1]), match[2], int(match[3]))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"


def parse_order(spec: dict[int, str | list[str]]) -> Order:
    """Build an order from text: ``{0: "0F0 0F1 0B0 0B1", 1: [...]}`` (spaces or commas)."""
    order = {}
    for rank, actions in spec.items():
        items = actions.replace(",", " ").split() if isinstance(actions, str) else actions
        order[int(rank)] = [a if isinstance(a, Action) else Action.parse(a) for a in items]
    return order


def format_order(order: Order) -> str:
    """One line per rank: ``rank 0: 0F0 0F1 0B0 0B1``."""
    return "\n".join(f"rank {r}: {' '.join(map(str, order[r]))}" for r in sorted(order))


def stage_rank(stage: int, num_ranks: int) -> int:
    """The pipeline rank that runs ``stage`` (loop placement: ``stage % num_ranks``)."""
    return stage % num_ranks


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """The actions whose results ``action`` needs (see the module docstring)."""
    s, m = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [Action(s - 1, FORWARD, m)] if s > 0 else []
    deps = [Action(s, FORWARD, m)]
    if s < num_stages - 1:
        deps.append(Action(s + 1, BACKWARD, m))
    return deps
