"""What a rendezvous hands the agent, and how it fails.

A rendezvous is a sequence of *rounds*. In each round a set of nodes (agents) agree on who is
in, on a node rank for each (0..N-1, contiguous), and on where the workers' bootstrap store
lives. `RendezvousInfo` is one node's view of one completed round; every member of a round sees
the same membership (the protocol's invariant, tested in ``tests/rendezvous``).

Errors map to the launcher's exit codes (docs/design.md §3.4): every `RendezvousError` is exit 3.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field, fields

from meshrun.rendezvous import keys
from meshrun.rendezvous.keys import Kind, Origin

SECRET_ENV = "MESHRUN_RDZV_SECRET"  # the shared secret's variable (`meshrun.rendezvous.auth`)
SECRET_AS_VALUE = (  # `parse_settings` and auth's `load_secret` refuse ``secret=VALUE`` with it
    "--rdzv-conf secret: a secret given as a value is visible to every user of the host (ps) "
    f"and in shell histories; give secret_file=PATH (a file only you can read) or {SECRET_ENV}"
)


class RendezvousError(Exception):
    """The rendezvous failed: join timeout, too few nodes, store lost, auth refused (exit 3)."""


class RendezvousTimeoutError(RendezvousError):
    """Not enough nodes joined within ``join_timeout``."""


class StoreLostError(RendezvousError):
    """The rendezvous store stopped answering (its host died, or the network to it did)."""


class StoreGoneError(StoreLostError):
    """The job's keys are gone from a store that outlives the agents (etcd): the job's last
    node out deleted them (the job ended without this node), or their lease expired."""


def decode_json(raw: bytes, what: str, make=lambda value: value):
    """``make(json.loads(raw))`` for a value read from the store; anything malformed (not
    JSON, missing or extra fields, wrong types) is one `RendezvousError` line naming ``what``
    and the value's start, never a traceback: another program may write to the job's store."""
    try:
        return make(json.loads(raw))
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
        if bytes(raw[:2]) == b"M1":  # auth.py's seal: the job has a secret this process lacks
            raise RendezvousError(
                f"a rendezvous value ({what}) is sealed with the job's shared secret, which "
                "this process was not given: give it the same --rdzv-conf secret_file=PATH "
                "(or MESHRUN_RDZV_SECRET) as the job's other nodes"
            ) from None
        raise RendezvousError(
            f"a rendezvous value ({what}) is malformed: {bytes(raw)[:60]!r} ({e}); another "
            f"program is writing to the job's store: give the job its own --rdzv-id, bind the "
            f"store to a private address, or use etcd with auth"
        ) from None


class JobFinished(Exception):
    """The job already ended with success; a spare node that waited for room exits 0."""


class JobFailed(Exception):
    """Another node ended the job as failed (its restart budget was spent)."""

    def __init__(self, round: int, reason: str):
        super().__init__(reason)
        self.round = round
        self.reason = reason


@dataclass(frozen=True)
class NodeDesc:
    """One agent as the rendezvous sees it.

    ``node_id`` is unique per agent process (host, pid and a random suffix), never the bare
    hostname: several agents may share a host (tests) or a hostname (network namespaces).
    ``addr`` is the address other nodes reach this one at; ``nproc`` its local world size.
    ``node_rank_hint`` is the user's ``--node-rank`` (None when not given); ``prev_rank`` the node
    rank this agent had in the last round it was a member of (None for a newcomer).
    """

    node_id: str
    addr: str
    nproc: int
    node_rank_hint: int | None = None
    prev_rank: int | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> NodeDesc:
        return decode_json(raw, "a node", lambda d: cls(**d))


_MEMBERS_MAX = 16 << 20  # bytes: a membership inflated past this is malformed (a zip bomb)


def encode_members(members: list[NodeDesc]) -> bytes:
    """A round's membership as its ``closed`` key stores it: JSON with one list per `NodeDesc`
    field, zlib-compressed. Every node reads it once a round closes; at 1024 nodes the plain
    list of records was 120 kB that etcd's JSON gateway marshalled 1024 times, where this is
    about 9 kB, and columns parse faster than records (a key per column, not per node)."""
    names = [f.name for f in fields(NodeDesc)]
    return zlib.compress(json.dumps({n: [getattr(m, n) for m in members] for n in names}).encode())


def decode_members(raw: bytes) -> list[NodeDesc]:
    """`encode_members`'s inverse: one or more NodeDescs of distinct node ids (as many as the
    node that closed the round took: its MAX may differ from this node's, and every member
    must still agree on the one membership).

    Raises:
        RendezvousError: (one line) ``raw`` is not such a membership: another program wrote
            the key, a job with a secret this process lacks sealed it, or another meshrun
            version wrote it.
    """
    inflate = zlib.decompressobj()
    try:
        text = inflate.decompress(raw, _MEMBERS_MAX)
        whole = inflate.eof and not inflate.unconsumed_tail and not inflate.unused_data
    except zlib.error:
        whole = False
    if not whole:
        return decode_json(raw, "a round's members", _not_compressed)
    return decode_json(text, "a round's members", _members)


_COLUMN_TYPES = {"node_id": str, "addr": str, "nproc": int, "node_rank_hint": (int, type(None)),
                 "prev_rank": (int, type(None))}


def _members(columns: dict) -> list[NodeDesc]:
    """The members from `encode_members`'s columns, each value of its field's type (ints
    >= 0, nproc >= 1, no bool), at least one, node ids distinct (ValueError otherwise)."""
    names = [f.name for f in fields(NodeDesc)]
    if not isinstance(columns, dict) or sorted(columns) != sorted(names):
        raise ValueError(f"fields {sorted(columns) if isinstance(columns, dict) else columns}")
    for name, kind in _COLUMN_TYPES.items():
        column = columns[name]
        if not isinstance(column, list) or not all(
                isinstance(v, kind) and not isinstance(v, bool) for v in column):
            raise ValueError(f"{name} is not a list of {kind}")
        low = 1 if name == "nproc" else 0
        if kind is not str and any(v is not None and v < low for v in column):
            raise ValueError(f"{name} holds a number below {low}")
    members = [NodeDesc(*row) for row in zip(*(columns[n] for n in names), strict=True)]
    if not members:
        raise ValueError("no members")
    if len({m.node_id for m in members}) != len(members):
        raise ValueError("a node id twice")
    return members


def _not_compressed(value) -> list[NodeDesc]:
    if isinstance(value, list) and value and isinstance(value[0], dict) and "node_id" in value[0]:
        raise RendezvousError(
            "a round's members were written by another meshrun version (a list of records; "
            "this one reads compressed columns): run the same meshrun version on every node")
    raise ValueError("not a compressed membership")


@dataclass(frozen=True)
class RendezvousInfo:
    """One node's view of a completed round.

    Global ranks are contiguous per node in node-rank order: this node's local rank ``i`` has
    global rank ``rank_offset + i``. ``restart_count`` is the number of failure restarts the job
    has spent so far (the same on every node); ``round`` grows on every re-rendezvous, failure or
    membership change. ``master_addr``/``master_port`` locate the workers' bootstrap TCPStore,
    fresh for every round and hosted by the agent of node rank 0.
    """

    run_id: str
    round: int
    restart_count: int
    node_rank: int
    nodes: tuple[NodeDesc, ...]  # in node-rank order
    master_addr: str
    master_port: int

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def rank_offset(self) -> int:
        return sum(n.nproc for n in self.nodes[: self.node_rank])

    @property
    def local_world_size(self) -> int:
        return self.nodes[self.node_rank].nproc


@dataclass(frozen=True)
class RendezvousSettings:
    """The protocol's knobs, in seconds; names and meanings follow torch's ``--rdzv-conf`` keys.

    Defaults differ from torch's where torch's are the pain: dead-node detection is
    ``keep_alive_interval * keep_alive_max_attempt`` = 2.5 s, plus at most one interval of
    observation lag, so at most 3 s (torch: 5 s x 3 = 15 s).
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 1.0
    #: The last call of round 0, the job's start, when nodes come up seconds apart (pods,
    #: srun steps): without it a job of MIN < MAX nodes often starts on the first node alone,
    #: then again with all (torch: 30 s for every round). The given last_call_timeout when
    #: there is one. A round closes as soon as MAX nodes are in, so a job whose nodes are all
    #: present starts at once either way.
    first_last_call_timeout: float = 5.0
    close_timeout: float = 5.0
    keep_alive_interval: float = 0.5
    keep_alive_max_attempt: int = 5
    read_timeout: float = 10.0
    max_restarts: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A last_call_timeout other than the default, given here directly (tests, benchmarks),
        # holds for round 0 too, as a given --rdzv-conf last_call_timeout does.
        if self.last_call_timeout != 1.0 and self.first_last_call_timeout == 5.0:
            object.__setattr__(self, "first_last_call_timeout", self.last_call_timeout)

    @property
    def bind_all(self) -> bool:
        """``--rdzv-conf bind_all=true``: the stores this agent hosts listen on every interface
        (the default is the endpoint's / the advertised address only; §3.7)."""
        return self.extra.get("bind_all", "").strip().lower() in ("1", "true", "yes", "y", "on")

    @property
    def dead_after(self) -> float:
        """Seconds without a heartbeat after which a node counts as lost."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


# The number types of the protocol's keys (which keys those are: `meshrun.rendezvous.keys`).
_NUMBER_TYPES: dict[Kind, type] = {Kind.SECONDS: float, Kind.COUNT: int}


def settings_from_conf(
    conf: dict[str, str], *, run_id: str, min_nodes: int, max_nodes: int, max_restarts: int
) -> RendezvousSettings:
    """Build `RendezvousSettings` from ``--rdzv-conf`` key/value strings.

    Accepts the keys `meshrun.rendezvous.keys.KEYS` marks `Origin.MESHRUN` (the launcher's
    ``parse_rdzv_conf`` has resolved torch's aliases and dropped the rest): the protocol's are
    parsed to numbers, the others kept as text in ``extra`` for the backend that reads them.
    Anything else is the caller's bug here, not a pod spec to tolerate (the keys module's
    docstring: who sees which rule).

    Raises:
        ValueError: an unknown key (an alias or torch-only key too), ``secret=``, or a value
            that is not a positive number; the message names the key, the value and the
            accepted keys.
    """
    values: dict[str, float | int] = {}
    extra: dict[str, str] = {}
    for key, raw in conf.items():
        row = keys.lookup(key)
        if row is None or row.origin is not Origin.MESHRUN:
            known = ", ".join(sorted(k.name for k in keys.meshrun_keys() if not k.refused))
            raise ValueError(f"--rdzv-conf {key}={raw}: unknown key (known keys: {known})")
        if row.refused:  # never a value on the command line (ps): one line naming the fix
            raise ValueError(SECRET_AS_VALUE)
        if not row.protocol:
            extra[key] = raw
            continue
        kind = _NUMBER_TYPES[row.kind]
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(
                f"--rdzv-conf {key}={raw}: expected a {kind.__name__} number"
            ) from None
        if value <= 0:
            raise ValueError(f"--rdzv-conf {key}={raw}: must be greater than 0")
        values[key] = value
    if "last_call_timeout" in values:  # given: it holds for round 0 too
        values["first_last_call_timeout"] = values["last_call_timeout"]
    heartbeat_timeout = values.pop("heartbeat_timeout", None)
    if heartbeat_timeout is not None and "keep_alive_max_attempt" not in values:
        interval = values.get("keep_alive_interval", RendezvousSettings.keep_alive_interval)
        values["keep_alive_max_attempt"] = max(1, math.ceil(heartbeat_timeout / interval))
    return RendezvousSettings(
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        max_restarts=max_restarts,
        extra=extra,
        **values,
    )
