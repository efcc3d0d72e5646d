"""Packing a rank's rows for its neighbour (meshrun.parallel.fsdp.copies._views, _pack): the
fused copy into cached views must put every tensor's bytes where `_Layout` says, mixed dtypes
included (a block whose offset is not aligned to its dtype is copied as bytes). The reference
is a plain byte-by-byte copy of each tensor to its block's start."""

import pytest
import torch

from meshrun.parallel.fsdp.copies import _Layout, _pack, _views


def _reference(layout: _Layout, tensors: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(layout.nbytes, dtype=torch.uint8)
    offset, k = 0, 0
    for i in range(len(layout.names)):
        for j in range(1 + len(layout.keys[i])):
            raw = tensors[k].reshape(-1).view(torch.uint8)
            out[offset:offset + raw.numel()] = raw
            offset += layout.block(i, j)
            k += 1
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(8))
def test_fused_packing_equals_a_byte_copy_at_every_block(seed):
    gen = torch.Generator().manual_seed(seed)
    dtypes = ["float32", "bfloat16", "float16", "float64"]
    n = int(torch.randint(1, 6, (1,), generator=gen))
    shards = int(torch.randint(1, 4, (1,), generator=gen))
    shard = int(torch.randint(0, shards, (1,), generator=gen))
    names, shapes, keys, kinds = [], [], [], []
    for i in range(n):
        shape = tuple(int(d) for d in torch.randint(1, 6, (int(torch.randint(1, 3, (1,),
                                                                            generator=gen)),),
                                                     generator=gen))
        names.append(f"p{i}")
        shapes.append(shape)
        keys.append(["exp_avg", "exp_avg_sq"][:int(torch.randint(0, 3, (1,), generator=gen))])
        kinds.append([dtypes[int(torch.randint(0, 4, (1,), generator=gen))]
                      for _ in range(1 + len(keys[-1]))])
    layout = _Layout(shards, names, shapes, keys, kinds)
    tensors = []
    for i in range(n):
        rows = layout.rows_of(i, shard)  # this shard's rows (the last may have fewer)
        for j in range(1 + len(keys[i])):
            tensors.append(torch.randn((rows, *shapes[i][1:]), generator=gen)
                           .to(layout.dtype(i, j)))
    packed = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = _views(layout, packed, tensors)
    for _ in range(2):  # the cached views serve every step: write twice, new values
        tensors = [t + 1 for t in tensors]
        _pack(views, tensors)
        assert torch.equal(packed, _reference(layout, tensors))


@pytest.mark.timeout(60)
def test_a_tensor_larger_than_its_block_is_refused():
    layout = _Layout(2, ["w"], [(4, 3)], [[]], [["float32"]])
    with pytest.raises(RuntimeError, match="does not fit its block"):
        _views(layout, torch.zeros(layout.nbytes, dtype=torch.uint8), [torch.zeros(3, 3)])
