"""How an error reads when a peer process vanished: the one table of those messages.

Two readers, two questions, one table:

- the agent (`meshrun.agent.failure_report`): did this worker fail *because* a peer's
  connection closed under a collective (`connection_closed`)? Then the failure is likely a
  consequence of a lost node, and the agent waits for the rendezvous to say so before it
  spends a restart. Only a closed connection counts here: a timeout is a hang's symptom too.
- in-place recovery (`meshrun.parallel.elastic`): should this step be retried in a new world
  (`PEER_LOST`)? Beyond a closed connection, a peer that aborted its groups, a round's store
  that closed (its agent moved on) and a timeout (a cut cable closes nothing) count too.

The texts are gloo's, NCCL's and TCPStore's (torch 2.13). Stdlib only: imported by the agent,
which never imports torch, and by meshrun.parallel.
"""

from __future__ import annotations

import re

#: A peer's connection closed under a collective (gloo, NCCL).
CLOSED = (
    r"Connection (?:closed|reset) by peer", r"Broken pipe", r"ECONNRESET",
    r"remote process exited", r"NCCL communicator was aborted",
)  # fmt: skip
#: ... and the other ways a step fails when a peer vanished or its world was torn down.
GONE = (
    r"Connection was likely closed", r"Failed to recv", r"communicator was aborted",
    r"Timed out", r"aborted", r"Socket closed", r"EOF",
)  # fmt: skip

CONNECTION_CLOSED = re.compile("|".join(CLOSED), re.IGNORECASE)
PEER_LOST = re.compile("|".join(CLOSED + GONE), re.IGNORECASE)


def connection_closed(*texts: str) -> bool:
    """Whether any of ``texts`` (a failure's message, its traceback) reads like a peer's
    connection closing under a collective."""
    return any(CONNECTION_CLOSED.search(t) for t in texts if t)
