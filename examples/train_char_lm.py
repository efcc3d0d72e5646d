"""Train a small character-level transformer on Tiny Shakespeare (nanoGPT-style).

A plain torchrun script: it reads RANK / LOCAL_RANK / WORLD_SIZE from the environment, so it
runs unchanged under ``torchrun``, under ``meshrun``, or as plain ``python`` (one process):

    meshrun --nproc-per-node 2 examples/train_char_lm.py --steps 300 --checkpoint-dir ckpt
    torchrun --nproc-per-node 2 examples/train_char_lm.py --dp-mode torch-ddp

Data parallelism: ``--dp-mode ddp`` (default) uses ``meshrun.parallel.ddp``; ``torch-ddp`` uses
torch's ``DistributedDataParallel`` (the reference). Each step draws one global batch of random
windows from a generator seeded with (seed, step); rank r trains on its slice of it, so the
data depend only on the step number (a resumed run sees exactly the batches it would have).

Checkpoints (``--checkpoint-dir``): rank 0 writes model, optimizer, step and RNG state every
``--checkpoint-every`` steps and at the end, to a temporary file then ``os.replace`` (atomic),
so a kill mid-save never leaves a corrupt checkpoint. On start every rank resumes from it if
present (the directory must be visible to every rank). ``--fail-at-step S`` makes rank 0 raise
at step S on the first attempt (TORCHELASTIC_RESTART_COUNT=0), to show restart + resume.
"""

import argparse
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# -------------------------------------------------------------------------------------------
# config (defaults tuned so 300 steps on 2 CPU ranks take well under 3 minutes)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt")
N_LAYER, N_HEAD, N_EMBD = 4, 4, 128
DEFAULTS = dict(steps=300, batch_size=16, block_size=64, lr=3e-3, seed=1337, log_every=25,
                checkpoint_every=100)
# data-parallel strategies; --parallel X is a shorthand for the single-strategy cases
DP_MODES = ("ddp", "torch-ddp")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="per rank")
    p.add_argument("--block-size", type=int, default=DEFAULTS["block_size"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--log-every", type=int, default=DEFAULTS["log_every"])
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=DEFAULTS["checkpoint_every"])
    p.add_argument("--dp-mode", choices=DP_MODES, default="ddp")
    p.add_argument("--parallel", choices=DP_MODES, default=None, help="shorthand for --dp-mode")
    p.add_argument("--fail-at-step", type=int, default=None, help="testing: rank 0 raises here")
    args = p.parse_args(argv)
    if args.parallel is not None:
        args.dp_mode = args.parallel
    return args


# -------------------------------------------------------------------------------------------
# model: token + position embedding, pre-norm blocks (causal self-attention + MLP), norm, head


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok_emb(idx) + self.pos_emb(pos))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# -------------------------------------------------------------------------------------------
# data: one global batch of random windows per step, sliced by data-parallel rank


def load_text(path=DATA):
    with open(path) as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(chars)


def get_batch(data, step, seed, batch_size, block_size, dp_rank, dp_size):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - block_size - 1, (batch_size * dp_size,), generator=g)
    starts = starts[dp_rank * batch_size:(dp_rank + 1) * batch_size]
    x = torch.stack([data[s:s + block_size] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
    return x, y


# -------------------------------------------------------------------------------------------
# checkpoints: rank 0 writes to a temp file and renames it (atomic); every rank reads


def save_checkpoint(ckpt_dir, model, optimizer, step):
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, "ckpt.pt")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
             "rng": torch.get_rng_state()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(ckpt_dir, model, optimizer, device):
    path = os.path.join(ckpt_dir, "ckpt.pt") if ckpt_dir else None
    if path is None or not os.path.exists(path):
        return 0
    state = torch.load(path, map_location=device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"].cpu())
    return state["step"]


# -------------------------------------------------------------------------------------------
# data-parallel wrapping: one function per strategy


def apply_ddp(model, device):
    try:  # imported only here: torch-ddp mode needs no meshrun
        from meshrun.parallel import ddp
    except ImportError as e:
        raise SystemExit(f"--dp-mode ddp needs meshrun importable ({e}): `pip install -e .` "
                         f"or set PYTHONPATH to the repository root") from None
    return ddp(model), model


def apply_torch_ddp(model, device):
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids), model  # (wrapped, raw for state)


STRATEGIES = {"ddp": apply_ddp, "torch-ddp": apply_torch_ddp}


def main(argv=None):
    args = parse_args(argv)
    distributed = "RANK" in os.environ
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=120))
    master = rank == 0

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP broadcasts anyway)
    data, vocab_size = load_text()
    model = CharLM(vocab_size, args.block_size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    start = load_checkpoint(args.checkpoint_dir, model, optimizer, device)
    if master and start:
        print(f"resumed from step {start}", flush=True)
    if distributed:
        model, raw_model = STRATEGIES[args.dp_mode](model, device)
    else:
        raw_model = model
    if master:
        n_params = sum(p.numel() for p in raw_model.parameters())
        print(f"{n_params / 1e6:.2f}M params | world {world_size} | dp-mode {args.dp_mode}",
              flush=True)

    warmup = max(1, args.steps // 20)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        if step == args.fail_at_step and master and restart_count == 0:
            raise RuntimeError(f"--fail-at-step {step}: failing on purpose (restart count 0)")
        lr = args.lr * min(1.0, (step + 1) / warmup)  # linear warm-up, then cosine to lr/10
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(data, step, args.seed, args.batch_size, args.block_size, rank,
                         world_size)
        loss = model(x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        done = step + 1
        if done % args.log_every == 0 or done in (1, args.steps):
            loss = loss.detach()
            if distributed:
                dist.all_reduce(loss)
                loss /= world_size
            ms = (time.perf_counter() - t0) * 1000 / (done - start)
            if master:
                print(f"step {done} | loss {loss.item():.4f} | lr {lr:.2e} | {ms:.0f} ms/step",
                      flush=True)
        if args.checkpoint_dir and master and (done % args.checkpoint_every == 0
                                               or done == args.steps):
            save_checkpoint(args.checkpoint_dir, raw_model, optimizer, done)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
