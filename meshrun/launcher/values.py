"""Parsers for option values: one string (as torchrun would see it) -> one typed value.

Each parser mirrors how ``torch.distributed.run`` reads the same option, checks what torchrun
leaves to a later crash (``--nnodes 3:2``, ``--redirects 3x``), and raises `ValueProblem`
(the problem and the fix) on bad input. They do not know whether a value came from a flag,
a ``PET_*`` variable or a config file: `meshrun.launcher.build` adds that.

Nothing here imports torch: GPUs are counted from ``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping

from meshrun.agent.config import Std, StdSpec
from meshrun.launcher.errors import ValueProblem
from meshrun.rendezvous import keys
from meshrun.rendezvous.keys import Origin

# Bounds no real job reaches, so a typo cannot start work that brings the machine down:
MAX_NPROC_PER_NODE = 1024  # workers on one node (GPUs, or one per core on the biggest hosts)
MAX_SECONDS = 1_000_000.0  # any duration: 11.6 days (timedelta and sleep limits are far above)
MIN_MONITOR_INTERVAL = 0.001  # seconds: a smaller period is a busy loop
RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")

# -- sizes ----------------------------------------------------------------------------------


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"N"`` -> ``(N, N)``; ``"MIN:MAX"`` -> ``(MIN, MAX)``, as torchrun's ``--nnodes``.

    Raises `ValueProblem` unless both are integers with ``1 <= MIN <= MAX``.
    """
    fix = "give N or MIN:MAX with 1 <= MIN <= MAX"
    parts = value.strip().split(":")
    if len(parts) > 2:
        raise ValueProblem('not in "N" or "MIN:MAX" form', fix)
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise ValueProblem("not an integer node count", fix) from None
    lo, hi = numbers[0], numbers[-1]
    if lo < 1:
        what = "the node count" if len(parts) == 1 else "MIN"
        raise ValueProblem(f"{what} must be at least 1 (got {lo})", fix)
    if lo > hi:
        raise ValueProblem(f"MIN must not exceed MAX (got MIN={lo}, MAX={hi})", fix)
    return lo, hi


def parse_nproc_per_node(value: str, env: Mapping[str, str]) -> int:
    """Workers per node: an integer >= 1, or ``cpu``, ``gpu`` or ``auto`` as torchrun.

    ``cpu`` -> the CPUs this process may run on (``sched_getaffinity``, as torch's
    ``cpu_count``); ``gpu`` -> `count_gpus` (a problem if there are none); ``auto`` -> the GPU
    count if any, else the CPU count. ``env`` supplies ``CUDA_VISIBLE_DEVICES`` and ``PATH``.
    """
    fix = "give an integer >= 1, or cpu, gpu or auto"
    text = value.strip()
    if text in ("cpu", "gpu", "auto"):
        gpus = count_gpus(env) if text != "cpu" else 0
        if text == "gpu" and gpus == 0:
            raise ValueProblem(
                "no GPU found (CUDA_VISIBLE_DEVICES is empty or unset and nvidia-smi lists none)",
                "give an integer, or cpu",
            )
        return gpus if gpus else _cpu_count()
    try:
        n = int(text)
    except ValueError:
        raise ValueProblem("not a worker count", fix) from None
    if not 1 <= n <= MAX_NPROC_PER_NODE:
        raise ValueProblem(f"out of range (got {n})",
                           f"give an integer between 1 and {MAX_NPROC_PER_NODE}")
    return n


