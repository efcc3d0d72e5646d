"""The ``--rdzv-conf`` keys: the one table of them, and lookups into it.

Each `RdzvKey` says what one key is: the kind of its value, whether the value is a secret
(never shown: ``meshrun.launcher.errors.redact_secrets``), where the name comes from
(`Origin`), which of torch 2.13's backends read the same name and, where they read it
differently, what each makes of it, and what meshrun makes of it. Everything else that knows
keys derives from `KEYS`: `meshrun.rendezvous.api.settings_from_conf` (which keys become the
protocol's numbers, which pass through ``RendezvousSettings.extra``), the launcher's
``parse_rdzv_conf`` (aliases, torch-only keys, durations, typos) and the launcher's secret
redaction (`SECRET_WORDS`). The backends read their own keys out of ``extra``
(``meshrun.rendezvous.etcd_gateway``, ``auth``, ``meshrun.rendezvous.open_store``); their
names are the table's.

Origins:

- `Origin.MESHRUN`: read under this name. Many are torch's names too (``torch_backends``
  says which of torch's backends read it); the rest are meshrun's own (``bind_all``,
  ``secret_file``, ``workers_port``, ...).
- `Origin.TORCH_ALIAS`: torch's name for a meshrun key (``ssl_cert`` for ``cert``): stored
  under the meshrun name, with a note; giving both is an error.
- `Origin.TORCH_ONLY`: torch reads it and meshrun has no use for it: dropped, with a note.

Unknown keys, and who sees what. There are two doors, with one rule each:

- User input (``--rdzv-conf``, ``PET_RDZV_CONF``, a config file's ``rdzv_conf``; also
  ``meshrun status`` and ``meshrun stacks``) goes through the launcher's ``parse_rdzv_conf``.
  torch ignores keys it does not read and the Kubeflow training operator passes a job's
  ``rdzvConf`` through, so a job torchrun runs must run here too: a key that is in no row is
  dropped with a warning line, unless it is within two edits of a key of the table, whatever
  the key's length (`typo_of`: insertions, deletions, substitutions and swaps of two
  neighbouring letters, so ``kye`` and ``uesr`` are one edit each): then it is a typo
  (``jion_timeout``), an error naming the key meant (exit 2). What comes out holds meshrun
  keys only, aliases resolved.
- Program input: `settings_from_conf` takes that output (the agent, ``meshrun status``) or a
  dict a program built (tests, benchmarks, a `LaunchConfig` made in code). It accepts the
  `MESHRUN` keys only and raises ValueError for anything else, aliases and torch-only keys
  included: there a key it does not know is the caller's bug, never a pod spec to tolerate.
  ``secret=`` (the one `RdzvKey.refused` row) passes the launcher as a meshrun key and is
  refused here (and by auth's ``load_secret``) with one line naming the fix (exit 2).

``timeout`` is torch's older key, which torch's backends read differently (its row's
``torch_meanings``), and meshrun reads it as the backend that runs the job would
(``read_as``, before the other keys, with one note naming the value and the meaning taken:
`backend_dependent_aliases`): on ``etcd`` (torch's legacy etcd rendezvous) it is the whole
rendezvous's deadline, on ``static`` the store's timeout, which bounds how long the nodes wait
for each other: ``join_timeout`` on both (which those torch backends do not read, so given
beside it, ``timeout`` wins); ``c10d`` and ``etcd-v2`` (torch's dynamic rendezvous) do not read
it, and neither does meshrun there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    """What a key's value is, as text (every value arrives as a string)."""

    SECONDS = "seconds"  # a duration: a number > 0 (the launcher also bounds it)
    COUNT = "count"  # an integer > 0
    PORT = "port"  # a port number 1..65535
    BOOL = "bool"  # true/false, 1/0, yes/no, on/off
    PATH = "path"  # a file's path
    TEXT = "text"  # anything else


class Origin(Enum):
    """Where a key's name comes from (the module docstring says what each means)."""

    MESHRUN = "meshrun"
    TORCH_ALIAS = "torch alias"
    TORCH_ONLY = "torch only"


#: torch 2.13's rendezvous backends. ``etcd`` is torch's legacy etcd rendezvous and ``etcd-v2``
#: its dynamic rendezvous on etcd's v2 API; meshrun runs both names on its etcd v3 backend.
TORCH_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")

