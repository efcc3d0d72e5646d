"""The --rdzv-conf key table (`meshrun.rendezvous.keys`) is the one list: what the rendezvous
accepts, what the launcher reads, checks, renames, drops and redacts all follow its rows."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from meshrun.launcher import ConfigError, build_config
from meshrun.launcher.errors import ValueProblem, redact_secrets
from meshrun.launcher.values import MAX_SECONDS, parse_rdzv_conf
from meshrun.rendezvous import RendezvousSettings, keys, settings_from_conf
from meshrun.rendezvous.keys import KEYS, Kind, Origin

pytestmark = pytest.mark.timeout(30)

SECRET = "hunter2-do-not-print"
_SAMPLES = {Kind.SECONDS: "7", Kind.COUNT: "3", Kind.PORT: "29500", Kind.BOOL: "true",
            Kind.PATH: "some/file.pem", Kind.TEXT: "http"}  # fmt: skip
NAMES = [k.name for k in KEYS]


def _settings(conf: dict[str, str]) -> RendezvousSettings:
    return settings_from_conf(conf, run_id="j", min_nodes=1, max_nodes=2, max_restarts=0)


def test_the_table_is_consistent():
    assert len(set(NAMES)) == len(NAMES)
    settings_fields = {f.name for f in fields(RendezvousSettings)}
    for row in KEYS:
        assert row.meaning, row
        assert set(row.torch_backends) <= set(keys.TORCH_BACKENDS), row
        assert {b for b, _ in row.torch_meanings} <= set(keys.TORCH_BACKENDS), row
        assert (row.alias_of is not None) == (row.origin is Origin.TORCH_ALIAS), row
        assert bool(row.note) == (row.origin is Origin.TORCH_ONLY), row
        if row.alias_of is not None:  # an alias is read as a meshrun key of its kind
            target = keys.lookup(row.alias_of)
            assert target is not None and target.origin is Origin.MESHRUN, row
            assert target.kind is row.kind and keys.resolve(row.name) == target.name
        if row.protocol:
            assert row.origin is Origin.MESHRUN and row.kind in (Kind.SECONDS, Kind.COUNT)
            assert row.name in settings_fields or row.name == "heartbeat_timeout", row
    assert keys.resolve("etcd_prefix") is None and keys.resolve("zzz") is None
    assert keys.secrets() == ("secret", "password")


@pytest.mark.parametrize("name", NAMES)
def test_settings_from_conf_accepts_exactly_the_meshrun_keys(name: str):
    """The program door: a meshrun key is accepted (a protocol key as a number, the rest as
    text in ``extra``); an alias, a torch-only key, ``secret=`` and an unknown key raise."""
    row = keys.lookup(name)
    conf = {name: _SAMPLES[row.kind]}
    if row.origin is Origin.MESHRUN and not row.refused:
        settings = _settings(conf)
        if row.protocol:
            assert name not in settings.extra
        else:
            assert settings.extra == conf
    else:
        with pytest.raises(ValueError) as info:
            _settings(conf)
        if row.refused:
            assert "secret_file=PATH" in str(info.value)
        else:
            assert "unknown key" in str(info.value)


def test_settings_from_conf_names_the_table_as_the_known_keys():
    with pytest.raises(ValueError, match="unknown key") as info:
        _settings({"zzz": "1"})
    listed = str(info.value).split("known keys: ")[1].rstrip(")").split(", ")
    assert listed == sorted(k.name for k in keys.meshrun_keys() if not k.refused)


def test_every_row_passes_the_launcher_as_the_table_says():
    """The user door: meshrun keys pass unchanged, aliases are renamed with a note, torch-only
    keys and unknown keys are dropped with a line each; what comes out is what the program
    door accepts."""
    given = {k.name: _SAMPLES[k.kind] for k in KEYS if not k.refused}
    given = {n: v for n, v in given.items() if n not in {k.alias_of for k in keys.aliases()}}
    conf, notes = parse_rdzv_conf(",".join(f"{n}={v}" for n, v in {**given, "zzz": "1"}.items()))
    expected = {keys.resolve(n): v for n, v in given.items() if keys.resolve(n)}
    assert conf == expected
    for row in keys.aliases():
        assert any(f"--rdzv-conf {row.name}" in n and f"read as {row.alias_of}" in n
                   for n in notes), (row, notes)  # fmt: skip
    for row in keys.torch_only():
        assert f"note: --rdzv-conf {row.name} ignored ({row.note})" in notes
    assert "warning: --rdzv-conf zzz is not a key meshrun or torch reads; ignored" in notes
    assert len(notes) == len(keys.aliases()) + len(keys.torch_only()) + 1
    _settings(conf)


@pytest.mark.parametrize("row", [k for k in KEYS if k.origin is not Origin.TORCH_ONLY],
                         ids=lambda k: k.name)  # fmt: skip
def test_an_alias_beside_its_key_or_a_typo_is_refused_by_the_launcher(row):
    if row.alias_of is not None and row not in keys.backend_dependent_aliases():
        with pytest.raises(ValueProblem) as info:
            parse_rdzv_conf(f"{row.name}=1,{row.alias_of}=1")
        assert info.value.fix == f"give only {row.alias_of}"
    if row.name in keys.typo_targets():
        typo = row.name[:-2] + row.name[-1]  # one letter dropped: join_timout's kind
        assert keys.lookup(typo) is None
        with pytest.raises(ValueProblem) as info:
            parse_rdzv_conf(f"{typo}=1")
        assert info.value.fix.startswith("did you mean")


@pytest.mark.parametrize("name", [k.name for k in KEYS if k.kind is Kind.SECONDS])
def test_every_duration_key_is_a_duration_to_the_launcher(name: str):
    meant = keys.resolve(name)
    assert meant in keys.durations()
    assert parse_rdzv_conf(f"{name}=2.5")[0] == {meant: "2.5"}  # timeout: on static
    named = name if keys.lookup(name) in keys.backend_dependent_aliases() else meant
    for bad in ("soon", "0", "-1", "nan", f"{MAX_SECONDS * 10:g}"):
        with pytest.raises(ValueProblem, match=re.escape(f"{named}={bad} is not a number")):
            parse_rdzv_conf(f"{name}={bad}")


def test_only_the_duration_keys_are_checked_as_durations():
    conf = {k.name: "soon" for k in keys.meshrun_keys()
            if k.kind is not Kind.SECONDS and not k.refused}  # fmt: skip
    assert parse_rdzv_conf(",".join(f"{n}={v}" for n, v in conf.items()))[0] == conf


@pytest.mark.parametrize("name", NAMES)
def test_secret_keys_are_the_ones_the_redaction_hides(name: str):
    row = keys.lookup(name)
    assert row.secret == keys.is_secret_name(name)
    shown = redact_secrets(f"--rdzv-conf {name}={SECRET},join_timeout=soon: bad")
    assert (SECRET not in shown) == row.secret, shown


@pytest.mark.parametrize("name", keys.secrets())
def test_a_secret_key_never_reaches_the_launchers_error_line(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    with pytest.raises(ConfigError) as info:
        build_config(["--rdzv-conf", f"user=u,{name}={SECRET},join_timeout=soon", "train.py"],
                     {})  # fmt: skip
    assert "join_timeout=soon" in str(info.value) and SECRET not in str(info.value)


def test_timeout_is_the_backend_dependent_alias():
    """torch's backends read ``timeout`` differently (the row says how, for each of them), and
    the launcher reads it as the job's backend does."""
    (row,) = keys.backend_dependent_aliases()
    assert row.name == "timeout" and row.alias_of == "join_timeout"
    assert {b for b, _ in row.torch_meanings} == set(keys.TORCH_BACKENDS)
    assert {b for b, _ in row.read_as} == set(keys.TORCH_BACKENDS)
    assert row.reading("etcd-v3") == row.reading("etcd")


