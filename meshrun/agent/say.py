"""The agent's own lines: one ``meshrun: ...`` line each, on stderr.

Every room of the agent says what it did through `say`, so the lines share one form (and one
place to change how they are written).
"""

from __future__ import annotations

import sys


def say(message: str) -> None:
    """One line from the agent itself, on stderr."""
    print(f"meshrun: {message}", file=sys.stderr, flush=True)


def first_line(text: str, max_chars: int = 200) -> str:
    """The first line of ``text`` (stripped), cut to ``max_chars`` characters ("..." when
    cut); "" for no text."""
    line = text.strip().split("\n", 1)[0] if text else ""
    return line if len(line) <= max_chars else line[: max_chars - 3] + "..."
