"""The --desync-check comparison (`meshrun.agent.desync.Ledger`) on seeded random call
sequences: reorders, another op, another shape, a skip then identical calls, an extra call,
several odd ranks at once; records read as the agent reads them (the last 32 calls, at
different moments per rank)."""

from __future__ import annotations

import random

import pytest

from meshrun.agent.collectives import Call, Group, Record
from meshrun.agent.desync import Ledger

OPS = [("all_reduce", "float[4]"), ("all_reduce", "float[2, 4]"), ("broadcast", "float[4]"),
       ("barrier", ""), ("all_reduce", "int64[4]"), ("reduce", "float[8]")]  # fmt: skip
WINDOW = 32  # calls in a record file (collective_record.FILE_CALLS)


def _record(calls: list[tuple[str, str]], ranks: tuple[int, ...], upto: int) -> Record:
    """One rank's record after its first ``upto`` calls: the last WINDOW of them."""
    made = [Call("0", i + 1, op, args, True) for i, (op, args) in enumerate(calls[:upto])]
    return Record({"0": Group(ranks, upto, upto)}, tuple(made[-WINDOW:]))


def _feed(ledger: Ledger, seqs: dict[int, list], rng: random.Random) -> None:
    """Each rank's record read as the agent reads it: at moments of its own (the ranks
    interleaved at random), never more than WINDOW calls apart (the agent reads 4 times in
    each `INTERVAL_S`; the docstring of meshrun.agent.desync says what a faster loop loses),
    the last read at its end."""
    ranks = tuple(sorted(seqs))
    seen = dict.fromkeys(ranks, 0)
    while any(seen[r] < len(seqs[r]) for r in ranks):
        r = rng.choice([r for r in ranks if seen[r] < len(seqs[r])])
        seen[r] = min(len(seqs[r]), seen[r] + rng.randint(1, WINDOW))
        ledger.add(r, _record(seqs[r], ranks, seen[r]))


