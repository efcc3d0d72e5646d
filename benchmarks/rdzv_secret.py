"""The cost of the rendezvous shared secret (meshrun.rendezvous.auth): plain vs sealed.

    .venv/bin/python benchmarks/rdzv_secret.py [--ops 2000] [--nodes 4] [--rounds 3]

(1) Store operations on a real c10d TCPStore hosted in this process (127.0.0.1), one client:
    write-once of a fresh key and a read, per operation, plain and sealed, interleaved in
    blocks of 100; medians of the blocks. (2) Rendezvous rounds of N agents (threads, one
    client each) on the same kind of store: next_round + exit barrier, plain and sealed, with
    the number of values sealed and opened per round and the bytes they add.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from meshrun.rendezvous import NodeDesc, Rendezvous, RendezvousSettings  # noqa: E402
from meshrun.rendezvous.auth import HEADER_BYTES, AuthenticatedStore  # noqa: E402
from meshrun.rendezvous.c10d import TCPStoreBackend  # noqa: E402

SECRET = os.urandom(32)


class Counted(AuthenticatedStore):
    sealed = opened = 0

    def seal(self, key, value):
        Counted.sealed += 1
        return super().seal(key, value)

    def open(self, key, raw):
        Counted.opened += 1
        return super().open(key, raw)

    def _seal_entry(self, prefix, name, value):
        Counted.sealed += 1
        return super()._seal_entry(prefix, name, value)

    def _open_entry(self, prefix, raw):
        Counted.opened += 1
        return super()._open_entry(prefix, raw)


def store_ops(host: TCPStoreBackend, ops: int) -> dict[str, float]:
    client = TCPStoreBackend("127.0.0.1", host.port, is_host=False, timeout=10)
    stores = {"plain": client, "sealed": AuthenticatedStore(client, SECRET, "bench")}
    blocks: dict[str, list[float]] = {name: [] for name in stores}
    value = b'{"addr": "10.0.0.1", "node_id": "host:1234:abcdef", "nproc": 8}'
    for block in range(ops // 100):
        for name, store in stores.items():
            start = time.perf_counter()
            for i in range(100):
                key = f"/b/{name}/{block}/{i}"
                store.set_once(key, value)
                store.get(key)
            blocks[name].append((time.perf_counter() - start) / 100)
    return {name: statistics.median(times) for name, times in blocks.items()}


def one_round(port: int, n: int, sealed: bool) -> float:
    run_id = uuid.uuid4().hex[:8]
    settings = RendezvousSettings(run_id=run_id, min_nodes=n, max_nodes=n, last_call_timeout=0.1,
                                  join_timeout=60, read_timeout=10)  # fmt: skip
    nodes = []
    for i in range(n):
        store = TCPStoreBackend("127.0.0.1", port, is_host=False, timeout=10)
        if sealed:
            store = Counted(store, SECRET, run_id)
        me = NodeDesc(f"n{i}:{uuid.uuid4().hex[:6]}", "127.0.0.1", 1)
        nodes.append(Rendezvous(store, settings, me, host_bootstrap=lambda: ("127.0.0.1", 1)))
    start = time.perf_counter()
    threads = [threading.Thread(target=lambda r=r: (r.next_round(), r.exit_barrier(0.05)))
               for r in nodes]  # fmt: skip
    [t.start() for t in threads]
    [t.join() for t in threads]
    elapsed = time.perf_counter() - start
    for r in nodes:
        r.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"$ {' '.join(sys.argv)}\nload average: {os.getloadavg()[0]:.2f}")
    host = TCPStoreBackend("127.0.0.1", 0, is_host=True, timeout=10)
    per_op = store_ops(host, args.ops)
    print("\n| c10d TCPStore, per write-once + read | plain | sealed | ratio |\n|---|---|---|---|")
    print(f"| time | {per_op['plain'] * 1e6:.0f} us | {per_op['sealed'] * 1e6:.0f} us | "
          f"{per_op['sealed'] / per_op['plain']:.2f}x |")  # fmt: skip
    print(f"| bytes added per value | 0 | {HEADER_BYTES} | |")
    auth = AuthenticatedStore(host, SECRET, "bench")
    value = b"x" * 200
    start = time.perf_counter()
    for _ in range(20000):
        auth.open("/meshrun/bench/r1/closed", auth.seal("/meshrun/bench/r1/closed", value))
    cpu = (time.perf_counter() - start) / 20000
    print(f"| HMAC alone: seal + check of a 200-byte value | | {cpu * 1e6:.1f} us | |")
    times = {"plain": [], "sealed": []}
    for _ in range(args.rounds):
        for name in times:
            times[name].append(one_round(host.port, args.nodes, name == "sealed"))
    plain, sealed = statistics.median(times["plain"]), statistics.median(times["sealed"])
    per_node_round = args.rounds * args.nodes
    print(f"\n| {args.nodes} agents, one round + exit barrier | plain | sealed | ratio |")
    print("|---|---|---|---|")
    print(f"| time (median of {args.rounds}) | {plain * 1e3:.1f} ms | {sealed * 1e3:.1f} ms | "
          f"{sealed / plain:.2f}x |")  # fmt: skip
    print(f"| values sealed per agent per round | | {Counted.sealed / per_node_round:.1f} | |")
    print(f"| values checked per agent per round | | {Counted.opened / per_node_round:.1f} | |")
    print(f"| bytes added per agent per round | | "
          f"{Counted.sealed / per_node_round * HEADER_BYTES:.0f} | |")  # fmt: skip
    host.close()
    os._exit(0)


if __name__ == "__main__":
    main()