def count_gpus(env: Mapping[str, str]) -> int:
    """The number of CUDA devices visible to workers, found without importing torch.

    ``CUDA_VISIBLE_DEVICES`` when set: its comma-separated entries, stopping at the first
    negative one as the CUDA runtime does (``""`` and ``"-1"`` -> 0). Otherwise the ``GPU``
    lines of ``nvidia-smi -L`` when that binary is on ``env["PATH"]``, else 0.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            count += 1
        return count
    smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if smi is None:
        return 0
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# -- numbers --------------------------------------------------------------------------------


def parse_int(value: str, minimum: int, maximum: int | None = None) -> int:
    """An integer in ``[minimum, maximum]``; raises `ValueProblem` otherwise."""
    span = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ValueProblem("not an integer", f"give an integer {span}") from None
    if n < minimum or (maximum is not None and n > maximum):
        raise ValueProblem(f"out of range (got {n})", f"give an integer {span}")
    return n


_BYTE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


MIN_LOG_BYTES, MAX_LOG_BYTES = 4096, 1024**4  # a rotation per line; 1 TiB per log file


def parse_bytes(value: str) -> int:
    """A log size in bytes, 4 KiB to 1 TiB: an integer, optionally followed by K, M or G
    (powers of 1024, so ``64K`` = 65536); raises `ValueProblem` otherwise. Below 4 KiB the
    files would rotate on every line and the console fall behind the workers."""
    fix = ("give a number of bytes between 4096 and 1024G, e.g. 10000000 or 100M (K, M, G: "
           "powers of 1024)")
    m = re.fullmatch(r"(\d+)([KMG]?)", str(value).strip().upper())
    if m is None:
        raise ValueProblem("not a size in bytes", fix)
    n = int(m.group(1)) * _BYTE_UNITS[m.group(2)]
    if not MIN_LOG_BYTES <= n <= MAX_LOG_BYTES:
        raise ValueProblem(f"out of range (got {n})", fix)
    return n


def parse_seconds(value: str, allow_zero: bool = False, minimum: float = 0.0) -> float:
    """A duration in seconds: a float > 0 (>= 0 with ``allow_zero``; >= ``minimum`` if given)
    and at most `MAX_SECONDS`; raises `ValueProblem` otherwise."""
    if minimum > 0:
        bound = f"between {minimum:g} and {MAX_SECONDS:g}"
    else:
        bound = f"{'>= 0' if allow_zero else '> 0'} and at most {MAX_SECONDS:g}"
    fix = f"give a number of seconds {bound}"
    try:
        x = float(str(value).strip())
    except ValueError:
        raise ValueProblem("not a number", fix) from None
    low_ok = x >= minimum if minimum > 0 else (x >= 0 if allow_zero else x > 0)
    if not low_ok or x != x or x > MAX_SECONDS:
        raise ValueProblem(f"out of range (got {x:g})", fix)
    return x


def parse_rdzv_id(value: str) -> str:
    """A job id: 1-128 of ``A-Z a-z 0-9 . _ -``, not ``.`` or ``..`` (it names directories
    under ``--log-dir`` and keys in the store); raises `ValueProblem` otherwise."""
    text = str(value)
    if not RUN_ID.fullmatch(text) or text in (".", ".."):
        raise ValueProblem(
            "not a valid job id (it names log directories and store keys)",
            "use 1-128 letters, digits, '.', '_' or '-', e.g. job-42 (no '/', no '..')",
        )
    return text


def parse_choice(value: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; raises `ValueProblem` otherwise."""
    if value not in choices:
        raise ValueProblem("not a valid choice", f"give one of {', '.join(choices)}")
    return value


LOGS_SPECS_GROUP = "torchrun.logs_specs"


def parse_logs_specs(value: str) -> str:
    """``--logs-specs NAME``: a name of torchrun's ``torchrun.logs_specs`` entry-point group
    (torch registers ``default``), as torchrun's ``_get_logs_specs_class`` finds it; kept, with
    no effect (meshrun's log layout is fixed). The group is read from the installed packages'
    metadata (``importlib.metadata``), not by importing torch.

    Raises:
        ValueProblem: no entry point of that name (torchrun raises ValueError there); the
            message names the installed ones.
    """
    from importlib import metadata

    known = sorted({ep.name for ep in metadata.entry_points().select(group=LOGS_SPECS_GROUP)})
    if value not in known:
        installed = ", ".join(known) if known else "none is installed"
        raise ValueProblem(
            f"no {LOGS_SPECS_GROUP} entry point of that name (installed: {installed})",
            "give one of them, or leave the option out: it has no effect in meshrun",
        )
    return value


def parse_flag_env(value: str) -> bool:
    """A ``PET_*`` value for a boolean flag, read as torchrun does: ``bool(int(value))``."""
    try:
        return bool(int(value.strip()))
    except ValueError:
        raise ValueProblem("not 0 or 1", "set it to 1 (on) or 0 (off)") from None


# -- rendezvous -----------------------------------------------------------------------------

RDZV_BACKENDS = ("static", "c10d", "etcd")
_BACKEND_ALIASES = {"etcd-v3": "etcd", "etcd-v2": "etcd"}

def parse_rdzv_backend(value: str) -> str:
    """``static``, ``c10d``, ``etcd`` (``etcd-v3`` and ``etcd-v2`` are read as ``etcd``: meshrun
    speaks etcd's v3 API, which etcd 3.4+ serves by default; `backend_note` says so for v2);
    raises `ValueProblem`.
    """
    name = value.strip().lower()
    name = _BACKEND_ALIASES.get(name, name)
    if name not in RDZV_BACKENDS:
        raise ValueProblem("unknown rendezvous backend", "give static, c10d or etcd")
    return name