#: Words that mark a value as secret wherever they appear in a key's name, known key or not
#: (``auth_token``, ``etcd_password``, ``secrets``: a typo), except a ``*_file``/``*_path`` key
#: (its value is a path). Every secret key of `KEYS` holds one (tested).
SECRET_WORDS = ("password", "passwd", "secret", "token")


@dataclass(frozen=True)
class RdzvKey:
    """One ``--rdzv-conf`` key.

    ``meaning`` is what meshrun makes of it (torch's meaning for a `Origin.TORCH_ONLY` key).
    ``protocol``: read by the rendezvous protocol, parsed to a number by `settings_from_conf`
    (else kept as text in ``RendezvousSettings.extra`` for the backend or auth that reads it).
    ``alias_of``: the meshrun key a `Origin.TORCH_ALIAS` is read as. ``note``: why a
    `Origin.TORCH_ONLY` key is ignored (the launcher's note). ``refused``: a key known only to
    be refused (``secret=``: `meshrun.rendezvous.api.SECRET_AS_VALUE`). ``torch_backends``:
    the torch backends that read this name; ``torch_meanings``: (backend, meaning) where they
    read it differently from each other or from meshrun. ``read_as``: for a backend-dependent
    alias, (torch backend, the meshrun key it is read as there, or None: not read there).
    """

    name: str
    kind: Kind
    meaning: str
    origin: Origin = Origin.MESHRUN
    secret: bool = False
    protocol: bool = False
    alias_of: str | None = None
    note: str = ""
    refused: bool = False
    torch_backends: tuple[str, ...] = ()
    torch_meanings: tuple[tuple[str, str], ...] = ()
    read_as: tuple[tuple[str, str | None], ...] = ()

    def reading(self, backend: str) -> tuple[str | None, str]:
        """``(meshrun key, torch's meaning)`` of this backend-dependent alias on torch's
        ``backend`` (``etcd-v3`` is ``etcd``); the key is None where it is not read.

        Raises:
            KeyError: a backend the row does not name.
        """
        name = "etcd" if backend == "etcd-v3" else backend
        return dict(self.read_as)[name], dict(self.torch_meanings)[name]


_DYNAMIC = ("c10d", "etcd-v2")  # torch's dynamic rendezvous: the backends that share its keys


def _protocol(name: str, kind: Kind, meaning: str, **more) -> RdzvKey:
    return RdzvKey(name, kind, meaning, protocol=True, **more)


