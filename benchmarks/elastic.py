"""Elastic training: recovery after a node's death, and checkpoint throughput vs torch DCP.

Usage (from the repository root, with the project's virtual environment):

    .venv/bin/python benchmarks/elastic.py [--part 1|2|3|all] [--rounds 3] [--cap 120]
                                           [--dp-mode ddp|fsdp] [--ckpt-rounds 5]
                                           [--copy-every 4] [--verbose] [--keep-logs DIR]

A quick development run (about a minute): ``--rounds 1 --ckpt-layers 2 --ckpt-rounds 1``.

Part 1, recovery time after a node's death (meshrun in place, meshrun restart and torchrun,
the order of the three rotating from round to round): two agents on 127.0.0.1 (``--nnodes 1:2 --nproc-per-node 1``, c10d rendezvous on a
free port, ``--max-restarts 3``; ``is_host=1`` in ``--rdzv-conf`` for the first agent, which
hosts the store, ``is_host=0`` for the second: both are on one address) train
examples/train_char_lm.py (``--steps 200 --batch-size 8 --log-every 1 --checkpoint-every 5``,
checkpoints with meshrun.parallel.checkpoint, i.e. torch DCP). Once a two-node round trains
(the banner says ``world 2``) and ``step_10`` exists, the second node dies whole: its agent
and every descendant are SIGKILLed at once, like a host going away. Time = from the kill to
the arrival, on the survivor's stdout pipe (read on a thread, each line stamped with
``time.monotonic()``), of the first ``step N | loss`` line after its ``resumed from step K``
line: detection + rendezvous + restart + checkpoint load + one step. Steps lost = the last
step logged before the kill minus K (trained again). In place (``--elastic in-place``, no
``--checkpoint-dir``; `meshrun.parallel.elastic`): the kill comes once step 10 was logged at
world 2, and the time runs to the first ``step N | loss`` line after the kill (detection +
rendezvous + the handover + one step in the new world); steps lost = the last step logged
before the kill minus (N - 1). Each launcher otherwise
runs with its defaults (meshrun: keep-alive 0.5 s x 5, last call 1 s; torchrun: keep-alive
5 s x 3, last call 30 s); torchrun gets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(pytorch#135712); both get ``OMP_NUM_THREADS=1``. A round that does not recover within
``--cap`` seconds prints "did not recover in T s". Everything a round started is killed at its
end (found by an environment tag too) and its directory removed; ``--keep-logs DIR`` keeps
both agents' output, every line stamped with its arrival time relative to the kill. Target:
meshrun's median at most 0.5x torchrun's.

Where the time goes (see ``--keep-logs``): under both launchers the survivor's worker fails
at once (gloo: connection reset by peer) and its agent sees the failure when the worker has
exited; the restarted worker then needs its ``import torch``, process group and checkpoint
load, the same script under both. In between, the re-rendezvous: meshrun's survivor waits its
1 s last call; torchrun's survivor waits in the wait list of the finished two-node round
until the dead node's keep-alive lapses (5 s x 3 from its last heartbeat), then alone in the
new round for its 30 s last call.

With ``--dp-mode fsdp`` all three train the example under meshrun's ``fully_shard``; in
place, the dead node's shards then come from the survivor's neighbour copy (refreshed at
every step's end, `meshrun.parallel.fsdp.copies`; a step's line is printed once its copies
are out, so a printed step is never trained again).

Part 2, checkpoint save and load vs torch DCP: 2 ranks (torch.multiprocessing, gloo, one
thread each) hold two copies of one model (``--ckpt-layers`` x nn.Linear(``--ckpt-width``,
``--ckpt-width``) and a small head, 50.4M fp32 parameters by default) with AdamW state (one
optimizer step), sharded each layer then the root: one copy with meshrun.parallel.fully_shard,
saved with ``checkpoint.save({"model": checkpoint.model_state(m), "optim":
checkpoint.optimizer_state(opt, m)}, path)`` and loaded with ``checkpoint.load`` of the same;
the other with torch FSDP2 (``torch.distributed.fsdp.fully_shard``), saved with
``get_state_dict`` + ``dcp.save`` and loaded with ``get_state_dict`` + ``dcp.load`` +
``set_state_dict``. Each save and load is timed on every rank from a barrier (building the
state dicts included); the slower rank counts. Rounds alternate the two sides after
``--ckpt-warmup`` untimed rounds; medians; GB/s = the checkpoint directory's size (sum of its
files' sizes, 1 GB = 1e9 bytes) / seconds. Both write to the same temporary directory (one
filesystem), removed after every round. Before each load every parameter and optimizer state
tensor is zeroed, and after it compared with the saved values. Target: meshrun at most 1.2x
DCP's time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE)]
from _common import free_port, kill_tree, print_end, print_start, stop_round  # noqa: E402

EXAMPLE = REPO / "examples" / "train_char_lm.py"
TAG_ENV = "MESHRUN_BENCH_ELASTIC_TAG"  # marks every process a round started, to clean up
LAUNCHERS = ("in-place", "meshrun", "torchrun")  # in-place: meshrun --elastic in-place
NAMES = {"in-place": "meshrun in place", "meshrun": "meshrun restart", "torchrun": "torchrun"}
STEP_RE = re.compile(r"step (\d+) \| loss ([0-9.]+)")
RESUMED_RE = re.compile(r"resumed from step (\d+)")
KILL_AT = 10  # the checkpoint that must exist before the kill (--checkpoint-every 5)


# -- part 1: recovery after a node's death ------------------------------------------------------


@dataclass
class Agent:
    """One launcher process; its stdout+stderr lines, each stamped on arrival."""

    popen: subprocess.Popen
    lines: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic(), text)

    def texts(self) -> list[str]:
        return [text for _, text in list(self.lines)]


def _pump(popen: subprocess.Popen, lines: list[tuple[float, str]]) -> None:
    for line in popen.stdout:
        lines.append((time.monotonic(), line.rstrip("\n")))


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(pred, timeout: float, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(step)


class Round:
    """One launcher, two agents, one kill; `cleanup` ends everything it started."""

    def __init__(self, launcher: str, args: argparse.Namespace):
        self.launcher, self.args = launcher, args
        self.dir = Path(tempfile.mkdtemp(prefix=f"elastic_{launcher}_"))
        self.ckpt = self.dir / "ckpt"
        self.tag = uuid.uuid4().hex
        self.port = free_port()
        self.agents: list[Agent] = []
        self.t_start, self.t_kill = time.monotonic(), None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PET_", "TORCHELASTIC_", "MESHRUN_"))
               and k not in ("MASTER_PORT", "MASTER_ADDR", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   TMPDIR=str(self.dir), PYTHONUNBUFFERED="1", **{TAG_ENV: self.tag})
        if self.launcher == "torchrun":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return env

    def argv(self, is_host: bool) -> list[str]:
        return launcher_argv(self.launcher, f"127.0.0.1:{self.port}", f"elastic-{self.tag[:8]}",
                             is_host, str(self.ckpt), self.args.steps, self.args.dp_mode)

    def start(self, is_host: bool) -> Agent:
        popen = subprocess.Popen(
            self.argv(is_host), env=self.env(), cwd=self.dir, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True)
        agent = Agent(popen)
        threading.Thread(target=_pump, args=(popen, agent.lines), daemon=True).start()
        self.agents.append(agent)
        return agent

    def cleanup(self) -> None:
        stop_round([agent.popen for agent in self.agents], TAG_ENV, self.tag, self.dir)

    def log(self) -> str:
        """Both agents' lines, each with its arrival time in seconds after the kill."""
        names = ("node 0 (store host, survivor)", "node 1 (killed)")
        t0 = self.t_kill if self.t_kill is not None else self.t_start
        what = "the kill" if self.t_kill is not None else "the start"
        return "\n".join(f"--- {names[i]} (seconds after {what}) ---\n"
                         + "\n".join(f"{t - t0:+9.3f} {text}" for t, text in list(a.lines))
                         for i, a in enumerate(self.agents))


