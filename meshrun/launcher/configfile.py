"""``--config FILE.toml``: a job's options written down once, overridden by env and flags.

Keys are option names without the dashes, in either spelling (``nproc_per_node = 4`` or
``nproc-per-node = 4``); values are TOML strings, numbers or booleans (booleans for flags:
``standalone = true``). Three options also take structured values: ``rdzv_conf`` a table
(``[rdzv_conf]`` / ``rdzv_conf = {join_timeout = 60}``), ``signals_to_handle``,
``local_ranks_filter`` and the ``duplicate_*_filters`` a list. Paths (``log_dir``) are
relative to the working directory, as on the command line. See ``configs/*.toml``.
"""

from __future__ import annotations

import difflib
import os
import stat
import sys
from dataclasses import dataclass

from meshrun.launcher.errors import ConfigError
from meshrun.launcher.options import BY_NAME, OptionSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MAX_CONFIG_BYTES = 1024 * 1024  # a job config is a few lines; /dev/zero is not one


@dataclass(frozen=True)
class RawValue:
    """An option's value before parsing, and where it came from (for error messages).

    ``value`` is a string as on the command line, or a bool for a flag; ``where`` reads like
    ``--nnodes 3:2``, ``PET_NNODES=3:2`` or ``job.toml: nnodes = '3:2'``.
    """

    value: str | bool
    where: str


def load_config_file(path: str) -> dict[str, RawValue]:
    """Read a TOML job config -> ``{option name: RawValue}``.

    Raises `ConfigError` when the file cannot be read, is not valid TOML, has a key that is
    not an option, or a value of the wrong kind (a string for a flag, a table elsewhere).
    """
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(f"--config {path}: not a regular file; give the path of a "
                                  "TOML file")
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"--config {path}: larger than {MAX_CONFIG_BYTES // 1024} KiB; "
                              "a job config is a few lines of TOML: give that file")
        data = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not UTF-8 text; give a TOML file") from None
    except OSError as e:
        raise ConfigError(
            f"--config {path}: cannot read it ({e.strerror or e}); give the path of a "
            "readable TOML file"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            f"--config {path}: not valid TOML ({e}); fix the file (see configs/*.toml)"
        ) from None

    out: dict[str, RawValue] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        spec = BY_NAME.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, list(BY_NAME), n=1)
            hint = f"did you mean {close[0]}?" if close else "keys are meshrun option names"
            raise ConfigError(f"{path}: unknown key {key!r}; {hint}")
        if name in out:
            raise ConfigError(f"{path}: {key!r} is given twice (dash and underscore); keep one")
        where = f"{path}: {key} = {_show(value)}"
        out[name] = RawValue(_to_raw(spec, value, where), where)
    return out


def _to_raw(spec: OptionSpec, value: object, where: str) -> str | bool:
    if spec.is_flag:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: {spec.name} is a flag; write true or false")
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {spec.name} takes a value, not true/false")
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, dict) and spec.name == "rdzv_conf":
        return ",".join(f"{k}={_scalar(v, where)}" for k, v in value.items())
    if isinstance(value, list) and spec.name in (
        "signals_to_handle",
        "local_ranks_filter",
        "duplicate_stdout_filters",
        "duplicate_stderr_filters",
    ):
        items = [_scalar(v, where) for v in value]
        if spec.name.startswith("duplicate_"):
            items = [i.replace(",", ",,") for i in items]  # keep commas inside one filter
        return ",".join(items)
    raise ConfigError(f"{where}: {spec.name} takes a string or a number here")


def _scalar(value: object, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise ConfigError(f"{where}: nested values must be strings or numbers")


def _show(value: object) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."
