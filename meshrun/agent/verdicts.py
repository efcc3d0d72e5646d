"""Verdicts: where each stopped rank was, and which ranks most likely caused a hang or a failure.

A rank's place is a `Place` (waiting inside a collective, running anywhere else, or unknown),
with the collective it waits in and the innermost frame of its own code (`Whereabouts`; the
stacks are read by `meshrun.agent.stacks.classify`). From every rank's place the culprit rule
(`attribute`) names the likely cause, in order:

1. the ranks running outside any collective while the others wait (`Rule.OUTSIDE`: a slow
   data reader, an ``if rank == 0:`` branch; pytorch#122694 is this case);
2. all waiting: the ranks that issued fewer collectives than the most (`Rule.FEWER_ISSUED`:
   behind the wavefront; only where every count is known);
3. the ranks waiting in a collective that fewer ranks wait in (`Rule.OTHER_COLLECTIVE`).

The collective record (`meshrun.agent.collectives.first_disagreement`) may know better: its
call numbers beat the counters and the stacks' op names (`meshrun.agent.errors.culprits`:
`Rule.RECORD_BEHIND`, `Rule.RECORD_MISMATCH`), except where rule 1 holds.

A verdict is data: `Verdict` (the ranks, and why as a `Why`: the words the report prints with
the `Rule` that gave them), so the hang line, the failure report, the stopped-rank list and
``meshrun stacks`` decide from the rule, never from the words.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


class Place(str, enum.Enum):
    """Where a rank was when the agent looked. The values are what failure records store."""

    #: blocked inside a collective (a torch.distributed collective frame on its main thread, or
    #: meshrun's own progress counters mark it blocked)
    WAITING = "waiting"
    #: anywhere else: its own code, a data loader, I/O
    RUNNING = "running"
    #: no stack and no counters
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Whereabouts:
    """A rank's place: ``state`` a `Place` (its value, as records store it); ``collective``
    the collective it waits in (or ""); ``at`` the innermost frame of the user's own code
    (with the innermost frame overall when that is elsewhere)."""

    state: str
    collective: str
    at: str


class Rule(enum.Enum):
    """Which rule named the culprits (or that none could)."""

    OUTSIDE = "outside any collective"
    FEWER_ISSUED = "fewer collectives issued"
    OTHER_COLLECTIVE = "in a different collective"
    RECORD_BEHIND = "behind in the collective record"
    RECORD_MISMATCH = "a different call in the collective record"
    NONE = "no rule separates the ranks"


class Why(str):
    """The words a report prints for a verdict, with the `Rule` that gave them (``rule``)."""

    rule: Rule

    def __new__(cls, text: str, rule: Rule) -> Why:
        self = super().__new__(cls, text)
        self.rule = rule
        return self


class Verdict(NamedTuple):
    """The likely culprits (global ranks, ascending) and why; no ranks when no rule decides."""

    ranks: list[int]
    why: Why


_UNDECIDED = Verdict([], Why("", Rule.NONE))


def attribute(ranks: dict[int, tuple[Whereabouts, int | None]]) -> Verdict:
    """The likely culprits among ``rank -> (whereabouts, collectives issued or None)``.

    Rules, in order: the ranks running outside any collective while others wait; else, all
    waiting, the ranks that issued fewer collectives than the most (behind the wavefront;
    only when every waiting rank's count is known: ranks of different pipeline stages issue
    different numbers of collectives by design, so theirs are passed as None);
    else the ranks waiting in a collective that fewer ranks wait in (a mismatched call). When
    no rule separates the ranks (all wait in the same collective at the same count, e.g. for
    a rank on another node), the verdict names no rank, and why says so.
    """
    states = {r: w.state for r, (w, _) in ranks.items()}
    running = sorted(r for r, s in states.items() if s == Place.RUNNING)
    waiting = sorted(r for r, s in states.items() if s == Place.WAITING)
    if running and waiting:
        return Verdict(running, Why("outside any collective while the others wait", Rule.OUTSIDE))
    if not waiting:
        return _UNDECIDED
    counts = {r: n for r, (_, n) in ranks.items() if r in waiting and n is not None}
    if len(counts) == len(waiting) and len(set(counts.values())) > 1:
        most = max(counts.values())
        behind = sorted(r for r, n in counts.items() if n < most)
        return Verdict(
            behind, Why(f"behind: fewer collectives issued than the others' {most}",
                        Rule.FEWER_ISSUED)
        )  # fmt: skip
    ops = Counter(ranks[r][0].collective for r in waiting)
    if len(ops) > 1:
        common = ops.most_common(1)[0][0]
        if list(ops.values()).count(ops[common]) == 1:  # one op is the majority's
            odd = sorted(r for r in waiting if ranks[r][0].collective != common)
            return Verdict(odd, Why(f"in a different collective from the others' {common}",
                                    Rule.OTHER_COLLECTIVE))  # fmt: skip
        return Verdict([], Why("the ranks wait in different collectives: "
                               + ", ".join(sorted(ops)), Rule.NONE))  # fmt: skip
    (op,) = ops
    return Verdict(
        [], Why(f"every rank here waits in {op}: the culprit is elsewhere (another node?)",
                Rule.NONE)
    )  # fmt: skip


def waiting_ranks(records: Iterable, but: Iterable[int] = ()) -> list[int]:
    """The global ranks of ``records`` (failure records: ``global_rank``, ``state``) that were
    waiting in a collective, less ``but``."""
    left_out = set(but)
    return sorted(f.global_rank for f in records
                  if f.state == Place.WAITING and f.global_rank not in left_out)  # fmt: skip