def launcher_argv(launcher: str, endpoint: str, rdzv_id: str, is_host: bool, ckpt: str,
                  steps: int, dp_mode: str = "ddp") -> list[str]:
    exe = ["-m", "torch.distributed.run"] if launcher == "torchrun" else ["-m", "meshrun"]
    keep = (["--elastic", "in-place"] if launcher == "in-place"
            else ["--checkpoint-dir", ckpt, "--checkpoint-every", "5"])
    return [sys.executable, *exe, "--nnodes", "1:2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"is_host={int(is_host)}", "--max-restarts", "3",
            str(EXAMPLE), "--steps", str(steps), "--batch-size", "8", "--log-every", "1",
            "--dp-mode", dp_mode, *keep]


@dataclass
class Recovery:
    seconds: float | None  # kill -> first step line after the resume; None: no recovery
    to_resumed: float | None = None  # kill -> the "resumed from step" line
    resumed_step: int | None = None
    first_step: int | None = None
    lost: int | None = None  # steps trained before the kill and again after it
    note: str = ""


def measure_recovery(launcher: str, args: argparse.Namespace) -> Recovery:
    rnd = Round(launcher, args)
    try:
        host = rnd.start(is_host=True)
        if not _wait(lambda: _listening(rnd.port), args.setup_cap):
            return Recovery(None, note="the c10d store never listened")
        victim = rnd.start(is_host=False)
        if launcher == "in-place":
            at_two = re.compile(rf"step {KILL_AT} \| loss .*\| world 2 ")
            ready = _wait(lambda: any(at_two.search(t) for t in host.texts()), args.setup_cap,
                          0.01)
        else:
            ready = _wait(lambda: any("world 2" in t for a in rnd.agents for t in a.texts())
                          and (rnd.ckpt / f"step_{KILL_AT}").is_dir(), args.setup_cap, 0.01)
        if not ready:
            return Recovery(None, note=f"no two-node round with step_{KILL_AT} within "
                                       f"{args.setup_cap:g} s")
        t_kill = rnd.t_kill = time.monotonic()
        kill_tree(victim.popen.pid)  # the whole node at once: agent and every descendant
        last = max((int(m.group(1)) for a in rnd.agents for t, text in list(a.lines)
                    if t < t_kill and (m := STEP_RE.search(text))), default=0)
        if launcher == "in-place":
            def next_step():
                for t, text in list(host.lines):
                    if t >= t_kill and (m := STEP_RE.search(text)):
                        return t, int(m.group(1))
                return None

            found = _wait(next_step, args.cap)
            if not found:
                return Recovery(None, note=_why_not(host, t_kill))
            t_step, n = found
            return Recovery(t_step - t_kill, None, None, n, lost=last - (n - 1))

        def recovered():
            resumed = None
            for t, text in list(host.lines):
                if t < t_kill:
                    continue
                if resumed is None:
                    m = RESUMED_RE.search(text)
                    if m:
                        resumed = (t, int(m.group(1)))
                elif m := STEP_RE.search(text):
                    return resumed, (t, int(m.group(1)))
            return None

        found = _wait(recovered, args.cap)
        if not found:
            return Recovery(None, note=_why_not(host, t_kill))
        (t_res, k), (t_step, n) = found
        return Recovery(t_step - t_kill, t_res - t_kill, k, n, lost=last - k)
    finally:
        if args.verbose:
            print(f"[{launcher}]\n{rnd.log()}", file=sys.stderr)
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            Path(args.keep_logs, f"{launcher}_{rnd.tag[:8]}.log").write_text(rnd.log())
        rnd.cleanup()


