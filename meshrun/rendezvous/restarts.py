"""Why a running round ends: a restart's cause as data, beside the text users read.

Every node that leaves a round learns why from the rendezvous (`Rendezvous.poll`,
`Rendezvous.request_restart`, `Rendezvous.exit_barrier`): its own workers failed or hung, a
node was lost, nodes wait to join, or another node moved the round on for one of these. The
agent decides from the `Cause` what to do next (whether the stopped ranks' stacks are worth
taking, whether the workers may change world in place, whether a restart was spent, which
events the timeline gets); the text is only said. The cause travels with the job's state
(`JobState.cause`), so a node that learns of a restart from another node decides the same way
as the node that asked for it.

Stdlib only: the agent imports it without the store clients.
"""

from __future__ import annotations

import enum


class Cause(str, enum.Enum):
    """What ended a round. The values are what the job's state record stores."""

    #: a worker failed (one restart of the job's budget is spent)
    FAILURE = "failure"
    #: a rank made no progress for --hang-timeout (spent, as a failure)
    HANG = "hang"
    #: a member stopped beating (free: a membership change)
    NODE_LOST = "node_lost"
    #: nodes wait to join a job below MAX nodes (free: a membership change)
    JOINING = "joining"
    #: the job succeeded on the other nodes while this node's round still ran
    FINISHED = "finished"
    #: the round was moved on and no more is known (a state written by a node that named no
    #: cause, or a fault whose news is the workers' own exit)
    MOVED_ON = "moved_on"

    @property
    def spent(self) -> bool:
        """Whether a restart of this cause spends one of the job's ``--max-restarts``."""
        return self in (Cause.FAILURE, Cause.HANG)

    @property
    def membership_change(self) -> bool:
        """Whether the round ends because the members change (a node lost, nodes joining):
        the only causes in-place recovery takes."""
        return self in (Cause.NODE_LOST, Cause.JOINING)

    @property
    def fault(self) -> bool:
        """Whether something went wrong: the stopped ranks' stacks are worth taking (a node
        joining or the job finishing elsewhere is no fault)."""
        return self not in (Cause.JOINING, Cause.FINISHED)


class Restart(str):
    """One restart: the line users read, with its `Cause` and the facts the timeline records
    attached: the lost node's id (`Cause.NODE_LOST`) or how many nodes wait to join
    (`Cause.JOINING`).

    A `str` (the text) so that every caller that only says or matches the reason keeps
    working; decisions read ``cause``, never the text.
    """

    cause: Cause
    node: str
    joining: int

    def __new__(cls, text: str, cause: Cause, *, node: str = "", joining: int = 0) -> Restart:
        self = super().__new__(cls, text)
        self.cause, self.node, self.joining = Cause(cause), node, joining
        return self

    def __reduce__(self):
        return (_restart, (str(self), self.cause.value, self.node, self.joining))


def _restart(text: str, cause: str, node: str, joining: int) -> Restart:
    return Restart(text, Cause(cause), node=node, joining=joining)


def cause_of(reason: str, *, failure: bool = False) -> Cause:
    """The cause of ``reason``: its own when it is a `Restart`; else (a caller that gave only
    text) a failure when ``failure``, otherwise `Cause.MOVED_ON`."""
    if isinstance(reason, Restart):
        return reason.cause
    return Cause.FAILURE if failure else Cause.MOVED_ON


def node_lost(node_id: str) -> Restart:
    """The restart after node ``node_id`` stopped beating."""
    return Restart(f"node {node_id} lost", Cause.NODE_LOST, node=node_id)


def joining(count: int) -> Restart:
    """The restart that lets ``count`` waiting nodes join."""
    return Restart(f"{count} node(s) waiting to join", Cause.JOINING, joining=count)
