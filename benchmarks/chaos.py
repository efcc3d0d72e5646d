"""Chaos soak: a 3-node elastic job under a seeded random sequence of faults, then invariants.

Usage (from the repository root, with the project's virtual environment; root for the tmpfs):

    .venv/bin/python benchmarks/chaos.py [--faults 100] [--per-run 5] [--seed 1] [--steps 160]
                                         [--verbose]

Each run starts a 3-member etcd cluster on 127.0.0.1 and three agents (the nodes, on one host)
of one job: ``meshrun --nnodes 2:3 --nproc-per-node 1 --rdzv-backend etcd --max-restarts
1000 --hang-timeout 6 examples/train_char_lm.py`` with a global batch of 8 windows kept at
every world size and a checkpoint every 4 steps (background saves). Node 2 logs to a 1 MiB
tmpfs. Once training runs, faults are injected at seeded random moments (gaps of 0.2 to 6 s,
so some land within one second of each other):

- ``kill-worker``: SIGKILL a node's worker;      ``stop-worker``: SIGSTOP it (a hang);
- ``kill-agent``: SIGKILL a node's agent, which comes back 2-8 s later (a node reboots);
- ``term-agent``: SIGTERM a node's agent (a scheduler takes the node), back 2-8 s later;
- ``kill-etcd``: SIGKILL an etcd member (never two at once), restarted 2-6 s later;
- ``disk-full``: fill node 2's log tmpfs;
- ``cut-link``: cut a node's link to the others and to etcd for 2-12 s (its veth goes down),
  then restore it; a node whose agent gave up comes back as a new agent.

Where the machine allows (root, iproute2), each node is a network namespace of its own on a
bridge in the root namespace (10.214.N.10-12, etcd on the bridge's 10.214.N.1, gloo told its
interface): a cut is a real partition. Elsewhere the nodes share 127.0.0.1 and no link is cut.

A node comes back only while the job runs (no scheduler restarts a node of a finished job).
When the job has ended, the run's invariants are checked:

- every node's last agent exited 0 (but a node whose agent the harness took away, by a kill,
  a SIGTERM or a cut, while the job then ended before its return: its exit is the fault's),
  and the last step trained is ``--steps``;
- the loss at every step any attempt logged equals an uninterrupted one-process run's (same
  global batch: exact resume), within ``LOSS_TOL``;
- the last round's restart count is the same on every node that ran it;
- no process of the job is left (found by an environment tag), no key of it in etcd.

Output: one line per run (seed, faults injected by kind, invariants broken), then a total of
faults injected and survived (a fault is survived when its run broke no invariant). Replay a
run with ``--seed <its seed> --faults <its count> --per-run <its count>``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests"), str(REPO / "tests" / "rendezvous")]
from _common import print_end, print_start  # noqa: E402
from etcd_fixtures import EtcdCluster, EtcdMember  # noqa: E402 - the tests' real etcd

EXAMPLE = REPO / "examples" / "train_char_lm.py"
TAG_ENV = "MESHRUN_CHAOS_TAG"
RELINK_GRACE_S = 15.0  # after a cut, an agent that exits non-zero within this is brought back
KINDS = ["kill-worker", "stop-worker", "kill-agent", "term-agent", "kill-etcd", "disk-full",
         "cut-link"]
LOSS_TOL = 2e-3  # world sizes 1, 2, 3 add the gradient shares in different orders
HANG_TIMEOUT = 6
STEP_RE = re.compile(r"step (\d+) \| loss ([0-9.]+)")
ROUND_RE = re.compile(r"meshrun: round (\d+): .*restart count (\d+)")


def script_args(steps: int, ckpt: Path, seed: int = 1337) -> list[str]:
    return ["--steps", str(steps), "--batch-size", "4", "--global-batch-size", "8",
            "--block-size", "32", "--log-every", "1", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "4", "--seed", str(seed)]


@dataclass
class Node:
    """One node: its agent instances over the run (a killed node comes back as a new one)."""

    index: int
    log_dir: Path
    host: Host | None = None  # its namespace, or None: the nodes share 127.0.0.1
    outputs: list[Path] = field(default_factory=list)
    agents: list[subprocess.Popen] = field(default_factory=list)
    back_at: float | None = None  # when a stopped agent is to come back (monotonic s)
    left_out: bool = False  # the harness took its agent away and the job ended before its return
    relinked_at: float | None = None  # when its cut link came back (monotonic s)

    @property
    def agent(self) -> subprocess.Popen | None:
        return self.agents[-1] if self.agents else None

    def running(self) -> bool:
        return self.agent is not None and self.agent.poll() is None

    def worker(self) -> psutil.Process | None:
        if not self.running():
            return None
        try:
            for p in psutil.Process(self.agent.pid).children(recursive=True):
                if str(EXAMPLE) in " ".join(p.cmdline()) and p.status() not in (
                        psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED):
                    return p
        except psutil.Error:
            pass
        return None


@dataclass
class Host:
    """A node's network namespace: ``ns``, its end of the veth (``ifname``, ``addr``) and the
    root namespace's end (``uplink``, on the bridge: down = the link cut)."""

    ns: str
    ifname: str
    uplink: str
    addr: str

    def cmd(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


class Network:
    """Three namespaces on one bridge (10.214.N.0/24, N from the pid): the nodes as hosts."""

    _made = itertools.count()  # one set of names per run: a deleted namespace's veth lingers

    def __init__(self):
        n = next(Network._made)
        tag = f"{os.getpid() % 1000}{n % 100}"
        self.subnet = f"10.214.{(os.getpid() + n) % 250}"
        self.bridge = f"mrc{tag}b"
        self.gateway = f"{self.subnet}.1"  # the bridge's address: etcd listens there
        self.hosts = [Host(f"mrc{tag}n{i}", f"mrc{tag}g{i}", f"mrc{tag}h{i}",
                           f"{self.subnet}.{10 + i}") for i in range(3)]

    @staticmethod
    def available() -> bool:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return False
        probe = f"mrcprobe{os.getpid()}"
        ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return ok

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            _ip("link", "add", h.uplink, "type", "veth", "peer", "name", h.ifname, "netns", h.ns)
            _ip("link", "set", h.uplink, "master", self.bridge, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")

    def set_link(self, host: Host, up: bool) -> None:
        _ip("link", "set", host.uplink, "up" if up else "down")

    def delete(self) -> None:
        for h in self.hosts:
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class _BridgeMember(EtcdMember):
    """An etcd member listening on the bridge's address (reachable from every namespace)."""

    host = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


@dataclass
class Run:
    """What one run did and what broke."""

    seed: int
    tag: str = ""  # the environment tag of the run's processes
    injected: Counter = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Job:
    """The three agents, the etcd cluster and the files of one run."""

    def __init__(self, work: Path, steps: int, seed: int, script_seed: int = 1337):
        self.work, self.steps = work, steps
        self.tag = f"chaos-{seed}-{uuid.uuid4().hex[:8]}"
        self.run_id = self.tag
        self.ckpt = work / "ckpt"
        self.etcd = EtcdCluster(work / "etcd", size=3)
        self.net = Network() if Network.available() else None
        if self.net is not None:  # etcd on the bridge, each node in its namespace
            for m in self.etcd.members:
                m.__class__, m.host = _BridgeMember, self.net.gateway
        self.nodes = [Node(i, work / f"logs{i}", self.net.hosts[i] if self.net else None)
                      for i in range(3)]
        self.link_back: dict[int, float] = {}  # node index -> when its cut link comes back
        self.tmpfs: Path | None = None
        self.script_seed = script_seed
        self.etcd_back: dict[int, float] = {}

    def start(self) -> None:
        if self.net is not None:
            self.net.create()
        self.etcd.start()
        self.ckpt.mkdir()
        for node in self.nodes:
            node.log_dir.mkdir()
        self.tmpfs = self._mount_tmpfs(self.nodes[2].log_dir)
        for node in self.nodes:
            self.start_agent(node)

    @staticmethod
    def _mount_tmpfs(path: Path) -> Path | None:
        if os.geteuid() != 0:
            return None
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                              capture_output=True, text=True)
        return path if done.returncode == 0 else None

    def start_agent(self, node: Node) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PET_", "TORCHELASTIC_", "MASTER_", "RANK", "WORLD_SIZE"))}
        env.update({TAG_ENV: self.tag, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        out = self.work / f"agent{node.index}.{len(node.agents)}.out"
        where = []
        if node.host is not None:
            env["GLOO_SOCKET_IFNAME"] = node.host.ifname
            where = ["--local-addr", node.host.addr]
        cmd = [sys.executable, "-m", "meshrun", "--nnodes", "2:3", "--nproc-per-node", "1", *where,
               "--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.endpoints,
               "--rdzv-id", self.run_id, "--rdzv-conf", "join_timeout=300,last_call_timeout=1",
               "--max-restarts", "1000", "--hang-timeout", str(HANG_TIMEOUT),
               "--log-dir", str(node.log_dir), str(EXAMPLE),
               *script_args(self.steps, self.ckpt, self.script_seed)]
        if node.host is not None:
            cmd = node.host.cmd(cmd)  # ip netns exec execs: the pid is the agent's
        with open(out, "w") as f:
            node.agents.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                                env=env, cwd=REPO, start_new_session=True))
        node.outputs.append(out)
        node.back_at = None

    def output(self) -> str:
        return "".join(p.read_text(errors="replace") for n in self.nodes for p in n.outputs
                       if p.exists())

    def training(self) -> bool:
        return STEP_RE.search(self.output()) is not None

    def finished(self) -> bool:
        """Some node's agent exited 0: the job is over (no node comes back after that)."""
        return any(a.poll() == 0 for n in self.nodes for a in n.agents)

    def all_exited(self) -> bool:
        return all(not n.running() and n.back_at is None for n in self.nodes) and \
            not self.etcd_back and not self.link_back

    def tick(self) -> None:
        """Bring back nodes and etcd members whose time has come (while the job runs)."""
        now = time.monotonic()
        for i, at in list(self.link_back.items()):
            if now >= at:
                self.net.set_link(self.nodes[i].host, up=True)
                del self.link_back[i]
                self.nodes[i].relinked_at = now
        for node in self.nodes:
            # an agent that gave up because of a cut (etcd unreachable for read_timeout, 10 s;
            # also a moment after the link is back: its last call's deadline) comes back
            if node.relinked_at is None or node.running() or node.back_at is not None:
                continue
            if now - node.relinked_at < RELINK_GRACE_S and node.agent.returncode != 0:
                node.back_at = now  # (left out below if the job ended meanwhile)
            node.relinked_at = None
        for node in self.nodes:
            if node.back_at is not None and now >= node.back_at:
                if self.finished():
                    node.back_at, node.left_out = None, True
                else:
                    self.start_agent(node)
        for i, at in list(self.etcd_back.items()):
            if now >= at:
                member = self.etcd.members[i]
                initial = ",".join(f"{m.name}={m.peer_url}" for m in self.etcd.members)
                member.start(initial, 3, "restart")  # the data dir holds the cluster
                del self.etcd_back[i]

    def stop(self) -> None:
        """Kill whatever of the run is left (agents, workers: by tag), etcd, the tmpfs."""
        for node in self.nodes:
            for a in node.agents:
                if a.poll() is None:
                    os.killpg(a.pid, signal.SIGKILL)
                    a.wait(10)
        for p in tagged(self.tag):
            try:
                p.kill()
            except psutil.Error:
                pass
        self.etcd.stop()
        if self.tmpfs is not None:
            subprocess.run(["umount", "-l", str(self.tmpfs)], capture_output=True)
        if self.net is not None:
            self.net.delete()


def tagged(tag: str) -> list[psutil.Process]:
    """Every live process (not zombie) whose environment carries the run's tag."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and \
                    p.environ().get(TAG_ENV) == tag:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def inject(job: Job, kind: str, rng: random.Random) -> str | None:
    """Inject one fault now; a description, or None when nothing could take it now."""
    present = [n for n in job.nodes if n.running()]
    if kind in ("kill-worker", "stop-worker"):
        candidates = [(n, w) for n in present if (w := n.worker()) is not None]
        if not candidates:
            return None
        node, worker = rng.choice(candidates)
        worker.send_signal(signal.SIGKILL if kind == "kill-worker" else signal.SIGSTOP)
        return f"{kind} node {node.index} pid {worker.pid}"
    away = {n.index for n in job.nodes if not n.running()} | set(job.link_back)
    if kind == "cut-link":
        if job.net is None or away or len(present) < 3:
            return None
        node = rng.choice(present)
        job.net.set_link(node.host, up=False)
        job.link_back[node.index] = time.monotonic() + rng.uniform(2, 12)
        return f"cut-link node {node.index}"
    if kind in ("kill-agent", "term-agent"):
        if len(present) < 3 or away:  # one node away at a time: the job keeps 2 nodes
            return None
        node = rng.choice(present)
        node.agent.send_signal(signal.SIGKILL if kind == "kill-agent" else signal.SIGTERM)
        node.back_at = time.monotonic() + rng.uniform(2, 8)
        return f"{kind} node {node.index} pid {node.agent.pid}"
    if kind == "kill-etcd":
        if job.etcd_back:
            return None
        i = rng.randrange(3)
        job.etcd.members[i].kill()
        job.etcd_back[i] = time.monotonic() + rng.uniform(2, 6)
        return f"kill-etcd member {i}"
    if kind == "disk-full":
        if job.tmpfs is None:
            return None
        try:
            with open(job.tmpfs / "filler", "ab", buffering=0) as f:
                while True:
                    f.write(b"\0" * 65536)
        except OSError:  # ENOSPC: full
            pass
        return "disk-full node 2 log dir"
    raise ValueError(kind)


def reference_losses(work: Path, steps: int) -> dict[int, float]:
    """The uninterrupted run: one process, the same global batch, no launcher."""
    ckpt = work / "reference-ckpt"
    ckpt.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(EXAMPLE), *script_args(steps, ckpt)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{done.stdout}{done.stderr}")
    return {int(s): float(v) for s, v in STEP_RE.findall(done.stdout)}


def check(job: Job, reference: dict[int, float], run: Run) -> None:
    """The run's invariants; what broke goes to ``run.broken``."""
    for node in job.nodes:
        last = node.agent
        if node.left_out:  # a victim, not a survivor: its exit is the fault's (143, -9, 3)
            run.notes.append(f"node {node.index} left out (the job ended before its return)")
        elif last is None or last.returncode != 0:
            run.broken.append(f"node {node.index}'s last agent exited "
                              f"{None if last is None else last.returncode}")
    text = job.output()
    logged = [(int(s), float(v)) for s, v in STEP_RE.findall(text)]
    if not logged or max(s for s, _ in logged) != job.steps:
        run.broken.append(f"last step logged {max((s for s, _ in logged), default=None)}, "
                          f"not {job.steps}")
    if not (job.ckpt / f"step_{job.steps}").is_dir():
        run.broken.append(f"no checkpoint of step {job.steps}")
    worst = max((abs(v - reference[s]) for s, v in logged if s in reference), default=0.0)
    if worst > LOSS_TOL:
        bad = next(s for s, v in logged if s in reference and abs(v - reference[s]) > LOSS_TOL)
        run.broken.append(f"loss differs from the uninterrupted run by {worst:.3g} (first at "
                          f"step {bad})")
    run.notes.append(f"loss max |diff| {worst:.2g} over {len(logged)} logged steps")
    finals = {}
    for node in job.nodes:
        rounds = [(int(r), int(c)) for r, c in ROUND_RE.findall(
            node.outputs[-1].read_text(errors="replace"))] if node.outputs else []
        if rounds:
            finals[node.index] = max(rounds)
    last_round = max((r for r, _ in finals.values()), default=None)
    counts = {i: c for i, (r, c) in finals.items() if r == last_round}
    if len(set(counts.values())) > 1:
        run.broken.append(f"restart counts differ in round {last_round}: {counts}")
    left = tagged(job.tag)
    if left:
        run.broken.append(f"{len(left)} process(es) of the job left: "
                          f"{[' '.join(p.cmdline())[:80] for p in left[:3]]}")
    try:
        keys = next((job.etcd.keys(f"/meshrun/{job.run_id}/", member=i)
                     for i in range(3) if job.etcd.members[i].proc.poll() is None), [])
    except OSError as e:
        keys = [f"(etcd unreadable: {e})"]
    if keys:
        run.broken.append(f"{len(keys)} etcd key(s) of the job left, e.g. {keys[:3]}")


def soak(seed: int, n_faults: int, steps: int, reference: dict[int, float], work: Path, *,
         verbose: bool = False, script_seed: int = 1337, deadline_s: float = 900,
         stray: bool = False, kinds: list[str] = KINDS) -> Run:
    """One run: start the job, inject ``n_faults`` faults, wait for the end, check.

    ``script_seed`` and ``stray`` break a run on purpose (a job trained from another seed; a
    tagged process left behind), for the test that the checker catches broken runs."""
    rng, run = random.Random(seed), Run(seed)
    job = Job(work, steps, seed, script_seed)
    run.tag = job.tag
    began = time.monotonic()
    try:
        try:
            job.start()
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            run.broken.append(f"the harness could not start the job: {e}")
            raise _Abort from None
        while not job.training():
            if time.monotonic() - began > deadline_s / 3 or job.finished():
                run.broken.append("training never started")
                raise _Abort
            time.sleep(0.2)
        if stray:
            subprocess.Popen(["sleep", "600"], env={**os.environ, TAG_ENV: job.tag},
                             start_new_session=True)
        plan = [rng.choice(kinds) for _ in range(n_faults)]
        next_at = time.monotonic() + rng.uniform(1, 4)
        while plan and not job.finished():
            job.tick()
            if time.monotonic() >= next_at:
                what = inject(job, plan[0], rng)
                if what is not None:
                    run.injected[plan.pop(0)] += 1
                    if verbose:
                        print(f"  t={time.monotonic() - began:6.1f} s  {what}", flush=True)
                    # mostly seconds apart; one in four within a second of the last
                    next_at = time.monotonic() + (rng.uniform(0.2, 1.0) if rng.random() < 0.25
                                                  else rng.uniform(2, 6))
                else:
                    next_at = time.monotonic() + 0.3
            time.sleep(0.05)
        if plan:
            run.notes.append(f"{len(plan)} fault(s) not injected: the job ended first")
        while True:
            job.tick()  # before the end is judged: an agent that just gave up may come back
            if job.all_exited():
                break
            if time.monotonic() - began > deadline_s:
                run.broken.append(f"the job did not end within {deadline_s:.0f} s")
                raise _Abort
            time.sleep(0.2)
        check(job, reference, run)
    except _Abort:
        pass
    finally:
        if verbose or run.broken:
            run.notes.append(f"agent outputs in {work}")
        job.stop()
    return run


class _Abort(Exception):
    pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=20, help="faults in all, over the runs")
    p.add_argument("--per-run", type=int, default=5, help="faults per run")
    p.add_argument("--seed", type=int, default=1, help="the first run's seed (then +1, ...)")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--kinds", default=",".join(KINDS), help="the fault kinds to draw from")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep every run's directory")
    args = p.parse_args()
    # SIGTERM (and SIGINT, which a background shell ignores) ends the soak through the runs'
    # finally blocks: no agent, namespace, tmpfs or etcd member of it is left behind
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    began = print_start()
    base = Path(tempfile.mkdtemp(prefix="meshrun-chaos-"))
    reference = reference_losses(base, args.steps)
    runs, left = [], args.faults
    seed = args.seed
    while left > 0:
        n = min(args.per_run, left)
        work = base / f"run{seed}"
        work.mkdir()
        run = soak(seed, n, args.steps, reference, work, verbose=args.verbose,
                   kinds=args.kinds.split(","))
        injected = sum(run.injected.values())
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(run.injected.items()))
        verdict = "ok" if not run.broken else "BROKEN: " + "; ".join(run.broken)
        print(f"seed {seed}: {injected} fault(s) injected ({kinds}) | {verdict} | "
              f"{'; '.join(run.notes)}", flush=True)
        if not run.broken and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        runs.append(run)
        left -= max(injected, 1)
        seed += 1
    injected = sum(sum(r.injected.values()) for r in runs)
    survived = sum(sum(r.injected.values()) for r in runs if not r.broken)
    by_kind = sum((r.injected for r in runs), Counter())
    print(f"\nfaults injected {injected}, survived {survived} ({len(runs)} runs, "
          f"{sum(1 for r in runs if r.broken)} with an invariant broken); by kind: "
          + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())))
    print_end(began)
    if not any(r.broken for r in runs) and not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if survived == injected else 1


if __name__ == "__main__":
    sys.exit(main())