def _why_not(agent: Agent, t_kill: float) -> str:
    """The survivor's last line after the kill, as a hint of where it waits."""
    after = [text for t, text in list(agent.lines) if t >= t_kill and text.strip()]
    if agent.popen.poll() is not None:
        return f"survivor exited {agent.popen.returncode}: {after[-1][:160] if after else ''}"
    return f"survivor's last line: {after[-1][:160]}" if after else "survivor printed nothing"


def part1(args: argparse.Namespace) -> None:
    print(f"## Part 1: recovery after a node's death ({args.rounds} rounds per launcher, "
          "the order rotating)\n")
    for launcher in LAUNCHERS:
        env = "OMP_NUM_THREADS=1 PYTHONPATH=<repo> "
        if launcher == "torchrun":
            env += "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
        for is_host in (True, False):
            argv = launcher_argv(launcher, "127.0.0.1:PORT", "elastic-ID", is_host,
                                 "<tmp>/ckpt", args.steps, args.dp_mode)
            argv[0] = "python"
            argv = [a.replace(str(REPO) + "/", "") for a in argv]
            print(f"    {NAMES[launcher]} node {0 if is_host else 1}: {env}{shlex.join(argv)}")
    print()
    results: dict[str, list[Recovery]] = {name: [] for name in LAUNCHERS}
    for i in range(args.rounds):
        order = LAUNCHERS[i % 3:] + LAUNCHERS[:i % 3]
        for launcher in order:
            r = measure_recovery(launcher, args)
            results[launcher].append(r)
            if r.seconds is None:
                shown = f"did not recover in {args.cap:g} s ({r.note})"
            elif r.to_resumed is None:
                shown = f"{r.seconds:.2f} s (first step {r.first_step}, {r.lost} lost)"
            else:
                shown = (f"{r.seconds:.2f} s (resumed line at {r.to_resumed:.2f} s: from step "
                         f"{r.resumed_step}, first step {r.first_step}, {r.lost} lost)")
            load = os.getloadavg()[0]
            print(f"    round {i + 1} {NAMES[launcher]:16s} {shown}  [load {load:.2f}]",
                  flush=True)
    print()
    print("| launcher | recovery, median (s) | runs (s) | kill -> `resumed` line, median (s) "
          "| steps lost (runs) |")
    print("|---|---|---|---|---|")
    medians = {}
    for launcher in LAUNCHERS:
        rs = results[launcher]
        got = [r.seconds for r in rs if r.seconds is not None]
        medians[launcher] = statistics.median(got) if got else None
        runs = ", ".join(f"{r.seconds:.2f}" if r.seconds is not None else f">{args.cap:g} (none)"
                         for r in rs)
        med = f"{medians[launcher]:.2f}" if got else f"did not recover in {args.cap:g} s"
        if got and len(got) < len(rs):
            med += f" ({len(rs) - len(got)}/{len(rs)} did not recover in {args.cap:g} s)"
        res = [r.to_resumed for r in rs if r.to_resumed is not None]
        to_res = f"{statistics.median(res):.2f}" if res else "-"
        lost = ", ".join(str(r.lost) if r.lost is not None else "-" for r in rs)
        print(f"| {NAMES[launcher]} | {med} | {runs} | {to_res} | {lost} |")
    m, t, p = medians["meshrun"], medians["torchrun"], medians["in-place"]
    if p is not None and t is not None and m is not None:
        print(f"| ratio to torchrun: in place, restart | {p / t:.2f}x, {m / t:.2f}x | | | |")
    if p is not None:
        bound = 3.0 + 1.0
        zero = all(r.lost == 0 for r in results["in-place"])
        print(f"\ntarget in place (at most the detection bound 3 s + 1 s = {bound:g} s, zero "
              f"steps lost): {'met' if p <= bound and zero else 'MISSED'} (median {p:.2f} s, "
              f"steps lost {'0 in every run' if zero else 'not 0 in every run'})")
    else:
        print("\ntarget in place: MISSED (no in-place round recovered)")
    if m is not None and t is not None:
        ratio = m / t
        print(f"target restart (recovery at most 0.5x torchrun's): "
              f"{'met' if ratio <= 0.5 else 'MISSED'} ({ratio:.2f}x)")
    elif m is not None:
        print(f"target restart (recovery at most 0.5x torchrun's): met (torchrun did not "
              f"recover in {args.cap:g} s)")
    else:
        print("target restart (recovery at most 0.5x torchrun's): MISSED (meshrun did not "
              "recover)")
    notes = [f"{name} round: {r.note}" for name in LAUNCHERS for r in results[name] if r.note]
    for note in notes:
        print(f"note: {note}")
    print("\nTime = the benchmark's SIGKILL of node 1 (agent + worker) to the arrival of node "
          "0's first `step N | loss` line after its `resumed from step K` line (detection + "
          "rendezvous + restart + checkpoint load + one step); in place, to its first `step N "
          "| loss` line after the kill (detection + rendezvous + handover + one step). Steps "
          "lost: trained before the kill and again after it. Non-default settings: "
          "`--max-restarts 3`, `--rdzv-conf is_host=1|0` (both agents share 127.0.0.1), "
          "OMP_NUM_THREADS=1 (both), TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torchrun); all else "
          "each launcher's defaults.\n")


