"""meshrun fully_shard vs torch FSDP2 fully_shard vs meshrun ddp: step time and memory.

    .venv/bin/python benchmarks/fsdp.py [--steps 20] [--warmup 5] [--rounds 2]
                                        [--models mlp-blocks char-lm] [--mmap-threshold BYTES]
                                        [--hsdp | --compile]

Same model, same data, 2 ranks on gloo (CPU, one thread per rank), Adam. The FSDP modes shard
each block, then the root (``reshard_after_forward=True``: ZeRO-3). Every (model, mode) run is
a fresh pair of processes, so peak RSS belongs to that mode alone; the modes alternate for
``--rounds`` rounds so drift on a shared machine hits all of them. Columns:

- ms/step: median over the timed steps of rank 0's wall time for zero_grad + forward +
  backward (incl. communication) + optimizer step.
- state MiB: bytes of parameters + gradients + optimizer state that rank holds after a step
  (local shards for FSDP: ``DTensor.to_local()`` for torch's), max over ranks, MiB (2**20).
- peak RSS MiB: ``ru_maxrss`` of the process, max over ranks (includes torch itself, ~300 MiB).
  With glibc's default malloc, the FSDP modes' RSS grows over the first steps far above their
  tensors: the per-unit transient buffers (gathered parameters, packed gradients) are freed
  and reallocated every step and glibc's dynamic mmap threshold moves them onto the heap,
  which fragments. ``--mmap-threshold 1048576`` (``MALLOC_MMAP_THRESHOLD_`` for the workers,
  every mode alike) keeps large buffers in mmap and shows the RSS the tensors need.
- The target for meshrun fully_shard: state <= ddp's / N + one unit's unsharded parameters
  (printed as "bound"), and step time <= 1.2x torch FSDP2's.

``--hsdp``: instead, HSDP on 4 ranks: meshrun ``fully_shard(module, mesh=Mesh({"dp_replicate":
2, "dp_shard": 2}))`` against torch FSDP2's ``fully_shard(module, mesh=init_device_mesh("cpu",
(2, 2), mesh_dim_names=("dp_replicate", "dp_shard")))``, both sharding each block then the
root, with meshrun ddp over the 4 ranks as the unsharded reference: each rank holds half of
every parameter, gradient and optimizer state (sharded over 2, replicated over 2), so state
<= ddp's / 2 + one unit's unsharded parameters; per-rank batch as above; the MLP only (the
char-LM batches are cut for 2 ranks). Four ranks share the machine's cores, so the times
compare the libraries, not a cluster.

``--compile``: instead, eager vs compiled, meshrun ``fully_shard`` beside torch FSDP2's on 2
ranks, each sharding every block then the root, and compiled the same way: after sharding,
each block's ``forward`` becomes ``torch.compile(block.forward, fullgraph=True)`` (inductor,
the default backend; the units' gather/reduce-scatter hooks run eagerly around the graph:
torchtitan's per-block compile). The four modes live in one process pair and take one step
each in turn (the order rotating), so a loaded machine slows them alike; ``--rounds`` fresh
pairs. ``--warmup`` must cover the compile (a cold inductor compile takes seconds per graph;
"step 0 s" shows it; with a cold cache the first compiled mode to run pays it). "CPU ms/step"
is ``time.process_time()`` of rank 0's process (every thread): the work done, which waiting
for a core on a loaded machine does not inflate as it does the wall time. Graphs and graph
breaks: ``torch._dynamo.utils.counters``, rank 0, per mode. The target: compiled meshrun
<= 1.1x compiled FSDP2. The MLP only by default.

gloo has no native reduce-scatter: it emulates it (a reduce then a scatter, or an all-reduce),
so these CPU times measure the library's overhead and overlap, not GPU (NCCL) times.

Models: "mlp-blocks" (8 residual MLP blocks 512 -> 2048 -> 512, ~16.8M parameters, batch 32
per rank) and examples/train_char_lm.py's CharLM at its default size (batch 16 x 64 tokens).
"""

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]
from _common import make_char_lm, report_rank, spawn_ranks  # noqa: E402 - beside this file

MODES = ("torch-fsdp2", "meshrun-fsdp", "meshrun-ddp")
HSDP_MODES = ("torch-hsdp", "meshrun-hsdp", "meshrun-ddp")
COMPILE_MODES = ("torch-fsdp2", "torch-fsdp2+compile", "meshrun-fsdp", "meshrun-fsdp+compile")
HSDP_SHAPE = {"dp_replicate": 2, "dp_shard": 2}
MiB = 2 ** 20


class MLPBlock(nn.Module):
    def __init__(self, width=512, hidden=2048):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class MLPBlocks(nn.Module):
    def __init__(self, n_blocks=8, width=512):
        super().__init__()
        self.inp = nn.Linear(256, width)
        self.blocks = nn.Sequential(*[MLPBlock(width) for _ in range(n_blocks)])
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def make_mlp():
    model = MLPBlocks()

    def batch(step, rank):
        g = torch.Generator().manual_seed(step * 2 + rank)
        return torch.randn(32, 256, generator=g), torch.randint(10, (32,), generator=g)

    def loss_fn(m, x, y):
        return nn.functional.cross_entropy(m(x), y)

    return model, batch, loss_fn