# In this order the launcher checks durations (the first bad one is the one reported).
KEYS: tuple[RdzvKey, ...] = (
    # -- the protocol's knobs (RendezvousSettings) ------------------------------------------
    _protocol("join_timeout", Kind.SECONDS,
              "how long a round may take to gather MIN nodes before the join fails, exit 3 "
              "(default 600 s)",
              torch_backends=_DYNAMIC,
              torch_meanings=(("etcd", "not read: torch's etcd backend reads timeout"),
                              ("static", "not read: torch's static backend reads timeout"))),
    _protocol("last_call_timeout", Kind.SECONDS,
              "once MIN nodes are in, how long the round waits for more (default 1 s; 5 s for "
              "round 0 unless given; a round closes at once when MAX nodes are in)",
              torch_backends=(*_DYNAMIC, "etcd"),
              torch_meanings=(("static", "not read"),)),
    _protocol("close_timeout", Kind.SECONDS,
              "how long a node waits for every member to report at a round's end (default 5 s)",
              torch_backends=_DYNAMIC),
    _protocol("read_timeout", Kind.SECONDS,
              "how long one store operation may take before the store counts as lost, on "
              "every backend (default 10 s)",
              torch_backends=_DYNAMIC,
              torch_meanings=(("c10d", "the TCPStore's timeout (default 60 s)"),
                              ("etcd-v2", "the etcd client's read timeout (default 60 s)"),
                              ("etcd", "not read"), ("static", "not read"))),
    _protocol("keep_alive_interval", Kind.SECONDS,
              "seconds between a node's heartbeats (default 0.5 s)", torch_backends=_DYNAMIC),
    _protocol("keep_alive_max_attempt", Kind.COUNT,
              "heartbeats missed before a node counts as lost (default 5)",
              torch_backends=_DYNAMIC),
    _protocol("heartbeat_timeout", Kind.SECONDS,
              "seconds without a heartbeat after which a node is lost: read as "
              "keep_alive_max_attempt = ceil(heartbeat_timeout / keep_alive_interval) unless "
              "that is given",
              torch_backends=_DYNAMIC,
              torch_meanings=tuple((b, "the time within which one keep-alive heartbeat is "
                                       "expected to complete") for b in _DYNAMIC)),
    # -- read by the backends, auth and the agent (RendezvousSettings.extra) -----------------
    RdzvKey("is_host", Kind.BOOL,
            "c10d: whether this agent hosts the store (default: the endpoint is this host's)",
            torch_backends=("c10d",)),
    RdzvKey("bind_all", Kind.BOOL,
            "the stores this agent hosts listen on every interface, not only the endpoint's "
            "or the advertised address"),
    RdzvKey("workers_port", Kind.PORT,
            "the port node rank 0 hosts the workers' store on every round (default: one the OS "
            "picks)"),
    RdzvKey("secret_file", Kind.PATH,
            "a file holding the shared secret that seals every rendezvous value "
            "(meshrun.rendezvous.auth)"),
    RdzvKey("secret", Kind.TEXT,
            "refused: a secret on the command line is visible in ps; give secret_file or "
            "MESHRUN_RDZV_SECRET", secret=True, refused=True),
    RdzvKey("cacert", Kind.PATH, "etcd: the CA certificate to check the members' with",
            torch_backends=("etcd",),
            torch_meanings=(("etcd-v2", "not read: torch's etcd-v2 backend reads ca_cert"),)),
    RdzvKey("cert", Kind.PATH, "etcd: this client's certificate",
            torch_backends=("etcd",),
            torch_meanings=(("etcd-v2", "not read: torch's etcd-v2 backend reads ssl_cert"),)),
    RdzvKey("key", Kind.PATH, "etcd: this client's certificate's key",
            torch_backends=("etcd",),
            torch_meanings=(("etcd-v2", "not read: torch's etcd-v2 backend reads "
                                        "ssl_cert_key"),)),
    RdzvKey("user", Kind.TEXT, "etcd: the user to authenticate as"),
    RdzvKey("password", Kind.TEXT,
            "etcd: the user's password (prefer password_file or MESHRUN_ETCD_PASSWORD)",
            secret=True),
    RdzvKey("password_file", Kind.PATH, "etcd: a file holding the user's password"),
    RdzvKey("insecure", Kind.BOOL, "etcd: allow user and password over plain http"),
    RdzvKey("protocol", Kind.TEXT, "etcd: http or https", torch_backends=("etcd", "etcd-v2")),
    RdzvKey("store_type", Kind.TEXT,
            "accepted and not read: meshrun's c10d store is always a TCPStore",
            torch_backends=("c10d",),
            torch_meanings=(("c10d", "tcp (a TCPStore) or file (a FileStore)"),)),
    # -- torch's names for meshrun's keys ---------------------------------------------------
    RdzvKey("timeout", Kind.SECONDS,
            "read as the backend that runs the job reads it: join_timeout on etcd and static "
            "(beside join_timeout, timeout wins: those torch backends read only timeout), "
            "not read on c10d and etcd-v2", origin=Origin.TORCH_ALIAS,
            alias_of="join_timeout", torch_backends=("etcd", "static"),
            torch_meanings=(
                ("etcd", "the whole rendezvous's deadline (default 600 s)"),
                ("static", "the store's timeout: connecting and every wait, so how long the "
                           "nodes wait for each other (default 600 s)"),
                ("c10d", "not read (torch's launcher sets it to 900 s for every backend)"),
                ("etcd-v2", "not read (torch's launcher sets it to 900 s for every backend)"),
            ),
            read_as=(("etcd", "join_timeout"), ("static", "join_timeout"), ("c10d", None),
                     ("etcd-v2", None))),
    RdzvKey("ssl_cert", Kind.PATH, "read as cert", origin=Origin.TORCH_ALIAS,
            alias_of="cert", torch_backends=("etcd-v2",)),
    RdzvKey("ssl_cert_key", Kind.PATH, "read as key", origin=Origin.TORCH_ALIAS,
            alias_of="key", torch_backends=("etcd-v2",)),
    RdzvKey("ca_cert", Kind.PATH, "read as cacert", origin=Origin.TORCH_ALIAS,
            alias_of="cacert", torch_backends=("etcd-v2",)),
    # -- torch's keys meshrun has no use for ------------------------------------------------
    RdzvKey("etcd_prefix", Kind.TEXT, "torch's etcd backend's key prefix",
            origin=Origin.TORCH_ONLY, torch_backends=("etcd",),
            note="meshrun keeps a job's keys under /meshrun/<run id>/"),
    RdzvKey("use_libuv", Kind.BOOL,
            "not read by torch's backends (its TCPStore uses libuv by default; use_libuv is an "
            "env:// URL option)",
            origin=Origin.TORCH_ONLY, note="meshrun's stores always use libuv"),
    RdzvKey("local_addr", Kind.TEXT,
            "torchrun's --local-addr; in --rdzv-conf torch 2.13 fails on it (given twice to "
            "RendezvousParameters)",
            origin=Origin.TORCH_ONLY, note="give --local-addr"),
)  # fmt: skip