# -- part 2: checkpoint save / load vs torch DCP --------------------------------------------------

SIDES = ("meshrun", "dcp")


def ckpt_worker(rank: int, port: int, args: dict, base: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from _common import build_stack, init_gloo_pair, load_ckpt, save_ckpt, state_tensors

    init_gloo_pair(rank, port)
    width, n_layers = args["width"], args["layers"]

    def build(side):
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))
        return build_stack(side, width, n_layers, 1e-3, x)

    tensors = state_tensors
    save = save_ckpt
    load = load_ckpt

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slower rank counts
        return dt.item()

    sides = {}
    for side in SIDES:
        model, opt, n_params = build(side)
        with torch.no_grad():
            snapshot = [t.clone() for t in tensors(model, opt)]
        sides[side] = (model, opt, snapshot)
    results = {"params": n_params, "save": {s: [] for s in SIDES},
               "load": {s: [] for s in SIDES}, "bytes": {s: [] for s in SIDES},
               "mismatch": {s: 0 for s in SIDES}}
    n = 0
    for i in range(args["warmup"] + args["rounds"]):
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        for side in order:
            model, opt, snapshot = sides[side]
            path = os.path.join(base, f"{side}_{n}")
            n += 1
            t_save = timed(lambda: save(side, model, opt, path))  # noqa: B023 - called now
            size = 0
            if rank == 0:
                size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
            with torch.no_grad():
                for t in tensors(model, opt):
                    t.zero_()
                zeroed = not any(t.any() for t in tensors(model, opt))
            t_load = timed(lambda: load(side, model, opt, path))  # noqa: B023 - called now
            with torch.no_grad():
                ok = all(torch.equal(a, b) for a, b in zip(tensors(model, opt), snapshot,
                                                              strict=True))
            flag = torch.tensor([0 if ok and zeroed else 1])
            dist.all_reduce(flag)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            if i >= args["warmup"]:
                results["save"][side].append(t_save)
                results["load"][side].append(t_load)
                results["bytes"][side].append(size)
                results["mismatch"][side] += int(flag.item())
            if rank == 0 and args["verbose"]:
                print(f"    [{'warmup' if i < args['warmup'] else 'round'} {i}] {side}: save "
                      f"{t_save:.2f} s, load {t_load:.2f} s, {size / 1e6:.0f} MB, "
                      f"{'ok' if ok and zeroed else 'MISMATCH'}", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def part2(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO))
    os.environ["OMP_NUM_THREADS"] = "1"
    print(f"## Part 2: checkpoint save / load, meshrun.parallel.checkpoint vs torch DCP "
          f"(2 ranks, gloo, {args.ckpt_rounds} timed rounds each after {args.ckpt_warmup} "
          f"warm-up, alternating)\n")
    root = args.ckpt_root or tempfile.gettempdir()
    base = tempfile.mkdtemp(prefix="elastic_ckpt_", dir=root)
    out = os.path.join(base, "results.json")
    try:
        wargs = {"width": args.ckpt_width, "layers": args.ckpt_layers,
                 "rounds": args.ckpt_rounds, "warmup": args.ckpt_warmup,
                 "verbose": args.verbose}
        mp.spawn(ckpt_worker, args=(free_port(), wargs, base, out), nprocs=2)
        res = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    n_params = res["params"]
    sizes = {s: statistics.median(res["bytes"][s]) for s in SIDES}
    print(f"model: {args.ckpt_layers} x nn.Linear({args.ckpt_width}, {args.ckpt_width}) + head, "
          f"{n_params / 1e6:.1f}M fp32 parameters + AdamW exp_avg / exp_avg_sq; checkpoint "
          f"size: meshrun {sizes['meshrun'] / 1e6:.1f} MB, DCP {sizes['dcp'] / 1e6:.1f} MB "
          f"(sum of file sizes); written under {root}\n")
    print("| op | meshrun (s) | DCP (s) | meshrun GB/s | DCP GB/s | ratio meshrun / DCP "
          "(time) |")
    print("|---|---|---|---|---|---|")
    ratios = {}
    for op in ("save", "load"):
        med = {s: statistics.median(res[op][s]) for s in SIDES}
        ratios[op] = med["meshrun"] / med["dcp"]
        print(f"| {op} | {med['meshrun']:.2f} | {med['dcp']:.2f} | "
              f"{sizes['meshrun'] / 1e9 / med['meshrun']:.2f} | "
              f"{sizes['dcp'] / 1e9 / med['dcp']:.2f} | {ratios[op]:.2f}x |")
    for op in ("save", "load"):
        runs = "; ".join(f"{s}: " + ", ".join(f"{v:.2f}" for v in res[op][s]) for s in SIDES)
        print(f"\n{op} runs (s): {runs}", end="")
    print("\n")
    worst = max(ratios.values())
    print(f"target (meshrun at most 1.2x DCP's time, save and load): "
          f"{'met' if worst <= 1.2 else 'MISSED'} (worst {worst:.2f}x)")
    bad = {s: res["mismatch"][s] for s in SIDES if res["mismatch"][s]}
    print("loaded values equal the saved ones: " + ("yes, every round, both sides" if not bad
                                                    else f"NO: mismatching rounds {bad}"))
    print("\nTimes: from a barrier to the end of the call on each rank (state dicts built "
          "inside the timed region on both sides: meshrun's model_state / optimizer_state "
          "views, DCP's get_state_dict, and set_state_dict after dcp.load); the slower rank "
          "counts. The warm-up round is not counted: the first save in a process pays DCP's "
          "one-time costs, whichever side goes first. Both sides use DCP's FileSystemWriter "
          "defaults (one thread per rank, fsync of every file); meshrun also writes into "
          "`<path>.partial` and renames it. Dropping the page cache is not possible here, so "
          "loads read what the save just wrote, mostly from memory: both sides alike.\n")