def backend_note(value: str) -> str | None:
    """The note for a backend name read as another (``etcd-v2``), or None."""
    if value.strip().lower() == "etcd-v2":
        return ("note: --rdzv-backend etcd-v2 runs on etcd's v3 API (meshrun has no v2 "
                "client; etcd 3.4 and later serve v3 by default)")  # fmt: skip
    return None


_SECRET_KEY = re.compile("(?i)" + "|".join(keys.SECRET_WORDS))


def parse_rdzv_conf(value: str, backend: str = "static") -> tuple[dict[str, str], list[str]]:
    """``"k=v,k2=v2"`` -> ``({"k": "v", "k2": "v2"}, notes)``, values kept as strings.

    As torch's ``_parse_rendezvous_config``: keys and values are stripped, an entry without
    ``=``, an empty key or an empty value is a problem. ``timeout`` is read as torch's
    ``backend`` (the one that runs the job, by torch's name: ``static``, ``c10d``, ``etcd``,
    ``etcd-v2``; ``etcd-v3`` is ``etcd``) reads it (`meshrun.rendezvous.keys`): as
    ``join_timeout`` on etcd and static (beside ``join_timeout``, ``timeout`` wins, as those
    backends read only it), not at all on c10d and etcd-v2; one note says which (never dropped
    silently). Duration keys (``join_timeout``, ``read_timeout``, ``timeout``, ...) must be
    numbers of seconds > 0. Returns the dict and the notes to print.
    """
    fix = "give key=value pairs separated by commas, e.g. join_timeout=60,read_timeout=10"
    conf: dict[str, str] = {}
    notes: list[str] = []
    text = value.strip()
    if not text:
        return conf, notes
    previous = ""
    for entry in text.split(","):
        key, sep, val = entry.partition("=")
        key, val = key.strip(), val.strip()
        if not sep and _SECRET_KEY.search(previous):  # the rest of a password with a comma
            raise ValueProblem(
                f"an entry after {previous!r} has no '=' (a comma in the value?)",
                "give it without commas"
                + (", or in a file (password_file=PATH)" if previous == "password" else ""),
            )
        if not sep or not key or not val:
            what = "no '='" if not sep else ("an empty key" if not key else "an empty value")
            raise ValueProblem(f"entry {entry.strip()!r} has {what}", fix)
        previous = key
        if key in conf:
            raise ValueProblem(f"key {key!r} is given twice", "give each key once")
        conf[key] = val
    for alias in keys.backend_dependent_aliases():  # timeout: read first, the value named
        if alias.name in conf:
            notes.append(_read_per_backend(alias, conf, backend))
    _known_keys_only(conf, notes)
    for key in keys.durations():  # checked here so the agent need not re-check them
        if key in conf:
            try:
                parse_seconds(conf[key])
            except ValueProblem:
                raise ValueProblem(
                    f"{key}={conf[key]} is not a number of seconds > 0",
                    f"give e.g. {key}=60",
                ) from None
    return conf, notes


def _read_per_backend(alias: keys.RdzvKey, conf: dict[str, str], backend: str) -> str:
    """Read ``alias`` (``timeout``, in ``conf``) as torch's ``backend`` does, in place: under
    the meshrun key it is read as there, or dropped where that backend does not read it.
    Returns the one note that says which meaning was taken."""
    text = conf.pop(alias.name)
    try:
        parse_seconds(text)
    except ValueProblem:
        raise ValueProblem(f"{alias.name}={text} is not a number of seconds > 0",
                           f"give e.g. {alias.name}=60") from None  # fmt: skip
    torch_name = "etcd" if backend == "etcd-v3" else backend
    target, meaning = alias.reading(torch_name)
    if target is None:
        return (f"note: --rdzv-conf {alias.name}={text} ignored: torch's {torch_name} backend "
                "does not read it, nor does meshrun there (the join's deadline is "
                "join_timeout)")  # fmt: skip
    beside = conf.get(target)
    conf[target] = text
    unused = f"; {target}={beside}, which it does not read, is not used" if beside not in (
        None, text) else ""  # fmt: skip
    return (f"note: --rdzv-conf {alias.name}={text} is read as {target}={text}, as torch's "
            f"{torch_name} backend reads it: {meaning}{unused}")  # fmt: skip


