"""The store contract (meshrun.rendezvous.store.Store), one suite for every backend."""

import threading
import time

import pytest

pytestmark = pytest.mark.timeout(30)


def test_get_absent_and_set_once(store_pair):
    store, _ = store_pair
    assert store.get("/k") is None
    first = store.set_once("/k", b"a")
    assert first.value == b"a" and first.version >= 1
    again = store.set_once("/k", b"b")  # the earlier writer wins
    assert again.value == b"a"
    assert store.get("/k").value == b"a"


def test_compare_and_set_versions(store_pair):
    store, _ = store_pair
    ok, v1 = store.compare_and_set("/s", 0, b"one")
    assert ok and v1.value == b"one"
    ok, current = store.compare_and_set("/s", 0, b"other")  # no longer absent
    assert not ok and current.value == b"one"
    ok, v2 = store.compare_and_set("/s", v1.version, b"two")
    assert ok and v2.version > v1.version
    ok, current = store.compare_and_set("/s", v1.version, b"stale")  # stale version loses
    assert not ok and current.value == b"two"
    assert store.get("/s") == v2


def test_compare_and_set_race_has_one_winner(store_pair):
    store, connect = store_pair
    clients = [connect() for _ in range(4)]
    wins = []

    def contend(client, name):
        ok, _ = client.compare_and_set("/race", 0, name.encode())
        if ok:
            wins.append(name)

    threads = [threading.Thread(target=contend, args=(c, f"n{i}")) for i, c in enumerate(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(wins) == 1
    assert store.get("/race").value == wins[0].encode()


def test_add_counts(store_pair):
    store, connect = store_pair
    other = connect()
    assert store.add("/c", 0) == 0
    assert store.add("/c", 1) == 1
    assert other.add("/c", 2) == 3
    assert store.add("/c", 0) == 3


def test_get_many(store_pair):
    store, _ = store_pair
    store.set_once("/m/1", b"x")
    store.set_once("/m/2", b"y")
    values = store.get_many(["/m/1", "/m/2"])
    assert [v.value for v in values] == [b"x", b"y"]
    assert store.get_many(["/m/1", "/m/none"])[1] is None


def test_wait_for_change_wakes_on_write(store_pair):
    store, connect = store_pair
    writer = connect()
    threading.Timer(0.2, lambda: writer.set_once("/w", b"here")).start()
    start = time.monotonic()
    item = store.wait_for_change("/w", 0, timeout=5)
    assert item is not None and item.value == b"here"
    assert time.monotonic() - start < 3


def test_wait_for_change_past_a_version(store_pair):
    store, connect = store_pair
    writer = connect()
    _, v1 = store.compare_and_set("/v", 0, b"1")
    threading.Timer(0.2, lambda: writer.compare_and_set("/v", v1.version, b"2")).start()
    item = store.wait_for_change("/v", v1.version, timeout=5)
    assert item.value == b"2"


def test_wait_for_change_times_out_with_current_value(store_pair):
    store, _ = store_pair
    _, v1 = store.compare_and_set("/t", 0, b"same")
    start = time.monotonic()
    item = store.wait_for_change("/t", v1.version, timeout=0.3)
    assert item == v1
    assert 0.25 <= time.monotonic() - start < 3
    assert store.wait_for_change("/absent", 0, timeout=0.1) is None


def test_liveness_sees_a_silent_node_die(store_pair):
    store, _ = store_pair
    a = store.liveness("a", dead_after=0.4)
    b = store.liveness("b", dead_after=0.4)
    a.beat()
    assert b.is_alive("a")
    for _ in range(3):
        time.sleep(0.15)
        a.beat()
        assert b.is_alive("a")
    time.sleep(0.6)  # a stops beating
    assert not b.is_alive("a")


def test_a_joiner_that_never_beats_is_alive_for_dead_after_then_lost(store_pair):
    """A node that joined (`Liveness.joining`: marked where the store marks joiners) is not
    beating yet: the others see it alive for ``joining_grace`` from their first look (it may
    not be a member of a round yet), then lost for good if it never beats; one that starts
    beating is alive past that."""
    store, connect = store_pair
    dead_after = 2.0 if type(store).__name__ == "EtcdStore" else 0.4  # etcd's minimum TTL
    joiner, member = connect().liveness("j", dead_after), connect().liveness("m", dead_after)
    joiner.joining()
    member.joining()
    watcher = store.liveness("w", dead_after)
    grace = watcher.joining_grace
    assert dead_after <= grace <= 10
    start = time.monotonic()
    assert watcher.is_alive("j") and watcher.is_alive("m")
    member.beat()
    while time.monotonic() - start < 0.5 * grace:
        assert watcher.is_alive("j") and watcher.is_alive("m")
        member.beat()
        time.sleep(dead_after / 8)
    while time.monotonic() - start < grace + dead_after / 2:
        member.beat()
        time.sleep(dead_after / 8)
    assert not watcher.is_alive("j")
    assert watcher.is_alive("m")
    time.sleep(dead_after / 4)
    assert not watcher.is_alive("j")  # asking again gives no second grace


def test_register_orders_entries_and_counts_a_name_once(store_pair):
    store, connect = store_pair
    other = connect()
    assert store.count("/j/") == 0
    assert store.register("/j/", "a", b"A") == 1
    assert other.register("/j/", "b", b"B") == 2
    assert store.register("/j/", "a", b"again") == 1  # a retry: nothing new
    assert other.register("/j/", "c", b"C") == 3
    assert store.count("/j/") == other.count("/j/") == 3
    assert store.entries("/j/", 2, timeout=1) == [b"A", b"B"]
    assert other.entries("/j/", 3, timeout=1) == [b"A", b"B", b"C"]
    assert store.count("/other/") == 0


def test_register_race_gives_dense_distinct_positions(store_pair):
    store, connect = store_pair
    clients = [connect() for _ in range(4)]
    positions = {}

    def join(client, name):
        for k in range(3):
            positions[f"{name}-{k}"] = client.register("/race/", f"{name}-{k}", name.encode())

    threads = [threading.Thread(target=join, args=(c, f"n{i}")) for i, c in enumerate(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(positions.values()) == list(range(1, 13))
    assert store.count("/race/") == 12
    names = [name for name, _ in sorted(positions.items(), key=lambda kv: kv[1])]
    assert store.entries("/race/", 12, timeout=1) == [n.split("-")[0].encode() for n in names]


def test_delete_prefix_deletes_only_under_the_prefix(store_pair):
    store, _ = store_pair
    store.set_once("/d/r1/x", b"1")
    store.register("/d/r1/node/", "a", b"A")
    store.set_once("/d/r10/x", b"1")
    store.delete_prefix("/d/r1/")
    assert store.get("/d/r1/x") is None and store.count("/d/r1/node/") == 0
    assert store.get("/d/r10/x").value == b"1"