# -- part 3: what the neighbour copies cost per step ------------------------------------------
# 2 ranks (torch.multiprocessing, gloo, one thread each), each posing as its own node
# (GROUP_RANK), train the example's char LM (its defaults: batch 8 x 64 tokens) under
# meshrun's fully_shard (a unit per block, then the root) with AdamW. Modes: no copies,
# copies refreshed every step, every ``--copy-every`` steps; each round runs a block of
# ``--copy-block`` steps per mode, back to back, the order rotating. The cost of a mode is the
# median over the rounds of its block's time over that round's block without copies, - 1
# (pairing within a round cancels the load's drift); the copies' own time at a refresh step's
# end is printed beside it (as `meshrun.parallel.elastic` does it: `Copies.exchange`;
# packing, the exchange and the confirming all-reduce, all on the step's critical path), and
# that time per step over the step without copies as a second cost; then the floor: the same
# bytes exchanged with nothing else, and the all-reduce. Target: at most 5 % of step time at
# the interval chosen.


def copies_worker(rank: int, port: int, args: dict, out: str) -> None:
    """Part 3, one of the 2 ranks: the example's char LM under meshrun's fully_shard, AdamW,
    trained in blocks of ``block`` steps per mode, the modes' order rotating per round."""
    import torch
    import torch.distributed as dist
    from _common import init_gloo_pair, make_char_lm

    init_gloo_pair(rank, port)
    os.environ["GROUP_RANK"] = str(rank)  # two nodes of one rank: each keeps the other's rows
    sys.path.insert(0, str(REPO / "examples"))
    from char_lm.parallelize import apply_fsdp

    from meshrun.parallel.fsdp.copies import Copies

    model, batch, loss_fn = make_char_lm()
    apply_fsdp(model, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optimizer, "step": 0}
    modes = {"off": None, "every 1": Copies(1), f"every {args['every']}": Copies(args["every"])}
    times = {m: [] for m in modes}
    refresh = {m: [] for m in modes}

    def step(copies):
        x, y = batch(state["step"], rank)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        optimizer.step()
        state["step"] += 1
        if copies is None:
            return None
        t0 = time.perf_counter()  # the step's end, as elastic.steps does it (finish_step)
        ran = copies.exchange(state, 0)
        return time.perf_counter() - t0 if ran else None

    for _ in range(args["warmup"]):
        step(modes[f"every {args['every']}"])
    names = list(modes)
    for r in range(args["rounds"]):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args["block"]):
                took = step(modes[name])
                if took is not None:
                    refresh[name].append(took)
            dt = torch.tensor([(time.perf_counter() - t0) / args["block"]], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slower rank counts
            times[name].append(dt.item())
    # the floor under the copies: the same bytes sent and received with nothing else (one
    # batch_isend_irecv to the other rank and the confirming one-element all-reduce)
    copies = modes["every 1"]
    nbytes = next(iter(copies.held.values())).packed.numel()
    send = torch.empty(nbytes, dtype=torch.uint8)
    recv = torch.empty(nbytes, dtype=torch.uint8)
    bare = []
    for i in range(30):
        dist.barrier()
        t0 = time.perf_counter()
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, 1 - rank),
                                            dist.P2POp(dist.irecv, recv, 1 - rank)]):
            work.wait()
        dist.all_reduce(torch.zeros(1))
        if i >= 5:
            bare.append(time.perf_counter() - t0)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters()) * 2  # each rank: half the rows
        Path(out).write_text(json.dumps({"times": times, "refresh": refresh,
                                         "params": n_params, "bare": bare,
                                         "nbytes": nbytes}))
    dist.barrier()
    dist.destroy_process_group()


