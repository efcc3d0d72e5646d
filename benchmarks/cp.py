"""Context parallelism: activation memory per rank and step time, CP 1 vs CP 2 (ring, Ulysses).

    .venv/bin/python benchmarks/cp.py [--lengths 512,1024,2048,4096] [--steps 3] [--rounds 2]

The example's char LM (examples/char_lm/model.py: 4 blocks, 4 heads, n_embd 128, causal), one
sequence of L tokens per step, SGD. CP 1 is the unchanged model in one process (torch's SDPA,
its fused CPU kernel); CP 2 is two gloo processes, each holding L / 2 tokens in the zigzag
layout, with every block's attention replaced by `ring_attention` or `ulysses_attention` and
the gradients averaged by meshrun's ddp (part of the step). One thread per rank throughout.
The configurations alternate for ``--rounds`` rounds, each run a fresh set of processes.

- step time: median of rank 0's wall time of zero_grad + forward + backward + step; and its
  CPU time (``time.process_time``, all of the process's threads), which a loaded machine
  disturbs less: a rank that waits for a descheduled peer spends wall time, not CPU time;
- activations per rank: bytes of the tensors autograd saves in one forward
  (``saved_tensors_hooks``; parameters excluded, a storage counted once), plus, for the ring,
  its in-flight key/value buffers (the one held and the one arriving: 2 x 2 x B H L/2 D
  floats; they live during one attention call, so they count once, not per layer);
- bytes sent per rank and step by the attention (``batch_isend_irecv`` and
  ``all_to_all_single`` counted as called; an all-to-all keeps 1/cp of its input) and by the
  gradient all-reduce (counted as ring all-reduce traffic, 2 (cp-1)/cp x the gradients).

torch's experimental ``context_parallel`` is tried once at the start, on 2 gloo ranks; on CPU
it fails (no DTensor sharding rule for ``_scaled_dot_product_flash_attention_for_cpu``), and
the benchmark prints its error instead of a column.
"""

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]
from _common import print_end, print_start, report_rank, spawn_ranks  # noqa: E402

VOCAB, BATCH = 65, 1
CONFIGS = (("cp1", 1, None), ("ring", 2, "ring"), ("ulysses", 2, "ulysses"))


def init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")


def count_sends():
    """Wrap the attention's collectives: a list that collects the bytes each sends."""
    sent = []
    batch, a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def batch_isend_irecv(ops):
        sent.extend(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return batch(ops)

    def all_to_all_single(out, inp, *args, **kwargs):
        cp = dist.get_world_size(kwargs.get("group"))
        sent.append(inp.nbytes * (cp - 1) // cp)
        return a2a(out, inp, *args, **kwargs)

    dist.batch_isend_irecv, dist.all_to_all_single = batch_isend_irecv, all_to_all_single
    return sent


def worker(rank, world, mode, length, steps, warmup, port, out_dir):
    init(rank, world, port)
    import char_lm as lm

    from meshrun.parallel import ddp
    from meshrun.parallel.cp import CP_MODES, position_ids, shard_sequence

    torch.manual_seed(0)
    model = lm.CharLM(VOCAB, length)
    pos = None
    if world > 1:
        for block in model.blocks:
            block.attention = partial(CP_MODES[mode], group=None, causal=True, layout="zigzag")
        ddp(model)
        pos = position_ids(length, rank, world, "zigzag")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sent = count_sends()

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(VOCAB, (2, BATCH, length), generator=g)
        if world > 1:
            x, y = (shard_sequence(t, rank, world, "zigzag") for t in (x, y))
        return x, y

    times, cpu, sent_per_step = [], [], []
    for step in range(warmup + steps):
        x, y = batch(step)
        sent.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        model(x, y, pos).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        sent_per_step.append(sum(sent))
    saved = activation_bytes(model, *batch(0), pos)
    if mode == "ring":  # the ring's buffers: the K/V block held and the one arriving
        head_dim = model.blocks[0].head_dim
        saved += 2 * 2 * BATCH * model.blocks[0].n_head * (length // world) * head_dim * 4
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    report_rank(out_dir, rank, {"times": times[warmup:], "cpu": cpu[warmup:], "act": saved,
                                "attn_sent": sent_per_step[-1],
                                "grad_sent": 2 * (world - 1) * grads // world})
    dist.destroy_process_group()


def activation_bytes(model, x, y, pos) -> int:
    """Bytes autograd saves for backward in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y, pos)
    loss.backward()
    return total


def torch_cp_worker(rank, port, out_dir):
    """torch's context_parallel on one SDPA call (2 gloo ranks): "ok" or its error."""
    init(rank, 2, port)
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(1, 4, 64, 32) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        outcome = "ok"
    except Exception as e:  # report, do not crash the benchmark
        cause = e.__context__ if e.__context__ is not None else e
        outcome = f"{type(cause).__name__}: {str(cause).splitlines()[0]}"
    report_rank(out_dir, rank, {"outcome": outcome})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description="context parallelism: CP 1 vs CP 2 (gloo, CPU)")
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="runs per configuration, alternating")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    began = print_start()
    print("model: examples/char_lm CharLM (4 blocks, 4 heads, n_embd 128), batch 1, causal; "
          "CP 2 in the zigzag layout; one thread per rank\n")
    torch_cp = spawn_ranks(2, torch_cp_worker, lambda port, out: (port, out))[0]["outcome"]
    print(f"torch context_parallel on CPU/gloo: {torch_cp}\n")

    print("| L | mode | ms/step | vs CP 1 / 2 | CPU ms/step | vs CP 1 / 2 | activations "
          "MiB/rank | vs CP 1 | attention MiB sent/rank/step | gradient MiB sent/rank/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        times = {name: [] for name, _, _ in CONFIGS}
        cpus = {name: [] for name, _, _ in CONFIGS}
        last = {}
        for _ in range(args.rounds):
            for name, world, mode in CONFIGS:
                ranks = spawn_ranks(world, worker, lambda port, out, w=world, m=mode, n=length: (
                    w, m, n, args.steps, args.warmup, port, out))
                times[name] += ranks[0]["times"]
                cpus[name] += ranks[0]["cpu"]
                last[name] = ranks
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        cpu_ms = {name: 1000 * statistics.median(t) for name, t in cpus.items()}
        act1 = last["cp1"][0]["act"]
        for name, _, _ in CONFIGS:
            act = max(r["act"] for r in last[name])
            speed = f"{ms[name] / (ms['cp1'] / 2):.2f}x" if name != "cp1" else ""
            cpu_speed = f"{cpu_ms[name] / (cpu_ms['cp1'] / 2):.2f}x" if name != "cp1" else ""
            memory = f"{act / act1:.3f}x" if name != "cp1" else ""
            print(f"| {length} | {name} | {ms[name]:.0f} | {speed} | {cpu_ms[name]:.0f} | "
                  f"{cpu_speed} | {act / 2**20:.2f} | "
                  f"{memory} | {last[name][0]['attn_sent'] / 2**20:.2f} | "
                  f"{last[name][0]['grad_sent'] / 2**20:.2f} |", flush=True)
    print()
    print_end(began)


if __name__ == "__main__":
    main()
