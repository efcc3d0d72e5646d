"""The char LM: token + position embedding, pre-norm blocks (causal self-attention + MLP),
final norm and head; `CharLM(idx, targets)` returns the mean cross-entropy (nanoGPT-style)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

N_LAYER, N_HEAD, N_EMBD = 4, 4, 128  # defaults: 300 steps on 2 CPU ranks in under 3 minutes


def causal_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))
        self.attention = causal_attention  # --cp: ring or Ulysses attention over the cp group

    def forward(self, x):
        # shapes from qkv, not x, and -1 for the head count: under tensor parallelism a rank
        # holds n_head / tp heads, and under sequence parallelism x holds T / tp tokens
        qkv = self.qkv(self.ln1(x))
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        y = self.attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)
        self.loss_fn = F.cross_entropy  # --tp: the vocab-parallel loss (logits stay sharded)

    def forward(self, idx, targets, pos=None):
        """``pos``: the tokens' positions (--cp: this rank's shard of them), default 0..T-1."""
        if pos is None:
            pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok_emb(idx) + self.pos_emb(pos))
        logits = self.head(self.ln_f(x))
        return self.loss_fn(logits.view(-1, logits.shape[-1]), targets.view(-1))
