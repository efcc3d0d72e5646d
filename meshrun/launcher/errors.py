"""The one error type of the launcher: bad user input, reported as one line, exit code 2.

Every problem found while turning flags, ``PET_*`` variables and a config file into a
`LaunchConfig` is raised as `ConfigError`, whose text reads
``<where>: <problem>; <fix>``, e.g. ``--nnodes 3:2: MIN must not exceed MAX (got MIN=3,
MAX=2); give N or MIN:MAX with 1 <= MIN <= MAX``. ``meshrun.launcher.cli.main`` prints it as
``meshrun: error: <text>`` on one line of stderr and exits with code 2 (docs/design.md §3.4) before
anything is started.
"""

from __future__ import annotations

import re

from meshrun import exits
from meshrun.rendezvous.keys import SECRET_WORDS

# ``password=VALUE`` (quoted or not), or ``'password': 'VALUE'`` as a dict is shown (quoted);
# also secret, token, and any key with one of them in its name (auth_token, etcd_password,
# secrets: a typo of secret; the words: `meshrun.rendezvous.keys.SECRET_WORDS`), but not a
# ``*_file``/``*_path`` key (its value is a path). An unquoted value runs on past commas up to
# the next ``key=`` entry (a password with a comma in ``--rdzv-conf user=u,password=ab,cd`` is
# all of ``ab,cd``), and leaves a colon that ends the value (``...password=VALUE: the
# problem``) in place.
_WORDS = "|".join(SECRET_WORDS)
_PIECE = r"""(?:[^,\s;}:]|:(?!\s|$))"""
_SECRET = re.compile(
    rf"""(?i)\b([\w.-]*?(?:{_WORDS})[\w.-]*?)(?<!_file)(?<!_path)"""
    rf"""(?:(['"]?\s*=\s*)("[^"]*"|'[^']*'|{_PIECE}*(?:,(?![\w.-]+\s*=){_PIECE}+)*)"""
    r"""|(['"]\s*:\s*)("[^"]*"|'[^']*'))"""
)


def redact_secrets(text: str) -> str:
    """``text`` with every ``password=VALUE`` (``secret``, ``token``; ``=`` or ``:``, quoted
    or not) shown as ``password=***``: error lines quote the user's input, and a password in
    an ``--rdzv-conf`` value must not reach a terminal, a log or a CI transcript."""
    return _SECRET.sub(lambda m: f"{m.group(1)}{m.group(2) or m.group(4)}***", text)


class ConfigError(exits.ConfigError):
    """Bad user input: an unknown option, a bad value, a missing script, a bad config file.

    ``str(error)`` is one line (newlines are folded), naming where the value came from, the
    value (secrets shown as ``***``: `redact_secrets`), the problem, and the fix.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact_secrets(" ".join(message.split("\n")).strip()))


class ValueProblem(ValueError):
    """Raised by the value parsers in `meshrun.launcher.values`: what is wrong and the fix.

    The parsers do not know where a value came from (flag, env, file); `build_config` adds
    that and re-raises as `ConfigError`.
    """

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def at(self, where: str) -> ConfigError:
        """This problem as a `ConfigError` for the value described by ``where``."""
        text = f"{where}: {self.problem}"
        if self.fix:
            text += f"; {self.fix}"
        return ConfigError(text)
