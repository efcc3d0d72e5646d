"""meshrun tensor parallelism vs torch DTensor ``parallelize_module``: step time and memory.

    .venv/bin/python benchmarks/tp.py [--steps 20] [--warmup 5] [--rounds 2]

The same transformer block (examples/char_lm/model.py's ``Block``: fused qkv, causal
attention, 4x GELU MLP; n_embd 256, 8 heads, batch 8 x 128 tokens), 2 ranks on gloo (CPU, one
thread per rank), with and without sequence parallelism. DTensor shards the fused ``qkv``
rows contiguously, so its weight rows are permuted first ([q0 k0 v0 q1 k1 v1]) to give each
rank whole heads, as meshrun's ``chunks=3`` does: both compute the same function (the step-0
losses are printed). Every (mode, sp) run is a fresh pair of processes; the frameworks
alternate for ``--rounds`` rounds so drift on a shared machine hits both.

- step time: median over all timed steps of rank 0's wall time for zero_grad + forward +
  backward + SGD step;
- peak RSS: ``ru_maxrss`` at the end, MiB, the larger of the two ranks (includes torch);
- activations: bytes of the tensors autograd saves for backward in one forward of the block,
  per rank (``saved_tensors_hooks``; parameters excluded, a storage counted once), MiB.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]
from _common import report_rank, spawn_ranks  # noqa: E402 - beside this file

N_EMBD, N_HEAD, BATCH, SEQ = 256, 8, 8, 128
FRAMEWORKS = ("dtensor", "meshrun")


def plans(framework, sp):
    from torch.distributed.tensor import Replicate, Shard

    seq = Shard(1) if sp else Replicate()
    if framework == "meshrun":
        from meshrun.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        qkv = ColwiseParallel(input_layouts=seq, chunks=3)
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        qkv = ColwiseParallel(input_layouts=seq)
    plan = {"qkv": qkv, "proj": RowwiseParallel(output_layouts=seq),
            "mlp.0": ColwiseParallel(input_layouts=seq),
            "mlp.2": RowwiseParallel(output_layouts=seq)}
    if sp:
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
    return plan


def interleave_qkv(block, tp):
    """Permute fused qkv rows to [q0 k0 v0 q1 k1 v1]: contiguous shards hold whole heads."""
    with torch.no_grad():
        for p in (block.qkv.weight, block.qkv.bias):
            chunks = p.data.unflatten(0, (3, tp, -1)).transpose(0, 1)
            p.data = chunks.reshape(p.shape).contiguous()


def worker(rank, framework, sp, port, steps, warmup, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import char_lm as lm

    torch.manual_seed(0)
    block = lm.Block(N_EMBD, N_HEAD)
    if framework == "meshrun":
        from meshrun.parallel import parallelize

        parallelize(block, None, plans(framework, sp))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        interleave_qkv(block, 2)
        parallelize_module(block, init_device_mesh("cpu", (2,)), plans(framework, sp))
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    seq = SEQ // 2 if sp else SEQ

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, SEQ, N_EMBD, generator=g)
        return x.chunk(2, 1)[rank].contiguous() if sp else x

    def total_of(loss):  # under SP each rank holds half the tokens: sum the halves
        total = loss.detach().clone()
        if sp:
            dist.all_reduce(total)
        return total.item()

    times, first_loss = [], None
    for step in range(warmup + steps):
        x = batch(step)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = block(x).pow(2).sum() / (BATCH * SEQ * N_EMBD)  # mean over the global batch
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if first_loss is None:
            first_loss = total_of(loss)
    saved = activation_bytes(block, batch(0))
    assert batch(0).shape[1] == seq
    report_rank(out_dir, rank, {"times": times[warmup:], "act_mib": saved / 2**20,
                                "loss0": first_loss})
    dist.destroy_process_group()


def activation_bytes(block, x) -> int:
    """Bytes autograd saves for backward in one forward (parameters excluded)."""
    params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr()
              for p in block.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        local = getattr(t, "_local_tensor", t)
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)  # the block's activations only, not the loss's
    y.pow(2).sum().backward()
    return total



def run(framework, sp, steps, warmup):
    return spawn_ranks(2, worker, lambda port, out: (framework, sp, port, steps, warmup, out))


def main():
    p = argparse.ArgumentParser(description="meshrun TP vs DTensor TP (2 ranks, gloo)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="runs per framework, alternating")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"

    print(f"command: python benchmarks/tp.py --steps {args.steps} --warmup {args.warmup} "
          f"--rounds {args.rounds}")
    print(f"block: n_embd {N_EMBD}, {N_HEAD} heads, batch {BATCH} x {SEQ} tokens, tp 2, gloo\n")
    print("| mode | ms/step meshrun | ms/step DTensor | ratio | peak RSS MiB meshrun | "
          "peak RSS MiB DTensor | activations MiB/rank meshrun | activations MiB/rank DTensor "
          "| step-0 loss meshrun / DTensor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for sp in (False, True):
        times = {f: [] for f in FRAMEWORKS}
        rss = {f: 0.0 for f in FRAMEWORKS}
        act, loss0 = {}, {}
        for _ in range(args.rounds):
            for framework in FRAMEWORKS:
                ranks = run(framework, sp, args.steps, args.warmup)
                times[framework] += ranks[0]["times"]
                rss[framework] = max(rss[framework], *(r["rss_mib"] for r in ranks))
                act[framework] = max(r["act_mib"] for r in ranks)
                loss0[framework] = ranks[0]["loss0"]
        ms = {f: 1000 * statistics.median(times[f]) for f in FRAMEWORKS}
        print(f"| {'TP + SP' if sp else 'TP'} | {ms['meshrun']:.1f} | {ms['dtensor']:.1f} | "
              f"{ms['meshrun'] / ms['dtensor']:.3f}x | {rss['meshrun']:.0f} | "
              f"{rss['dtensor']:.0f} | {act['meshrun']:.2f} | {act['dtensor']:.2f} | "
              f"{loss0['meshrun']:.6f} / {loss0['dtensor']:.6f} |", flush=True)


if __name__ == "__main__":
    main()