def _known_keys_only(conf: dict[str, str], notes: list[str]) -> None:
    """Read torch's names for meshrun's keys, drop the keys meshrun has no use for (with a
    note each: torch ignores keys it does not read, so torchrun runs with them, and so does
    meshrun), and refuse a key within two edits of a known one (a typo: ``join_timout``).
    Which key is which: `meshrun.rendezvous.keys`."""
    for key in list(conf):
        row = keys.lookup(key)
        if row is not None and row.origin is Origin.MESHRUN:
            continue
        if row is not None and row.origin is Origin.TORCH_ALIAS:
            name = row.alias_of
            if name in conf:
                raise ValueProblem(f"{key} is torch's name for {name}, and both are given",
                                   f"give only {name}")  # fmt: skip
            conf[name] = conf.pop(key)
            notes.append(f"note: --rdzv-conf {key} is read as {name}")
        elif row is not None and row.origin is Origin.TORCH_ONLY:
            del conf[key]
            notes.append(f"note: --rdzv-conf {key} ignored ({row.note})")
        else:
            near = keys.typo_of(key)  # within two edits, swaps included, any length
            if near:
                raise ValueProblem(f"unknown key {key!r}", f"did you mean {near}?")
            del conf[key]
            notes.append(f"warning: --rdzv-conf {key} is not a key meshrun or torch reads; "
                         "ignored")  # fmt: skip


# -- output ---------------------------------------------------------------------------------

_STD_VALUE = re.compile(r"[0-3]")
_STD_MAPPING = re.compile(r"[0-9]+:[0-3](,[0-9]+:[0-3])*")


def parse_std_spec(value: str) -> StdSpec:
    """A ``-r/--redirects`` or ``-t/--tee`` value, as torch's ``Std.from_str``.

    ``"3"`` -> all local ranks get `Std.ALL`; ``"0:1,1:2"`` -> local rank 0 stdout, local rank
    1 stderr, every other rank `Std.NONE`. 0 none, 1 stdout, 2 stderr, 3 both.
    """
    text = value.strip()
    if _STD_VALUE.fullmatch(text):
        return StdSpec(Std(int(text)))
    if _STD_MAPPING.fullmatch(text):
        per_rank: dict[int, Std] = {}
        for item in text.split(","):
            rank, std = item.split(":")
            per_rank[int(rank)] = Std(int(std))
        return StdSpec(Std.NONE, tuple(sorted(per_rank.items())))
    raise ValueProblem(
        "not a stream selection",
        "give 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank as 0:1,1:2",
    )


def parse_local_ranks_filter(value: str) -> frozenset[int] | None:
    """``"0,2"`` -> ``frozenset({0, 2})``; ``""`` -> ``None`` (every local rank)."""
    text = value.strip()
    if not text:
        return None
    try:
        ranks = frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise ValueProblem(
            "not a list of local ranks", "give comma-separated integers, e.g. 0,2"
        ) from None
    if min(ranks) < 0:
        raise ValueProblem("local ranks are >= 0", "give comma-separated integers, e.g. 0,2")
    return ranks


def parse_filters(value: str) -> tuple[str, ...]:
    """A ``--duplicate-std{out,err}-filters`` value: comma-separated, ``,,`` escapes a comma.

    Split exactly as torch's ``comma_separated_list``, except that empty items are dropped
    (torch would keep ``""``, a filter matching every line): ``""`` -> ``()``.
    """
    placeholder = "\0"
    items = value.replace(",,", placeholder).split(",")
    return tuple(i.replace(placeholder, ",") for i in items if i)


_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}
# signals whose default action is to be ignored (or to continue): not requests to stop; a
# handler for SIGCHLD would also fire each time a worker exits
_NOT_STOP_REQUESTS = {"SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH"}


def parse_signals(value: str) -> tuple[int, ...]:
    """``"SIGTERM,SIGINT"`` -> ``(15, 2)``: signal names (``SIG`` prefix optional), in order.

    ``""`` -> ``()`` (forward none). Unknown names, and SIGKILL/SIGSTOP (which cannot be
    caught), are problems.
    """
    numbers: list[int] = []
    for item in value.split(","):
        name = item.strip().upper()
        if not name:
            continue
        if not name.startswith("SIG"):
            name = "SIG" + name
        sig = getattr(signal.Signals, name, None) if name.isidentifier() else None
        if not isinstance(sig, signal.Signals):
            raise ValueProblem(
                f"unknown signal {item.strip()!r}",
                "give signal names such as SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            )
        if name in _UNCATCHABLE:
            raise ValueProblem(f"{name} cannot be handled", "leave it out")
        if name in _NOT_STOP_REQUESTS:
            raise ValueProblem(f"{name} is not a request to stop (by default it is ignored)",
                               "leave it out; give e.g. SIGTERM,SIGINT,SIGHUP,SIGQUIT")
        if int(sig) not in numbers:
            numbers.append(int(sig))
    return tuple(numbers)
