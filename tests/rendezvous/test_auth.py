"""AuthenticatedStore (meshrun.rendezvous.auth): every value sealed with HMAC-SHA256 over
(run id, key, value), on the in-memory store, a real TCPStore and a real etcd.

The forger is a plain client of the same store (``connect()``), without the secret: it writes
in the store's own format, so only the seal can tell its values apart.
"""

import os
import threading
import time

import pytest

from meshrun.rendezvous import RendezvousError, settings_from_conf
from meshrun.rendezvous.auth import HEADER_BYTES, AuthenticatedStore, load_secret

pytestmark = pytest.mark.timeout(30)

SECRET = b"k3y-0f-th3-j0b-5a1f8c"
JOB = "job"


@pytest.fixture
def stores(store_pair):
    """(authenticated store, a forger's plain client of the same store)."""
    store, connect = store_pair
    return AuthenticatedStore(store, SECRET, JOB), connect()


def test_values_round_trip_and_are_sealed(stores):
    auth, raw = stores
    stored = auth.set_once("/k", b"value")
    assert stored.value == b"value"
    assert auth.get("/k").value == b"value"
    sealed = raw.get("/k").value
    assert sealed.endswith(b"value") and len(sealed) == HEADER_BYTES + len(b"value")
    assert SECRET not in sealed
    ok, v2 = auth.compare_and_set("/k", stored.version, b"two")
    assert ok and auth.get("/k") == v2
    assert auth.get_many(["/k", "/absent"]) == [v2, None]


def test_forged_value_is_absent_and_a_write_once_replaces_it(stores):
    auth, raw = stores
    raw.set_once("/master", b"evil.example:1234")
    assert auth.get("/master") is None
    assert auth.get_many(["/master"]) == [None]
    assert auth.set_once("/master", b"10.0.0.1:29500").value == b"10.0.0.1:29500"
    assert auth.get("/master").value == b"10.0.0.1:29500"


def test_tampered_value_is_rejected(stores):
    auth, raw = stores
    auth.set_once("/state", b'{"status": "running"}')
    item = raw.get("/state")
    tampered = item.value.replace(b"running", b"failed!")
    other = AuthenticatedStore(raw, SECRET, JOB)  # a fresh agent that never read it
    ok, _ = raw.compare_and_set("/state", item.version, tampered)
    assert ok
    assert other.get("/state") is None
    with pytest.raises(RendezvousError, match="overwritten by a program without the job's secret"):
        auth.get("/state")  # it had read the real value: lost, never replaced by the forgery


def test_value_moved_to_another_key_is_rejected(stores):
    """The key is in the MAC: an authentic value copied elsewhere does not check."""
    auth, raw = stores
    auth.set_once("/r0/master", b"10.0.0.1:29500")
    raw.set_once("/r1/master", raw.get("/r0/master").value)
    assert auth.get("/r1/master") is None


def test_value_from_another_job_or_secret_is_rejected(stores):
    auth, raw = stores
    AuthenticatedStore(raw, SECRET, "other-job").set_once("/k", b"v")
    assert auth.get("/k") is None
    AuthenticatedStore(raw, b"another-secret-0123456", JOB).set_once("/k2", b"v")
    assert auth.get("/k2") is None


def test_a_waiter_waits_past_a_forgery(stores):
    auth, raw = stores
    got = []
    waiter = threading.Thread(target=lambda: got.append(auth.wait_for_change("/w", 0, 10)))
    waiter.start()
    time.sleep(0.3)
    raw.set_once("/w", b"forged")
    time.sleep(0.3)
    assert not got, "a forged value woke the waiter as a change"
    AuthenticatedStore(raw, SECRET, JOB).set_once("/w", b"real")
    waiter.join(10)
    assert got and got[0].value == b"real"
    assert auth.wait_for_change("/nothing", 0, 0.2) is None


def test_register_entries_forged_or_copied_are_skipped(stores):
    """A forged entry (no valid MAC) is skipped, not a member; a copy of an authentic entry at
    another position counts once; the positions a forger drew stay drawn (a counter)."""
    auth, raw = stores
    prefix = "/r0/node/"
    assert auth.register(prefix, "a", b'{"node_id": "a"}') == 1
    assert raw.register(prefix, "rogue", b'{"node_id": "rogue"}') == 2
    copy = raw.entries(prefix, 1, 1.0)[0]
    raw.register(prefix, "copy", copy)  # an authentic entry, under another name/position
    assert auth.register(prefix, "b", b'{"node_id": "b"}') == 4
    assert auth.count(prefix) == 4
    assert auth.entries(prefix, 4, 2.0) == [b'{"node_id": "a"}', b'{"node_id": "b"}']
    assert auth.register(prefix, "a", b"again") == 1  # idempotent as before


def test_secret_sources_and_refusals(tmp_path):
    good = tmp_path / "secret"
    good.write_bytes(SECRET + b"\n")
    good.chmod(0o600)
    assert load_secret({"secret_file": str(good)}, environ={}) == SECRET
    assert load_secret({}, environ={"MESHRUN_RDZV_SECRET": SECRET.decode()}) == SECRET
    assert load_secret({}, environ={}) is None
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    empty.chmod(0o600)
    loose = tmp_path / "loose"
    loose.write_bytes(SECRET)
    loose.chmod(0o644)
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    cases = {
        str(tmp_path / "missing"): "no such file",
        str(empty): "the secret is empty",
        str(loose): "chmod 600",
        str(short): "shorter than 16 bytes",
        str(tmp_path): "not a regular file",
    }
    for path, problem in cases.items():
        with pytest.raises(ValueError, match=problem) as info:
            load_secret({"secret_file": path}, environ={})
        assert "\n" not in str(info.value)
    if os.geteuid() != 0:
        unreadable = tmp_path / "unreadable"
        unreadable.write_bytes(SECRET)
        unreadable.chmod(0o000)
        with pytest.raises(ValueError, match="cannot read it"):
            load_secret({"secret_file": str(unreadable)}, environ={})
    with pytest.raises(ValueError, match="secret_file=PATH") as info:
        settings_from_conf({"secret": "hunter2"}, run_id="j", min_nodes=1, max_nodes=2,
                           max_restarts=0)  # fmt: skip
    assert "hunter2" not in str(info.value)


def test_a_sealed_value_read_without_the_secret_names_the_secret():
    """A node (or meshrun status) without the job's secret reads sealed values: one line that
    says to give it the secret, not "malformed ... another program"."""
    import pytest as _pytest

    from meshrun.rendezvous import MemoryStore, RendezvousError
    from meshrun.rendezvous.api import NodeDesc, decode_json, decode_members, encode_members
    from meshrun.rendezvous.auth import AuthenticatedStore

    inner = MemoryStore()
    AuthenticatedStore(inner, b"s3cret-0f-the-j0b-123456", "job").set_once("k", b'{"a": 1}')
    with _pytest.raises(RendezvousError, match="sealed with the job's shared secret.*secret_file"):
        decode_json(inner.get("k").value, "the job's state")
    members = encode_members([NodeDesc(node_id="a:1:x", addr="10.0.0.1", nproc=8)])
    AuthenticatedStore(inner, b"s3cret-0f-the-j0b-123456", "job").set_once("m", members)
    with _pytest.raises(RendezvousError, match="sealed with the job's shared secret.*secret_file"):
        decode_members(inner.get("m").value)