BY_NAME: dict[str, RdzvKey] = {k.name: k for k in KEYS}


def lookup(name: str) -> RdzvKey | None:
    """The row for ``name`` as given (an alias is its own row), or None: not a key."""
    return BY_NAME.get(name)


def resolve(name: str) -> str | None:
    """The meshrun key ``name`` is read as (itself, or what an alias is read as), or None:
    a torch-only key or not a key."""
    row = BY_NAME.get(name)
    if row is None or row.origin is Origin.TORCH_ONLY:
        return None
    return row.alias_of or row.name


def meshrun_keys() -> tuple[RdzvKey, ...]:
    """The keys read under their own name (`settings_from_conf` accepts exactly these)."""
    return tuple(k for k in KEYS if k.origin is Origin.MESHRUN)


def aliases() -> tuple[RdzvKey, ...]:
    """torch's names for meshrun keys."""
    return tuple(k for k in KEYS if k.origin is Origin.TORCH_ALIAS)


def torch_only() -> tuple[RdzvKey, ...]:
    """torch's keys that meshrun drops, with a note."""
    return tuple(k for k in KEYS if k.origin is Origin.TORCH_ONLY)


def durations() -> tuple[str, ...]:
    """The meshrun keys whose value is a number of seconds, in the table's order."""
    return tuple(k.name for k in meshrun_keys() if k.kind is Kind.SECONDS)


def secrets() -> tuple[str, ...]:
    """The keys whose value is a secret."""
    return tuple(k.name for k in KEYS if k.secret)


def is_secret_name(name: str) -> bool:
    """Whether a key of this name, known or not, holds a secret (`SECRET_WORDS`)."""
    low = name.lower()
    return (any(w in low for w in SECRET_WORDS)
            and not low.endswith(("_file", "_path")))  # fmt: skip


def backend_dependent_aliases() -> tuple[RdzvKey, ...]:
    """The aliases torch's backends read differently (``timeout``): the launcher reads them
    before the other keys, as the job's backend does (`RdzvKey.reading`), and its note names
    the value and the meaning taken, since which number meshrun took for which of its keys is
    not obvious from torch's meaning."""
    return tuple(k for k in aliases() if k.read_as)


#: An unknown key this many edits or fewer from a known one is a typo (`typo_of`).
TYPO_EDITS = 2


def typo_targets() -> frozenset[str]:
    """The names an unknown key within `TYPO_EDITS` edits of is taken as a typo of: every key
    of the table (meshrun's, torch's aliases, torch's keys meshrun drops)."""
    return frozenset(k.name for k in KEYS)


def typo_of(name: str) -> str | None:
    """The known key (`typo_targets`) that ``name``, an unknown key, is a typo of: the nearest
    within `TYPO_EDITS` edits whatever the key's length, the first in sorted order on a tie;
    None when none is that near. Edits are insertions, deletions, substitutions and swaps of
    two neighbouring letters (the optimal string alignment distance, Damerau's), so ``kye``,
    ``uesr`` and ``cetr`` are one edit from ``key``, ``user`` and ``cert``."""
    near = sorted((edits(name, k), k) for k in typo_targets())
    return near[0][1] if near and near[0][0] <= TYPO_EDITS else None


def edits(a: str, b: str) -> int:
    """The optimal string alignment distance of two short strings: the fewest insertions,
    deletions, substitutions and transpositions of two adjacent characters (each counted
    once, no substring edited twice) that turn ``a`` into ``b`` (Damerau, 1964)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))  # fmt: skip
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]
