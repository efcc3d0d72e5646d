"""Context parallelism: attention over a sequence sharded across a mesh axis ("cp").

Every activation of a CP rank holds ``S / cp`` tokens; only attention needs the other ranks'
tokens. Two ways to give it them, each a drop-in for ``F.scaled_dot_product_attention`` on
shards ``(batch, heads, S / cp, head_dim)``:

- `ring_attention`: keys and values passed around the ring, partial results merged by
  log-sum-exp (Liu et al., "Ring Attention", 2023; Megatron-LM's context parallel).
- `ulysses_attention`: all-to-all to head shards and back (Jacobs et al., "DeepSpeed
  Ulysses", 2023); needs heads divisible by cp.

`context_parallel_attention(group, mode=...)`: a ``with`` block inside which
``F.scaled_dot_product_attention`` calls are routed to one of them (as torch's
``context_parallel`` does). `shard_sequence`, `unshard_sequence` and `position_ids` place a sequence in the
``"zigzag"`` (load-balanced under a causal mask) or ``"contiguous"`` layout. Parameters are
replicated over cp: gradients are reduced over dp x cp (``Mesh.group(("dp", "cp"))``).
"""

from meshrun.parallel.cp.layout import LAYOUTS, position_ids, shard_sequence, unshard_sequence
from meshrun.parallel.cp.ring import ring_attention
from meshrun.parallel.cp.sdpa import MODES as CP_MODES
from meshrun.parallel.cp.sdpa import context_parallel_attention
from meshrun.parallel.cp.ulysses import ulysses_attention

__all__ = ["CP_MODES", "LAYOUTS", "context_parallel_attention", "position_ids",
           "ring_attention", "shard_sequence", "ulysses_attention", "unshard_sequence"]
