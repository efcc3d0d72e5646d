"""Rendezvous benchmark: meshrun's protocol against torch's dynamic rendezvous, in the same run.

    python benchmarks/rendezvous.py                       # all three parts, N = 8 64 256 1024
    python benchmarks/rendezvous.py --parts 1 --sizes 8,64 --cap 60
    python benchmarks/rendezvous.py --parts 3 --repeats 5
    python benchmarks/rendezvous.py --parts 1,2 --impls meshrun,etcd   # TCPStore vs etcd only

Three parts, each printed as a markdown table with meshrun, torch and their ratio:

1. Time to rank: N simulated agents (threads that only run the rendezvous, no workers) against
   one TCPStore hosted in its own process; the time from "go" (every client connected) until
   every agent has its node rank, and the store operations per agent. meshrun: each agent is a
   ``Rendezvous`` over its own ``TCPStoreBackend`` client wrapped in a ``CountingStore``
   (``next_round``); torch: ``DynamicRendezvousHandler.from_backend`` over a
   ``C10dRendezvousBackend`` with its own ``TCPStore`` client (``next_rendezvous``). Every
   (implementation, N) case runs in fresh processes, killed at ``--cap`` seconds; once torch
   misses the cap, larger N are not run for it (``--torch-all`` runs them anyway).
   etcd (``--impls`` includes ``etcd``, the default): the same meshrun ``Rendezvous`` over an
   ``EtcdStore`` (etcd v3 through its JSON gateway, one HTTP request per store call), counted
   the same way, against one real etcd member that this run starts on free ports with a temp
   data dir and stops by PID at the end (also on error); its agents are spread over
   ``--procs`` processes like meshrun's, and the same ``--cap`` applies.
2. Dead-node detection at default settings: two agents complete a round, one (a subprocess) is
   killed with SIGKILL, the survivor polls every 0.1 s. meshrun: until ``poll()`` returns a
   reason containing "lost". torch: until the dead node is dropped from the rendezvous state
   the survivor syncs (torch has no public "node lost" signal; its agent learns of a dead node
   from its workers' collectives failing, or at the next rendezvous). meshrun on etcd:
   ``poll()`` as for meshrun; the dead node's liveness key is bound to a lease (TTL 3 s at the
   defaults) that etcd expires.
3. A real two-agent launch on 127.0.0.1: ``meshrun`` vs ``torchrun``, ``--nnodes 2
   --nproc-per-node 1 --rdzv-backend c10d``, one gloo worker each (``_rdzv_worker.py``); time
   from starting both agents to both workers' line after ``init_process_group`` + all_reduce.
   Repeats interleaved; medians reported.

Helpers: ``_rdzv_children.py`` (the store host, agent-thread groups, the killed agent) and
``_rdzv_worker.py`` (the gloo worker). etcd is found on PATH or at /usr/bin/etcd (``--etcd``);
without it the etcd side is reported as not run.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import queue
import random
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILDREN = HERE / "_rdzv_children.py"
WORKER = HERE / "_rdzv_worker.py"
PY = sys.executable

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64,256,1024", help="N for part 1, comma-separated")
    p.add_argument("--cap", type=float, default=120.0, help="seconds per (implementation, N)")
    p.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 1,3")
    p.add_argument(
        "--procs",
        type=int,
        default=4,
        help="processes meshrun's agent threads (on TCPStore and on etcd) are spread "
        "over in part 1 (1024 threads plus their 1024 heartbeat threads in one process spend the "
        "run in GIL hand-offs on 2 cores); torch's run in one process, as "
        "measured before",
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats for parts 2 and 3")
    p.add_argument(
        "--torch-all",
        action="store_true",
        help="run torch (and etcd) at every N even after it missed the cap at a smaller N",
    )
    p.add_argument(
        "--impls",
        default="meshrun,etcd,torch",
        help="parts 1 and 2: which sides to run (meshrun: on a TCPStore; etcd: meshrun on etcd)",
    )
    p.add_argument(
        "--etcd",
        default=None,
        help="the etcd binary (default: etcd on PATH, else /usr/bin/etcd)",
    )
    p.add_argument(
        "--etcd-max-txn-ops",
        type=int,
        default=None,
        help="etcd's --max-txn-ops (default: etcd's own, 128). meshrun's EtcdStore splits "
        "multi-key reads into transactions of at most 128; a round's joiners are one range",
    )
    p.add_argument(
        "--connect-in-round",
        action="store_true",
        help="part 1: let meshrun open each heartbeat connection inside next_round "
        "(as the agent does) instead of before the clock starts",
    )
    p.add_argument(
        "--no-torch-dead",
        action="store_true",
        help="part 2: print torch's documented default instead of measuring it",
    )
    p.add_argument(
        "--res-options",
        default="timeout:1 attempts:1",
        help="RES_OPTIONS (glibc resolver) for this run and its children; '' keeps "
        "the environment's. On the sandbox this was written on, torch's "
        "TCPStore client sometimes makes a reverse-DNS lookup on connect that "
        "waits out the resolver's 5 s timeout; every address here is 127.0.0.1",
    )
    a = p.parse_args()
    if a.res_options:
        os.environ["RES_OPTIONS"] = a.res_options
    sizes = [int(s) for s in a.sizes.split(",") if s]
    parts = {int(s) for s in a.parts.split(",") if s}
    impls = [s.strip() for s in a.impls.split(",") if s.strip()]
    unknown = set(impls) - {"meshrun", "etcd", "torch"}
    if unknown:
        p.error(f"--impls: unknown {', '.join(sorted(unknown))} (meshrun, etcd, torch)")
    # SIGTERM (a timeout, a CI cancel) unwinds through the finally below: etcd and every child
    # process this run started are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run(a, sizes, parts, impls)
    finally:
        if _ETCD[0] is not None:
            _ETCD[0].stop()


_ETCD: list = [None]  # the run's etcd server, stopped by main() whatever happens


def run(a: argparse.Namespace, sizes: list[int], parts: set[int], impls: list[str]) -> None:
    print("# Rendezvous: meshrun vs torch\n")
    print("command: `" + shlex.join(["python", *sys.argv]) + "`\n")
    print(
        f"machine: {os.cpu_count()} CPUs (nproc), {machine_line()}, load average "
        f"{load()} at start\n"
    )
    if a.res_options:
        print(
            f"resolver: RES_OPTIONS='{a.res_options}' for every process of this run (see "
            "--res-options)\n"
        )
    endpoint = ""
    if "etcd" in impls and parts & {1, 2}:
        binary = (
            a.etcd
            or shutil.which("etcd")
            or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
        )
        if binary is None:
            print("etcd: not run (no etcd binary on PATH or at /usr/bin/etcd; see --etcd)\n")
            impls = [i for i in impls if i != "etcd"]
        else:
            raise_fd_limit()  # etcd inherits it: 3 connections per agent at N=1024
            extra = []
            if a.etcd_max_txn_ops:
                extra = ["--max-txn-ops", str(a.etcd_max_txn_ops)]
            _ETCD[0] = server = EtcdServer(binary, extra)
            server.start()
            endpoint = server.endpoint
            print(
                f"etcd: {server.version}, one member on {server.endpoint} started by this run "
                f"(data dir {server.data_dir}, {fs_type(server.data_dir)}; default heartbeat "
                "100 ms / election 1000 ms, default fsync"
                + (f", {' '.join(server.extra)}" if server.extra else ", max-txn-ops 128 (default)")
                + "), reached through its v3 JSON gateway with urllib3\n",
                flush=True,
            )
    if 1 in parts:
        part_time_to_rank(sizes, a.cap, a.procs, a.torch_all, impls, a.connect_in_round, endpoint)
    if 2 in parts:
        part_dead_node(a.repeats, measure_torch=not a.no_torch_dead, impls=impls, endpoint=endpoint)
    if 3 in parts:
        part_launch(a.repeats)
    print(f"load average at end: {load()}")


# -- part 1 ---------------------------------------------------------------------------------------


def part_time_to_rank(
    sizes: list[int],
    cap: float,
    procs: int,
    torch_all: bool,
    impls: list[str],
    connect_in_round: bool,
    etcd_endpoint: str = "",
) -> None:
    with_etcd = "etcd" in impls
    print(
        "## 1. Time to rank, N agents (threads) on one TCPStore"
        + (" and on one etcd" if with_etcd else "")
        + "\n"
    )
    capped_at: dict[str, int] = {}  # torch, etcd: the N where the cap was first missed
    rows = []
    for n in sizes:
        m = (
            time_to_rank("meshrun", n, cap, procs, connect_in_round)
            if "meshrun" in impls
            else {"skipped": "not run"}
        )
        e = {"skipped": "not run"}
        if with_etcd:
            if "etcd" in capped_at and not torch_all:
                e = {"skipped": f"not run (missed the cap at N={capped_at['etcd']})"}
            else:
                e = time_to_rank("etcd", n, cap, procs, etcd_endpoint=etcd_endpoint)
                if "time" not in e:
                    capped_at["etcd"] = n
        if "torch" not in impls:
            t = {"skipped": "not run"}
        elif "torch" in capped_at and not torch_all:
            t = {"skipped": f"not run (missed the cap at N={capped_at['torch']})"}
        else:
            t = time_to_rank("torch", n, cap, 1)
            if "time" not in t:
                capped_at["torch"] = n
        rows.append((n, m, e, t))
        print(
            f"<!-- N={n}: meshrun {summary(m)}; "
            + (f"etcd {summary(e)}; " if with_etcd else "")
            + f"torch {summary(t)}; load {load()} -->",
            flush=True,
        )
    print()
    if with_etcd:
        print(
            "| N | meshrun on TCPStore: time to rank | meshrun on etcd: time to rank "
            "| torch time to rank | torch / meshrun (TCPStore) | etcd / TCPStore (meshrun) "
            "| meshrun ops/agent: protocol (mean / max) | + heartbeat ops/agent | meshrun "
            "TCPStore calls/agent | torch store ops/agent (mean / max) | torch state bytes/agent "
            "| etcd: protocol ops/agent (mean / max) | etcd: + heartbeat ops/agent "
            "| etcd: HTTP requests/agent, protocol (mean, max) + heartbeat | etcd: CPU s in the window, "
            "etcd server / agent processes |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    else:
        print(
            "| N | meshrun time to rank | torch time to rank | torch / meshrun "
            "| meshrun ops/agent: protocol (mean / max) | + heartbeat ops/agent | meshrun "
            "TCPStore calls/agent | torch store ops/agent (mean / max) | torch state bytes/agent |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, m, e, t in rows:
        if with_etcd:
            print(
                f"| {n} | {cell_time(m)} | {cell_time(e)} | {cell_time(t)} | {ratio(t, m)} "
                f"| {ratio(e, m)} "
                f"| {cell_ops(m, 'ops')} | {cell_mean(m, 'beat_ops')} "
                f"| {cell_mean(m, 'tcp_calls')} | {cell_ops(t, 'ops')} "
                f"| {cell_bytes(t)} "
                f"| {cell_ops(e, 'ops')} | {cell_mean(e, 'beat_ops')} "
                f"| {cell_http(e)} | {cell_cpu(e)} |"
            )
        else:
            print(
                f"| {n} | {cell_time(m)} | {cell_time(t)} | {ratio(t, m)} "
                f"| {cell_ops(m, 'ops')} | {cell_mean(m, 'beat_ops')} "
                f"| {cell_mean(m, 'tcp_calls')} | {cell_ops(t, 'ops')} "
                f"| {cell_bytes(t)} |"
            )
    print()
    note = (
        f"meshrun agents spread over {procs} processes; "
        if procs > 1
        else "meshrun agents: threads in one process; "
    )
    print(
        f"Notes: {note}torch agents: threads in one process; the store is hosted in its own "
        "process for both. Time from 'go' (all clients connected, all threads started) to "
        "the last agent's node rank. meshrun protocol ops are `CountingStore` contract "
        "operations inside `next_round` (heartbeat-thread beats counted apart: they grow with "
        "elapsed time, 2/s, not with N); TCPStore calls are the raw client calls of the "
        "protocol (a versioned get is check+get). torch ops are `C10dRendezvousBackend` "
        "store calls; its state is one pickled blob of every node, rewritten by each.\n"
    )
    if with_etcd:
        print(
            "etcd: the same meshrun `Rendezvous` and counting, over an `EtcdStore` (etcd v3 "
            "JSON gateway, urllib3) per agent, against the one etcd member of this run; agents "
            f"spread over {procs} processes like meshrun's on TCPStore, a fresh run id (key "
            "prefix) per case. Each agent holds three HTTP connections: the store's (opened "
            "and the job lease joined before 'go'), the heartbeat's (opened inside "
            "`next_round`, as in the agent: one put that marks the node as joining, bound to "
            "the job lease; once the node is a member, a lease grant + put, then a lease "
            "keep-alive every TTL/3 = 1 s and a watch on its neighbour's key) and the "
            "job-lease refresher's "
            "(a keep-alive every 10/3 s, not counted). HTTP requests: every POST of the "
            "protocol (a watch is one streaming POST; a compare-and-set is one transaction; a "
            "join is one transaction that creates the node's own key and counts the round's), "
            "then the heartbeat's. The agents' "
            "read_timeout is the case's timeout, as for the TCPStore clients; the job lease "
            "TTL is the default's 10 s. CPU: user+system seconds of the etcd process and of "
            "the agent processes between 'go' and the last node rank (or the cap), from "
            "/proc.\n",
            flush=True,
        )


def ratio(slow: dict, fast: dict) -> str:
    """``slow / fast`` as "2.3x"; "> 40x" when ``slow`` missed the cap; "-" otherwise."""
    if "time" in fast and "time" in slow:
        return f"{slow['time'] / fast['time']:.1f}x"
    if "time" in fast and "cap_lower" in slow:
        return f"> {slow['cap_lower'] / fast['time']:.0f}x"
    return "-"


def time_to_rank(
    impl: str,
    n: int,
    cap: float,
    procs: int,
    connect_in_round: bool = False,
    etcd_endpoint: str = "",
) -> dict:
    """Run one (implementation, N) case in fresh processes; see the module docstring."""
    run_id = f"bench-{impl}-{n}-{uuid.uuid4().hex[:6]}"
    timeout = cap + 30
    children: list[Child] = []
    try:
        if impl == "etcd":  # the store is the run's etcd server
            port = 0
            store_args = ["--endpoint", etcd_endpoint]
        else:
            host = Child(
                [PY, str(CHILDREN), "store-host", "--impl", impl, "--timeout", str(timeout)]
            )
            children.append(host)
            port = int(host.expect("PORT", 60)[1])
            store_args = []
        groups = []
        merged: queue.Queue = queue.Queue()  # every group's lines, in arrival order
        per = -(-n // procs)
        for first in range(0, n, per):
            count = min(per, n - first)
            g = Child(
                [
                    PY,
                    str(CHILDREN),
                    "agents",
                    "--impl",
                    impl,
                    "--port",
                    str(port),
                    "--run-id",
                    run_id,
                    "--n",
                    str(n),
                    "--first",
                    str(first),
                    "--count",
                    str(count),
                    "--timeout",
                    str(timeout),
                ]
                + store_args
                + (["--connect-in-round"] if connect_in_round else []),
                lines=merged,
            )
            children.append(g)
            groups.append(g)
        setup_deadline = time.monotonic() + 300
        try:
            for _ in groups:
                groups[0].expect("READY", setup_deadline - time.monotonic())
        except RuntimeError as e:
            dead = [g for g in groups if g.proc.poll() is not None]
            return {"error": f"setup: {e}" + (dead[0].exit_reason() if dead else "")}
        etcd_pid = _ETCD[0].proc.pid if impl == "etcd" and _ETCD[0] is not None else None
        cpu0 = cpu_split(etcd_pid, groups) if etcd_pid else None
        t0 = time.time()
        for g in groups:
            g.send("GO")
        deadline = time.monotonic() + cap
        ranked: dict[int, list[str]] = {}
        errors: list[str] = []
        while len(ranked) + len(errors) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                line = merged.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                errors.append("an agent process exited early")
                break
            parts = line.split()
            if parts[0] == "RANKED":
                ranked[int(parts[1])] = parts[2:]
            elif parts[0] == "ERROR":
                errors.append(line)
        cpu = None
        if cpu0 is not None:
            cpu1 = cpu_split(etcd_pid, groups)
            cpu = (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])
        if errors:
            return {"error": errors[0], "ranked": len(ranked)}
        if len(ranked) < n:
            out = {"cap_lower": cap, "ranked": len(ranked), "cap": cap}
            if cpu is not None:
                out["cpu"] = cpu
            if impl == "etcd":
                out["why"] = _job_state(etcd_endpoint, run_id)
            return out
        ranks = sorted(int(v[0]) for v in ranked.values())
        if ranks != list(range(n)):
            return {"error": f"node ranks are not 0..N-1: {ranks[:10]}..."}
        done = sorted(float(v[1]) - t0 for v in ranked.values())
        out = {"time": done[-1], "first": done[0], "median": done[len(done) // 2]}
        meshrun_like = impl in ("meshrun", "etcd")  # meshrun's protocol, counted the same way
        cols = ["ops", "beat_ops", "tcp_calls"] if meshrun_like else ["ops", "nbytes"]
        for j, col in enumerate(cols):
            vals = [int(v[2 + j]) for v in ranked.values()]
            out[col] = (statistics.mean(vals), max(vals))
        if meshrun_like:  # phases: last join number drawn, first agent to see the close
            out["last_join"] = max(float(v[5]) for v in ranked.values()) - t0
            out["first_closed"] = min(float(v[6]) for v in ranked.values()) - t0
        if impl == "etcd":
            vals = [int(v[7]) for v in ranked.values()]
            out["beat_http"] = (statistics.mean(vals), max(vals))
            out["cpu"] = cpu
        if meshrun_like:
            for g in groups:
                g.send("EXIT")
            for g in groups:
                g.wait(20)
        return out
    finally:
        for c in reversed(children):
            c.kill()


def cpu_split(etcd_pid: int, groups: list[Child]) -> tuple[float, float]:
    """(CPU seconds of the etcd process, of the agent processes) so far."""
    return cpu_seconds(etcd_pid), sum(cpu_seconds(g.proc.pid) for g in groups)


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a live process (every thread), from /proc; 0 when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(r: dict) -> str:
    out = cell_time(r)
    if "last_join" in r:
        out += (
            f" (phases: last join at {r['last_join']:.2f} s, round closed by "
            f"{r['first_closed']:.2f} s, first ranked {r['first']:.2f} s, median "
            f"{r['median']:.2f} s)"
        )
    elif "first" in r:
        out += f" (first agent ranked at {r['first']:.2f} s, median {r['median']:.2f} s)"
    out += f", ops/agent {r['ops'][0]:.1f}" if "ops" in r else ""
    if "beat_http" in r:
        out += f", HTTP requests/agent {cell_http(r)}"
    if r.get("cpu"):
        out += f", CPU s etcd / agents {cell_cpu(r)}"
    return out


def _job_state(endpoint: str, run_id: str) -> str:
    """The job's state record on etcd, read after a round that did not finish: its round and
    reason say whether the agents started another round (a node seen lost) or still wait."""
    from meshrun.rendezvous.etcd_gateway import EtcdOptions, Gateway, b64, unb64
    from meshrun.rendezvous.protocol import job_prefix, state_key

    gw = Gateway(EtcdOptions.from_conf(endpoint, {}, 10.0))
    try:
        kvs = gw.call("kv/range", {"key": b64(state_key(job_prefix(run_id)))}).get("kvs")
        return unb64(kvs[0]["value"]).decode(errors="replace") if kvs else "no state key"
    except Exception as e:  # noqa: BLE001 - a diagnostic, never the benchmark's failure
        return f"state not read: {e}"
    finally:
        gw.close()


def cell_time(r: dict) -> str:
    if "time" in r:
        return f"{r['time']:.2f} s"
    if "cap" in r:
        why = f"; job state then: {r['why']}" if r.get("why") else ""
        return f"did not finish in {r['cap']:g} s ({r['ranked']} ranked{why})"
    if "skipped" in r:
        return r["skipped"]
    return f"failed: {r.get('error', '?')}"


def cell_ops(r: dict, col: str) -> str:
    return f"{r[col][0]:.1f} / {r[col][1]}" if col in r else "-"


def cell_mean(r: dict, col: str) -> str:
    return f"{r[col][0]:.1f}" if col in r else "-"


def cell_bytes(r: dict) -> str:
    if "nbytes" not in r:
        return "-"
    b = r["nbytes"][0]
    return f"{b / 1e6:.1f} MB" if b >= 1e6 else f"{b / 1e3:.0f} kB"


def cell_http(r: dict) -> str:
    if "tcp_calls" not in r or "beat_http" not in r:
        return "-"
    return f"{r['tcp_calls'][0]:.1f} (max {r['tcp_calls'][1]}) + {r['beat_http'][0]:.1f}"


def cell_cpu(r: dict) -> str:
    if not r.get("cpu"):
        return "-"
    return f"{r['cpu'][0]:.1f} / {r['cpu'][1]:.1f}"


# -- part 2 ---------------------------------------------------------------------------------------


def part_dead_node(
    repeats: int,
    measure_torch: bool,
    impls: tuple[str, ...] | list[str] = ("meshrun", "torch"),
    endpoint: str = "",
) -> None:
    with_etcd = "etcd" in impls
    print("## 2. Dead-node detection, 2 agents, default settings, kill -9 of one\n", flush=True)
    mesh = [dead_node_once("meshrun") for _ in range(repeats)] if "meshrun" in impls else []
    on_etcd = [dead_node_once("etcd", endpoint) for _ in range(repeats)] if with_etcd else []
    torch_times = (
        [dead_node_once("torch") for _ in range(repeats)]
        if measure_torch and "torch" in impls
        else []
    )
    m = statistics.median(mesh) if mesh else None
    print("| | detection time (median) | runs | settings |")
    print("|---|---:|---|---|")
    if mesh:
        print(
            f"| {'meshrun on TCPStore' if with_etcd else 'meshrun'} | {m:.2f} s "
            f"| {', '.join(f'{x:.2f}' for x in mesh)} "
            "| keep_alive_interval 0.5 s x 5 attempts |"
        )
    if on_etcd:
        e = statistics.median(on_etcd)
        print(
            f"| meshrun on etcd | {e:.2f} s | {', '.join(f'{x:.2f}' for x in on_etcd)} "
            "| keep_alive_interval 0.5 s x 5 attempts: lease TTL 3 s, kept alive every TTL/3 |"
        )
        if m:
            print(f"| etcd / TCPStore (meshrun) | {e / m:.1f}x | | |")
    if "torch" not in impls:
        pass
    elif torch_times:
        t = statistics.median(torch_times)
        print(
            f"| torch | {t:.2f} s | {', '.join(f'{x:.2f}' for x in torch_times)} "
            "| keep_alive_interval 5 s x 3 attempts |"
        )
        if m:
            print(f"| torch / meshrun | {t / m:.1f}x | | |")
    else:
        print(
            "| torch | <= 15 s after its last beat (documented 5 s x 3, not measured) | | 5 s x 3 attempts |"
        )
        if m:
            print(f"| torch / meshrun | ~{15 / m:.0f}x (documented, not measured) | | |")
    print()
    print(
        "Notes: time from SIGKILL of the non-hosting agent to detection on the survivor, "
        "which polls every 0.1 s; the kill lands at a random phase of the heartbeat. meshrun: "
        '`Rendezvous.poll()` returns a reason with "lost". torch: measured through its '
        "private state (`_state_holder.sync()`, as `num_nodes_waiting()` does) until the dead "
        "node is dropped from the participants; torch has no public lost-node signal, so in "
        "torchrun a dead node surfaces through failing collectives or the next "
        "rendezvous.\n",
        flush=True,
    )
    if with_etcd:
        print(
            "meshrun on etcd: both agents on the run's etcd member (`open_etcd_store`, default "
            "settings); the victim's liveness key is bound to a lease of TTL ceil(0.5 s x 5) = "
            "3 s that it kept alive every TTL/3 = 1 s, so etcd deletes the key 2-3 s after the "
            "victim's death (its lessor looks for expired leases every 0.5 s); the survivor "
            "watches the key and sees the DELETE at once, its heartbeat (every 0.5 s) tells "
            '`poll()`, which reports "lost". The median of the runs.\n',
            flush=True,
        )


def dead_node_once(impl: str, endpoint: str = "") -> float:
    sys.path.insert(0, str(HERE))
    import _rdzv_children as kids

    run_id = f"dead-{impl}-{uuid.uuid4().hex[:6]}"
    children: list[Child] = []
    try:
        if impl == "etcd":  # the store is the run's etcd server
            port = 0
        else:
            host = Child([PY, str(CHILDREN), "store-host", "--impl", impl, "--timeout", "60"])
            children.append(host)
            port = int(host.expect("PORT", 60)[1])
        victim = Child(
            [
                PY,
                str(CHILDREN),
                "victim",
                "--impl",
                impl,
                "--port",
                str(port),
                "--run-id",
                run_id,
                "--timeout",
                "60",
            ]
            + (["--endpoint", endpoint] if impl == "etcd" else [])
        )
        children.append(victim)
        if impl in ("meshrun", "etcd"):
            from meshrun.rendezvous.api import NodeDesc, RendezvousSettings
            from meshrun.rendezvous.protocol import Rendezvous

            settings = RendezvousSettings(run_id, min_nodes=2, max_nodes=2)
            if impl == "etcd":
                from meshrun.rendezvous.etcd import open_etcd_store

                store = open_etcd_store(endpoint, settings)
            else:
                from meshrun.rendezvous.c10d import TCPStoreBackend

                store = TCPStoreBackend("127.0.0.1", port, is_host=False, timeout=60)
            rdzv = Rendezvous(
                store,
                settings,
                NodeDesc("survivor", "127.0.0.1", 1),
                host_bootstrap=lambda: ("127.0.0.1", 1),
            )
            rdzv.next_round()
            interval = rdzv.settings.keep_alive_interval

            def detected() -> bool:
                reason = rdzv.poll()
                return reason is not None and "lost" in reason
        else:
            handler = kids.torch_handler(port, run_id, 2, 60)
            handler.next_rendezvous()
            interval = handler.settings.keep_alive_interval.total_seconds()

            def detected() -> bool:
                with handler._heartbeat_lock:
                    handler._state_holder.sync()
                    return len(handler._state_holder.state.participants) < 2

        victim.expect("RANKED", 60)
        time.sleep(1.0 + random.uniform(0, interval))  # a random phase of the heartbeat
        os.kill(victim.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        while not detected():
            if time.monotonic() - t_kill > 60:
                raise RuntimeError(f"{impl}: dead node not detected within 60 s")
            time.sleep(0.1)
        dt = time.monotonic() - t_kill
        if impl in ("meshrun", "etcd"):
            rdzv.close()
            if impl == "etcd":
                store.close()  # its job lease expires; the run's keys go with it
        else:
            handler._stop_heartbeats()
        print(f"<!-- dead node {impl}: {dt:.2f} s -->", flush=True)
        return dt
    finally:
        for c in reversed(children):
            c.kill()


# -- part 3 ---------------------------------------------------------------------------------------


def part_launch(repeats: int) -> None:
    print("## 3. Two-agent launch on 127.0.0.1, 1 gloo worker per agent\n", flush=True)
    times: dict[str, list[float]] = {"meshrun": [], "torchrun": []}
    for i in range(repeats):
        order = ["meshrun", "torchrun"] if i % 2 == 0 else ["torchrun", "meshrun"]
        for impl in order:
            dt = launch_once(impl)
            times[impl].append(dt)
            print(f"<!-- launch {impl}: {dt:.2f} s -->", flush=True)
    m, t = statistics.median(times["meshrun"]), statistics.median(times["torchrun"])
    print("| | start to both workers' line (median) | runs |")
    print("|---|---:|---|")
    print(f"| meshrun | {m:.2f} s | {', '.join(f'{x:.2f}' for x in times['meshrun'])} |")
    print(f"| torchrun | {t:.2f} s | {', '.join(f'{x:.2f}' for x in times['torchrun'])} |")
    print(f"| meshrun / torchrun | {m / t:.2f}x | |")
    print()
    print(
        "Command per agent (both agents started at once, default --rdzv-conf): `<launcher> "
        "--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "
        "127.0.0.1:<free port> --rdzv-id <id> benchmarks/_rdzv_worker.py`, launcher "
        "`python -m meshrun` or `python -m torch.distributed.run` (torchrun). Time until both "
        "workers printed their line after init_process_group('gloo') + all_reduce (each "
        "worker records its own time.time()).\n",
        flush=True,
    )


def launch_once(impl: str) -> float:
    port = free_port()
    module = "meshrun" if impl == "meshrun" else "torch.distributed.run"
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-") as tmp:
        env = dict(os.environ, RDZV_BENCH_DIR=tmp)
        cmd = [
            PY,
            "-m",
            module,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"launch-{uuid.uuid4().hex[:6]}",
            str(WORKER),
        ]
        logs = [open(Path(tmp) / f"agent{i}.log", "w") for i in range(2)]
        t0 = time.time()
        procs = [
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            for log in logs
        ]
        marks = [Path(tmp) / "rank0", Path(tmp) / "rank1"]
        try:
            while not all(m.exists() for m in marks):
                if time.time() - t0 > 120 or any(p.poll() not in (None, 0) for p in procs):
                    tails = [(Path(tmp) / f"agent{i}.log").read_text()[-800:] for i in range(2)]
                    raise RuntimeError(f"{impl} launch failed or hung:\n" + "\n---\n".join(tails))
                time.sleep(0.005)
            dt = max(float(m.read_text()) for m in marks) - t0
            for p in procs:
                p.wait(timeout=60)
            if any(p.returncode != 0 for p in procs):
                tails = [(Path(tmp) / f"agent{i}.log").read_text()[-800:] for i in range(2)]
                raise RuntimeError(
                    f"{impl} agents exited {[p.returncode for p in procs]}:\n"
                    + "\n---\n".join(tails)
                )
            return dt
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            for log in logs:
                log.close()


# -- helpers --------------------------------------------------------------------------------------


class Child:
    """A child process spoken to by lines on stdin/stdout (see ``_rdzv_children.py``)."""

    def __init__(self, cmd: list[str], lines: queue.Queue | None = None):
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.lines: queue.Queue = queue.Queue() if lines is None else lines  # may be shared
        self.err_tail: collections.deque[str] = collections.deque(maxlen=3)
        threading.Thread(target=self._read, daemon=True).start()
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def _read_err(self) -> None:
        """Pass the child's stderr through, keeping its last lines for a failure's message."""
        for line in self.proc.stderr:
            sys.stderr.write(line)
            if line.strip():
                self.err_tail.append(line.strip())

    def exit_reason(self) -> str:
        """ " (exit RC: last stderr line)" once the child has exited, else ""."""
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return ""
        self._err_reader.join(timeout=2)
        last = self.err_tail[-1][:200] if self.err_tail else "no stderr"
        return f" (exit {self.proc.returncode}: {last})"

    def expect(self, word: str, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"no {word} from {self.proc.args[2:4]} in {timeout:g} s"
                ) from None
            if line is None:
                raise RuntimeError(f"{self.proc.args[2:4]} exited before {word}")
            if line.startswith(word):
                return line.split()
            if line.startswith("ERROR"):
                raise RuntimeError(line)

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass


class EtcdServer:
    """One etcd member on 127.0.0.1 for this run: free client and peer ports, a temp data dir,
    its own session; ``stop()`` ends it by its PID (SIGTERM, then SIGKILL) and removes the dir.
    """

    def __init__(self, binary: str, extra: list[str] | None = None):
        self.binary = binary
        self.extra = list(extra or [])  # more etcd flags
        self.data_dir = tempfile.mkdtemp(prefix="rdzv-bench-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(self.data_dir) / "etcd.log"
        self.version = "etcd"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30) -> None:
        import urllib.request

        try:
            out = subprocess.run(
                [self.binary, "--version"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
            self.version = out.splitlines()[0].replace("etcd Version:", "etcd").strip()
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
        url = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary, "--name", "bench", "--data-dir", str(Path(self.data_dir) / "data"),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"bench={peer}", "--initial-cluster-state", "new",
            "--initial-cluster-token", f"rdzv-bench-{os.getpid()}-{self.peer_port}",
            "--logger", "zap", "--log-level", "warn",
            *self.extra,
        ]  # fmt: skip
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text()[-2000:] if self.log_path.exists() else ""
                raise RuntimeError(f"etcd did not become healthy on {url}:\n{tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def fs_type(path: str) -> str:
    """The file system ``path`` is on ("ext4", "tmpfs", ...), from /proc/mounts."""
    best, kind = "", "file system unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            mount = fields[1]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg()) + " (1/5/15 min)"


def machine_line() -> str:
    import torch

    return (
        f"{platform.machine()}, Linux {platform.release()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