def _case(seed: int):
    """A random job with one kind of mistake by a random minority of ranks: (kind, per-rank
    call sequences, the odd ranks, the first call number where they differ)."""
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    kind = rng.choice(["reorder", "op", "shape", "skip", "extra"])
    odd = sorted(rng.sample(range(n), rng.randint(1, n // 2)))  # a minority, or half
    length = rng.randint(5, 80)
    if kind in ("skip", "extra"):  # identical calls: only the count tells
        base = [("all_reduce", "float[4]")] * length
    else:
        base = [rng.choice(OPS) for _ in range(length)]
    at = rng.randint(0, length - 2)
    mistake = list(base)
    if kind == "reorder":
        while mistake[at] == mistake[at + 1]:
            mistake[at + 1] = rng.choice(OPS)
            base[at + 1] = mistake[at + 1]
        mistake[at], mistake[at + 1] = mistake[at + 1], mistake[at]
    elif kind == "op":
        mistake[at] = next(o for o in OPS if o[0] != base[at][0])
    elif kind == "shape":
        base[at] = ("all_reduce", "float[4]")
        mistake[at] = ("all_reduce", rng.choice(["float[2, 4]", "int64[4]", "float[8]"]))
    elif kind == "skip":
        del mistake[at]
    else:
        mistake.append(base[-1])
    seqs = {r: (mistake if r in odd else base) for r in range(n)}
    return kind, seqs, odd, at + 1, rng


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(300))
def test_the_ledger_names_the_mistake_and_the_odd_ranks(seed):
    kind, seqs, odd, seq, rng = _case(seed)
    ledger = Ledger()
    _feed(ledger, seqs, rng)
    n = len(seqs)
    tie = 2 * len(odd) == n
    if kind in ("reorder", "op", "shape"):
        found = ledger.mismatch(wait=0.0)
        assert found is not None and found.kind == "mismatch", (kind, seqs)
        assert found.seq == seq and found.complete, (found, seq)
        assert list(found.culprits) == ([] if tie else odd), (found, odd)
        assert found.line.startswith(f"desync in group 0 at call #{seq}: "), found.line
        assert ledger.offset() is None or True  # counts may differ too after a reorder
    else:
        assert ledger.mismatch(wait=0.0) is None, ledger.mismatch(wait=0.0)
        found = ledger.offset()
        assert found is not None and found.kind == "offset", (kind, seqs)
        if kind == "skip":  # the odd ranks are behind: named (also on a tie)
            assert list(found.culprits) == odd, (found, odd)
            word = "is" if len(odd) == 1 else "are"
            assert f"{_ranks(odd)} {word} 1 call behind" in found.line, found.line
        else:  # the odd ranks made one call more: named when a minority, else those behind
            others = [r for r in range(n) if r not in odd]
            assert list(found.culprits) == (others if tie else odd), (found, odd)
            if not tie:
                assert f"{_ranks(odd)} made 1 call more than {_ranks(others)}" in found.line


def _ranks(ranks):
    from meshrun.agent.collective_record import ranges

    return ("rank " if len(ranks) == 1 else "ranks ") + ranges(ranks, sep=", ")


def test_the_generator_makes_minorities_of_several_ranks():
    cases = [_case(s) for s in range(300)]
    minorities = {len(odd) for _, seqs, odd, _, _ in cases if 2 * len(odd) < len(seqs)}
    ties = {len(odd) for _, seqs, odd, _, _ in cases if 2 * len(odd) == len(seqs)}
    assert {1, 2} <= minorities and {1, 2, 3} <= ties, (minorities, ties)
    assert {c[0] for c in cases} == {"reorder", "op", "shape", "skip", "extra"}


def test_a_mismatch_waits_for_the_members_not_seen_yet_then_says_so():
    ledger = Ledger()
    ranks = (0, 1, 2)
    ledger.add(0, _record([("all_reduce", "float[4]")] * 3, ranks, 3), now=10.0)
    ledger.add(1, _record([("all_reduce", "float[4]")] * 2 + [("barrier", "")], ranks, 3), 10.0)
    assert ledger.mismatch(now=10.5) is None  # rank 2's call #3 may still show
    found = ledger.mismatch(now=12.0)
    assert found is not None and not found.complete and found.culprits == ()
    assert found.line == ("desync in group 0 at call #3: rank 0 called all_reduce(float[4]), "
                          "rank 1 called barrier(), rank 2: call #3 not seen")  # fmt: skip


def test_an_offset_counts_at_the_end_only_behind_a_finished_rank():
    ledger = Ledger()
    calls = [("all_reduce", "float[4]")] * 5
    ledger.add(0, _record(calls, (0, 1), 4))
    ledger.add(1, _record(calls, (0, 1), 5))
    assert ledger.offset(finished={1}) is None  # rank 0 runs on: it may still make call #5
    found = ledger.offset(finished={0})
    assert found is not None and found.culprits == (0,)
    assert found.line == ("desync in group 0: rank 0 is 1 call behind: rank 0 last called "
                          "all_reduce #4 (float[4]); rank 1 last called all_reduce #5 (float[4])")


def test_a_group_made_again_under_its_name_starts_its_count_again():
    ledger = Ledger()
    calls = [("all_reduce", "float[4]")] * 6
    ledger.add(0, _record(calls, (0, 1), 6))
    ledger.add(1, _record(calls, (0, 1), 6))
    other = [("barrier", "")] * 2
    ledger.add(0, _record(other, (0, 1), 2))  # destroyed and made again: numbered from 1
    ledger.add(1, _record(other, (0, 1), 2))
    assert ledger.mismatch(wait=0.0) is None and ledger.offset() is None


def test_an_offset_names_the_ranks_ahead():
    ledger = Ledger()
    calls = [("all_reduce", "float[4]")] * 5
    for rank, made in ((0, 4), (1, 5), (2, 4)):  # rank 1 made one call more
        ledger.add(rank, _record(calls, (0, 1, 2), made))
    found = ledger.offset(finished={0, 2})
    assert found is not None and found.culprits == (1,) and found.ahead == (1,), found