# torch 2.13's reading of timeout= per backend (etcd_rendezvous.py create_rdzv_handler:
# timeout=get_as_int("timeout"), join_timeout unread; static_tcp_rendezvous.py: the TCPStore's
# timeout; dynamic_rendezvous.py, c10d and etcd-v2: join/last_call/close/heartbeat only)
TIMEOUT_READINGS = {
    "etcd": ({"join_timeout": "5", "last_call_timeout": "1"}, "the whole rendezvous's deadline"),
    "etcd-v3": ({"join_timeout": "5", "last_call_timeout": "1"}, "the whole rendezvous's deadline"),
    "static": ({"join_timeout": "5", "last_call_timeout": "1"}, "the store's timeout"),
    "c10d": ({"join_timeout": "5", "last_call_timeout": "1"}, None),
    "etcd-v2": ({"join_timeout": "5", "last_call_timeout": "1"}, None),
}


@pytest.mark.parametrize("backend", list(TIMEOUT_READINGS))
def test_timeout_beside_join_timeout_as_each_torch_backend_reads_it(backend):
    """torch's own launcher test gives join_timeout=5,last_call_timeout=1,timeout=5: accepted on
    every backend, with one note saying which meaning was taken."""
    conf, notes = parse_rdzv_conf("join_timeout=5,last_call_timeout=1,timeout=5", backend)
    expected, meaning = TIMEOUT_READINGS[backend]
    assert conf == expected
    assert len(notes) == 1, notes
    torch_name = "etcd" if backend == "etcd-v3" else backend
    if meaning is None:
        assert notes[0].startswith(f"note: --rdzv-conf timeout=5 ignored: torch's {torch_name} "
                                   "backend does not read it"), notes  # fmt: skip
    else:
        assert notes[0].startswith(f"note: --rdzv-conf timeout=5 is read as join_timeout=5, as "
                                   f"torch's {torch_name} backend reads it: {meaning}"), notes
    _settings(conf)


