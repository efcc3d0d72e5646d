"""`Action`: one unit of pipeline work, and the dependency rules every schedule obeys.

A schedule is data: for each rank of the pipeline group, the ordered list of actions it runs
in one step. An action is (stage, kind, microbatch) with kind ``F`` (forward), ``B``
(backward) or ``W`` (weight gradient), written compactly as ``"0F1"`` (stage 0, forward,
microbatch 1), as torch.distributed.pipelining writes its ``_Action``.

Split backward (zero-bubble schedules; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024): when an order has ``W(s, m)``, ``B(s, m)`` computes only the gradient of the stage's
input (what stage s - 1 waits for) and ``W(s, m)`` the gradients of its parameters, later.
Without a ``W``, ``B`` computes both, as before. An order splits all of a stage's backwards
or none (`validate`). torch writes the split input gradient ``I`` and keeps ``B`` for the
full backward; here ``B`` is the paper's name, and ``W`` says that it is split.

Placement: with ``p`` ranks and ``p * v`` stages,

- ``"loop"`` (torch and Megatron-LM's interleaving; the default): stage ``s`` runs on rank
  ``s % p``: rank r holds stages r, r + p, r + 2p, ..., so neighbouring stages sit on
  different ranks when p > 1 and the last stage is on rank p - 1.
- ``"v"`` (ZB-V; torch's ``style="v"``): the stages zig-zag: chunk ``c = s // p`` goes
  down the ranks when c is even and back up when it is odd, so with v = 2 rank r holds stages
  r and 2p - 1 - r, stages p - 1 and p meet on rank p - 1, and the last stage is on rank 0.

Dependencies (the only waits there are; the runtime's sends never block):

- ``F(s, m)`` needs the activation of ``F(s-1, m)`` (s > 0).
- ``B(s, m)`` needs ``F(s, m)`` (same rank) and the gradient of ``B(s+1, m)`` (s < last).
- ``W(s, m)`` needs ``B(s, m)`` (same rank); nothing waits for a W.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"
KINDS = (FORWARD, BACKWARD, WEIGHT)
LOOP, V_SHAPE = "loop", "v"
PLACEMENTS = (LOOP, V_SHAPE)

_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FBW])\s*(\d+)\s*$")

Order = dict[int, list["Action"]]  # pipeline rank -> the actions it runs, in order


@dataclass(frozen=True)
class Action:
    """One action of a schedule: run ``kind`` of ``stage`` on ``microbatch``.

    Attributes:
        stage: global stage index, 0 <= stage < num_stages.
        kind: ``"F"`` (forward), ``"B"`` (backward; the input gradient only when the order
            also has this stage's ``"W"``) or ``"W"`` (the parameters' gradients).
        microbatch: microbatch index, 0 <= microbatch < n_microbatches.

    ``str(Action(0, "F", 1)) == "0F1"``; `Action.parse` reads that form back. Mirrors
    ``torch.distributed.pipelining.schedules._Action`` (whose split input gradient is ``I``).
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action: kind must be 'F', 'B' or 'W' (got {self.kind!r})")
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"Action: {name} must be an int (got {value!r})")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action: stage and microbatch must be >= 0 (got stage "
                             f"{self.stage}, microbatch {self.microbatch})")

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"2B3"`` -> ``Action(2, "B", 3)``. Raises ValueError on any other form."""
        match = _ACTION_RE.match(text)
        if not match:
            raise ValueError(f"Action.parse: expected STAGE F|B|W MICROBATCH such as '0F1' "
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


def stage_rank(stage: int, num_ranks: int, placement: str = LOOP) -> int:
    """The pipeline rank that runs ``stage`` under ``placement`` (see the module docstring).

    Raises ValueError for an unknown placement."""
    if placement == LOOP:
        return stage % num_ranks
    if placement == V_SHAPE:
        chunk, i = divmod(stage, num_ranks)
        return i if chunk % 2 == 0 else num_ranks - 1 - i
    raise ValueError(f"unknown stage placement {placement!r} (choose from "
                     f"{', '.join(PLACEMENTS)})")


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """The actions whose results ``action`` needs (see the module docstring)."""
    s, m = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [Action(s - 1, FORWARD, m)] if s > 0 else []
    if action.kind == WEIGHT:
        return [Action(s, BACKWARD, m)]
    deps = [Action(s, FORWARD, m)]
    if s < num_stages - 1:
        deps.append(Action(s + 1, BACKWARD, m))
    return deps