MODELS = {"mlp-blocks": make_mlp, "char-lm": make_char_lm}


def apply_mode(model, mode):
    blocks = list(model.blocks)
    if mode.endswith("+compile"):  # shard as the eager mode does, then compile each block
        model = apply_mode(model, mode.removesuffix("+compile"))
        for block in blocks:
            block.forward = torch.compile(block.forward, fullgraph=True)
        return model
    if mode == "meshrun-ddp":
        from meshrun.parallel import ddp

        return ddp(model)
    if mode == "meshrun-fsdp":
        from meshrun.parallel import fully_shard

        shard, kwargs = fully_shard, {}
    elif mode == "meshrun-hsdp":
        from meshrun.parallel import Mesh, fully_shard

        shard, kwargs = fully_shard, {"mesh": Mesh(HSDP_SHAPE)}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as shard

        shape = (tuple(HSDP_SHAPE.values()), tuple(HSDP_SHAPE)) if mode == "torch-hsdp" \
            else ((2,), None)
        kwargs = {"mesh": init_device_mesh("cpu", shape[0], mesh_dim_names=shape[1])}
    for block in blocks:
        shard(block, **kwargs)
    return shard(model, **kwargs)


def local_bytes(t):
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model, opt):
    params = list(model.parameters())
    total = sum(local_bytes(p) for p in params)
    total += sum(local_bytes(p.grad) for p in params if p.grad is not None)
    total += sum(local_bytes(v) for s in opt.state.values() for v in s.values()
                 if torch.is_tensor(v))
    return total


def largest_unit_bytes(model):
    """Bytes of the largest unit's unsharded parameters (a block, or the root's rest)."""
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)
    return max(block, rest)


def worker(rank, model_name, mode, port, steps, warmup, out_dir, world=2):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model, batch, loss_fn = MODELS[model_name]()
    n_params = sum(p.numel() for p in model.parameters())
    unit_bytes = largest_unit_bytes(model)
    model = apply_mode(model, mode)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = []
    for step in range(warmup + steps):
        x, y = batch(step, rank)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    report_rank(out_dir, rank, {"times": times[warmup:], "params": n_params,
                                "state_mib": state_bytes(model, opt) / MiB,
                                "unit_mib": unit_bytes / MiB})
    dist.destroy_process_group()



def compile_worker(rank, model_name, port, steps, warmup, out_dir):
    """``--compile``: the four `COMPILE_MODES` in one process pair, one step each in turn
    (the order rotating every step), so the machine's load hits them alike."""
    from torch._dynamo.utils import counters

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runs = {}
    for mode in COMPILE_MODES:
        torch.manual_seed(0)
        model, batch, loss_fn = MODELS[model_name]()
        model = apply_mode(model, mode)
        runs[mode] = (model, torch.optim.Adam(model.parameters(), lr=1e-4))
    out = {m: {"times": [], "cpu": [], "first": 0.0, "graphs": 0, "breaks": 0}
           for m in COMPILE_MODES}
    for step in range(warmup + steps):
        x, y = batch(step, rank)
        k = step % len(COMPILE_MODES)
        for mode in COMPILE_MODES[k:] + COMPILE_MODES[:k]:
            model, opt = runs[mode]
            graphs, breaks = counters["stats"]["unique_graphs"], sum(
                counters["graph_break"].values())
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            loss_fn(model, x, y).backward()
            opt.step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            mine = out[mode]
            mine["graphs"] += counters["stats"]["unique_graphs"] - graphs
            mine["breaks"] += sum(counters["graph_break"].values()) - breaks
            if step == 0:
                mine["first"] = wall
            elif step >= warmup:
                mine["times"].append(wall)
                mine["cpu"].append(cpu)
    report_rank(out_dir, rank, out)
    dist.destroy_process_group()


def run(model_name, mode, steps, warmup, world=2):
    return spawn_ranks(world, worker, lambda port, out: (model_name, mode, port, steps, warmup,
                                                         out, world))


