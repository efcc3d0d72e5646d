"""The agent's own lines: one ``meshrun: ...`` line each, on stderr, never blocking the agent.

Every room of the agent says what it did through `say`, so the lines share one form (and one
place to change how they are written). They go the way the workers' console copy goes
(`meshrun.agent.console`: the stderr console's bounded queue and writer thread), so they stay
in order with the workers' lines, and a console that cannot take them (a pipe nobody reads, a
stopped terminal) costs lines, counted in a note, never a hung agent (docs/design.md §3.6).
"""

from __future__ import annotations

from meshrun.agent.console import console


def say(message: str) -> None:
    """One line from the agent itself, ``meshrun: <message>``, on stderr (queued: see this
    module; on the main thread written before this returns unless the console lags)."""
    console("stderr").say(message)


def say_text(text: str) -> None:
    """Text of the agent's own written as given, whole lines (the failure report), the way
    `say` writes a line."""
    console("stderr").write_own(text)


def first_line(text: str, max_chars: int = 200) -> str:
    """The first line of ``text`` (stripped), cut to ``max_chars`` characters ("..." when
    cut); "" for no text."""
    line = text.strip().split("\n", 1)[0] if text else ""
    return line if len(line) <= max_chars else line[: max_chars - 3] + "..."