def test_timeout_wins_over_join_timeout_where_torch_reads_only_timeout():
    conf, notes = parse_rdzv_conf("join_timeout=9,timeout=5", "etcd")
    assert conf == {"join_timeout": "5"}
    assert notes[0].endswith("; join_timeout=9, which it does not read, is not used"), notes
    conf, notes = parse_rdzv_conf("join_timeout=9,timeout=5", "c10d")
    assert conf == {"join_timeout": "9"} and "ignored" in notes[0]
    assert parse_rdzv_conf("timeout=5", "static")[0] == {"join_timeout": "5"}
    with pytest.raises(ValueProblem, match="timeout=soon is not a number"):
        parse_rdzv_conf("timeout=soon", "c10d")  # checked where it is not read too


# (typo, the key meant): swaps, short keys, two edits of any key
TYPOS = {"kye": "key", "uesr": "user", "cetr": "cert", "usr": "user", "ky": "key",
         "jion_timeout": "join_timeout", "timout": "timeout", "tiemout": "timeout",
         "raed_timoeut": "read_timeout", "cacret": "cacert", "protcool": "protocol",
         "bind_al": "bind_all", "is_hots": "is_host", "scret_fiel": "secret_file"}  # fmt: skip


@pytest.mark.parametrize("typo", list(TYPOS))
def test_a_typo_within_two_edits_is_an_error_whatever_the_keys_length(typo):
    assert keys.lookup(typo) is None
    with pytest.raises(ValueProblem) as info:
        parse_rdzv_conf(f"{typo}=1")
    assert info.value.fix == f"did you mean {TYPOS[typo]}?"


@pytest.mark.parametrize("name", sorted(keys.typo_targets()))
def test_every_adjacent_swap_of_a_known_key_is_a_typo_of_it(name):
    for i in range(len(name) - 1):
        swapped = name[:i] + name[i + 1] + name[i] + name[i + 2:]
        if swapped == name or keys.lookup(swapped) is not None:
            continue
        assert keys.edits(swapped, name) == 1
        assert keys.typo_of(swapped) is not None, swapped


def test_three_edits_from_every_key_is_not_a_typo():
    assert keys.edits("kye", "key") == 1 and keys.edits("abc", "ca") == 3  # OSA, not Damerau's unrestricted
    for far in ("zzz", "nproc", "rendezvous_port"):
        assert keys.typo_of(far) is None, far
        conf, notes = parse_rdzv_conf(f"{far}=1")
        assert conf == {} and notes == [f"warning: --rdzv-conf {far} is not a key meshrun or "
                                        "torch reads; ignored"]  # fmt: skip