def part3(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO))
    os.environ["OMP_NUM_THREADS"] = "1"
    every = args.copy_every
    print(f"## Part 3: the cost of neighbour copies (meshrun.parallel.fsdp.copies) per step "
          f"(2 ranks posing as 2 nodes, gloo; the example's char LM under fully_shard, AdamW; "
          f"{args.copy_rounds} rounds of {args.copy_block} steps per mode, the order rotating, "
          f"after {args.copy_warmup} warm-up steps)\n")
    base = tempfile.mkdtemp(prefix="elastic_copies_")
    out = os.path.join(base, "results.json")
    try:
        wargs = {"every": every, "rounds": args.copy_rounds, "block": args.copy_block,
                 "warmup": args.copy_warmup}
        mp.spawn(copies_worker, args=(free_port(), wargs, out), nprocs=2)
        res = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    times = res["times"]
    med = {m: statistics.median(v) for m, v in times.items()}
    # each round ran every mode back to back: its ratio to that round's "off" block cancels
    # the load's drift from round to round; the median over the rounds is the cost
    paired = {m: statistics.median(t / o for t, o in zip(v, times["off"], strict=True)) - 1
              for m, v in times.items()}
    print(f"model: {res['params'] / 1e6:.2f}M parameters (each rank holds half the rows, and "
          f"with copies the other rank's half too: parameters and AdamW's two moments)\n")
    # the copies run at the step's end, on its critical path: their own time per step (the
    # refresh's median over the interval) against the step without copies is their cost too,
    # and far less noisy than a difference of whole blocks on a shared 2-core machine
    direct = {m: (statistics.median(res["refresh"][m]) / int(m.split()[1]) / med["off"]
                  if res["refresh"][m] else 0.0) for m in times}
    print("| copies | step (ms, median of blocks) | cost: median over rounds of the block's "
          "time / that round's off block, - 1 | the copies at a refresh step's end alone "
          "(ms, median: pack, exchange, confirm) | cost: that time per step / the step "
          "without copies |")
    print("|---|---|---|---|---|")
    for m, t in med.items():
        ref = statistics.median(res["refresh"][m]) * 1e3 if res["refresh"][m] else None
        print(f"| {m} | {t * 1e3:.1f} | {paired[m]:+.1%} | "
              f"{'' if ref is None else f'{ref:.1f}'} | {direct[m]:+.1%} |")
    print(f"\nthe floor: the same {res['nbytes'] / 1e6:.1f} MB sent to and received from the "
          f"other rank with nothing else, and the one-element all-reduce: "
          f"{statistics.median(res['bare']) * 1e3:.1f} ms (median of 25)")
    blocks = "; ".join(f"{m}: " + ", ".join(f"{v * 1e3:.0f}" for v in vals)
                       for m, vals in times.items())
    print(f"\nblocks (ms/step): {blocks}\n")
    chosen = f"every {every}"
    verdict = "; ".join(
        f"{m}: {'met' if paired[m] <= 0.05 else 'MISSED'} by blocks ({paired[m]:+.1%}), "
        f"{'met' if direct[m] <= 0.05 else 'MISSED'} by the copies' own time "
        f"({direct[m]:+.1%})" for m in ("every 1", chosen))
    print(f"target (copies at most 5 % of step time at the interval chosen): {verdict}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("1", "2", "3", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=3, help="part 1: rounds per launcher")
    ap.add_argument("--cap", type=float, default=120.0,
                    help="part 1: seconds to wait for recovery after the kill")
    ap.add_argument("--setup-cap", type=float, default=120.0,
                    help=f"part 1: seconds to wait for a two-node round and step_{KILL_AT}")
    ap.add_argument("--steps", type=int, default=200, help="part 1: the example's --steps")
    ap.add_argument("--dp-mode", choices=("ddp", "fsdp"), default="ddp",
                    help="part 1: the example's --dp-mode (fsdp: in place from the neighbour "
                         "copies, every step)")
    ap.add_argument("--ckpt-rounds", type=int, default=5, help="part 2: timed rounds per side")
    ap.add_argument("--ckpt-warmup", type=int, default=1, help="part 2: untimed rounds")
    ap.add_argument("--ckpt-width", type=int, default=2048)
    ap.add_argument("--ckpt-layers", type=int, default=12)
    ap.add_argument("--ckpt-root", default=None,
                    help="part 2: where to write checkpoints (default: the temp directory)")
    ap.add_argument("--keep-logs", default=None, metavar="DIR",
                    help="part 1: write every round's agent logs here")
    ap.add_argument("--copy-every", type=int, default=4,
                    help="part 3: the refresh interval measured beside every 1 and off")
    ap.add_argument("--copy-rounds", type=int, default=12, help="part 3: blocks per mode")
    ap.add_argument("--copy-block", type=int, default=8, help="part 3: steps per block")
    ap.add_argument("--copy-warmup", type=int, default=4, help="part 3: untimed steps")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    began = print_start()
    if args.part in ("1", "all"):
        part1(args)
    if args.part in ("2", "all"):
        part2(args)
    if args.part in ("3", "all"):
        part3(args)
    print_end(began)
    return 0


if __name__ == "__main__":
    sys.exit(main())