def main():
    p = argparse.ArgumentParser(description="meshrun fully_shard vs torch FSDP2 vs meshrun ddp")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="runs per mode, alternating")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None,
                   help="default: both (--hsdp: mlp-blocks)")
    p.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="set MALLOC_MMAP_THRESHOLD_ for the workers (glibc; see above)")
    p.add_argument("--hsdp", action="store_true",
                   help="HSDP on 4 ranks (2 replicas x 2 shards) vs torch FSDP2's HSDP")
    p.add_argument("--compile", action="store_true",
                   help="eager vs per-block torch.compile (inductor), meshrun vs torch FSDP2")
    args = p.parse_args()
    if args.hsdp and args.compile:
        p.error("--hsdp and --compile are separate tables: give one")
    if args.models is None:
        args.models = ["mlp-blocks"] if args.hsdp or args.compile else list(MODELS)
    if args.hsdp and "char-lm" in args.models:
        p.error("--hsdp runs 4 ranks, but the char-lm batches (benchmarks/_common.py) are cut "
                "for 2 ranks: use --models mlp-blocks")
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)

    threshold = "" if args.mmap_threshold is None else f" --mmap-threshold {args.mmap_threshold}"
    if args.compile:
        return compile_table(args, threshold)
    world, modes, peer = (4, HSDP_MODES, "torch-hsdp") if args.hsdp else (2, MODES, "torch-fsdp2")
    print(f"`python benchmarks/fsdp.py --steps {args.steps} --warmup {args.warmup} "
          f"--rounds {args.rounds} --models {' '.join(args.models)}{threshold}"
          f"{' --hsdp' if args.hsdp else ''}` ({world} ranks, gloo, CPU; load average "
          f"{os.getloadavg()[0]:.1f})\n")
    print(f"| model | params | mode | ms/step | vs {peer} | state MiB | vs ddp | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    shards = 2  # FSDP over 2 ranks, or HSDP's dp_shard axis
    for model_name in args.models:
        times = {m: [] for m in modes}
        rss = {m: 0.0 for m in modes}
        state = {m: 0.0 for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                ranks = run(model_name, mode, args.steps, args.warmup, world)
                times[mode] += ranks[0]["times"]
                rss[mode] = max(rss[mode], *(r["rss_mib"] for r in ranks))
                state[mode] = max(state[mode], *(r["state_mib"] for r in ranks))
                params, unit_mib = ranks[0]["params"], ranks[0]["unit_mib"]
        ms = {m: 1000 * statistics.median(times[m]) for m in modes}
        for mode in modes:
            print(f"| {model_name} | {params / 1e6:.1f}M | {mode} | {ms[mode]:.1f} | "
                  f"{ms[mode] / ms[peer]:.2f}x | {state[mode]:.1f} | "
                  f"{state[mode] / state['meshrun-ddp']:.2f}x | {rss[mode]:.0f} |")
        bound = state["meshrun-ddp"] / shards + unit_mib
        print(f"| {model_name} | | bound | <= {1.2 * ms[peer]:.1f} | 1.20x | "
              f"<= {bound:.1f} (ddp/{shards} + largest unit {unit_mib:.1f}) | | |")


def compile_table(args, threshold):
    """``--compile``: eager and per-block compiled step times, meshrun and torch FSDP2."""
    print(f"`python benchmarks/fsdp.py --compile --steps {args.steps} --warmup {args.warmup} "
          f"--rounds {args.rounds} --models {' '.join(args.models)}{threshold}` (2 ranks, gloo, "
          f"CPU, inductor; load average {os.getloadavg()[0]:.1f})\n")
    print("| model | mode | ms/step | CPU ms/step | compiled / eager | vs torch-fsdp2, same mode "
          "| step 0 s | graphs | graph breaks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model_name in args.models:
        times = {m: [] for m in COMPILE_MODES}
        cpu = {m: [] for m in COMPILE_MODES}
        first = {m: [] for m in COMPILE_MODES}
        graphs = {}
        for _ in range(args.rounds):
            rank0 = spawn_ranks(2, compile_worker, lambda port, out, name=model_name: (
                name, port, args.steps, args.warmup, out))[0]
            for mode in COMPILE_MODES:
                times[mode] += rank0[mode]["times"]
                cpu[mode] += rank0[mode]["cpu"]
                first[mode].append(rank0[mode]["first"])
                graphs[mode] = (rank0[mode]["graphs"], rank0[mode]["breaks"])
        ms = {m: 1000 * statistics.median(times[m]) for m in COMPILE_MODES}
        cms = {m: 1000 * statistics.median(cpu[m]) for m in COMPILE_MODES}
        for mode in COMPILE_MODES:
            eager = mode.removesuffix("+compile")
            peer = "torch-fsdp2+compile" if mode.endswith("+compile") else "torch-fsdp2"
            print(f"| {model_name} | {mode} | {ms[mode]:.1f} | {cms[mode]:.1f} | "
                  f"{ms[mode] / ms[eager]:.2f}x (CPU {cms[mode] / cms[eager]:.2f}x) | "
                  f"{ms[mode] / ms[peer]:.2f}x (CPU {cms[mode] / cms[peer]:.2f}x) | "
                  f"{statistics.median(first[mode]):.1f} | {graphs[mode][0]} | "
                  f"{graphs[mode][1]} |")
        print(f"| {model_name} | target | <= {1.1 * ms['torch-fsdp2+compile']:.1f} | "
              f"<= {1.1 * cms['torch-fsdp2+compile']:.1f} | | 1.10x (compiled) | | | |")

if __name__ == "__main__":
    main()
