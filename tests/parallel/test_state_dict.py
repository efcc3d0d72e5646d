"""State dicts are whole at every layout: ``model.state_dict()`` (DTensors of the unsplit
shapes) saved with torch DCP and converted by ``dcp_to_torch_save``, and `full_state_dict()`,
both equal the unsplit model exactly, under TP 2, FSDP 2, TP 2 x FSDP 2 and PP 2 x FSDP 2
(workers/state_dict_worker.py: padded vocabulary, uneven FSDP rows, fused qkv refused by
``state_dict`` but gathered by `full_state_dict`). The placement arithmetic itself is checked
in this process: pieces against the strategies' own slicing recipe, and which layouts are
DTensor layouts.
"""

import itertools

import pytest
import torch

from meshrun.parallel.placement import Cut, Placement, _layout, _not_a_dtensor
from tests.parallel.harness import assert_all_ok, launch


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("layout", "nproc"), [("tp", 2), ("fsdp", 2), ("tp_fsdp", 4),
                                               ("pp_fsdp", 4), ("pp", 2)])
def test_state_dicts_are_the_unsplit_model(tmp_path, layout, nproc):
    result = launch("state_dict_worker.py", nproc, (layout, str(tmp_path)), timeout=100)
    assert_all_ok(result)


def tp_then_fsdp(dim, tp, dp, padded):
    """The cuts of parallelize (dim, padded) then fully_shard (dim 0) at rank (0, 0)."""
    return (Cut("tp", None, dim, tp, 0, 1, padded), Cut("fsdp", None, 0, dp, 0))


@pytest.mark.timeout(10)
def test_pieces_tile_the_global_tensor():
    """Over all ranks, the pieces cover every element of the global tensor exactly once, and
    each piece of the local tensor holds the matching global block (fused qkv, padding)."""
    for shape, dim, chunks, padded, tp, dp in [((24, 4), 0, 3, 24, 2, 2), ((11, 4), 0, 1, 12, 2, 3),
                                               ((4, 6), 1, 1, 6, 2, 2), ((9, 2), 0, 1, 12, 4, 2)]:
        full = torch.arange(torch.Size(shape).numel()).view(shape)
        count = torch.zeros(shape, dtype=torch.long)
        for t, f in itertools.product(range(tp), range(dp)):
            cuts = (Cut("tp", None, dim, tp, t, chunks, padded), Cut("fsdp", None, 0, dp, f))
            local_shape, pieces = _layout(torch.Size(shape), cuts)
            local = _reference_local(full, dim, tp, t, chunks, padded, dp, f)
            assert tuple(local.shape) == tuple(local_shape), (shape, t, f)
            for p in pieces:
                assert torch.equal(p.view(local), full[p.region]), (shape, t, f, p)
                count[p.region] += 1
        assert bool((count == 1).all()), (shape, count)


def _reference_local(full, dim, tp, t, chunks, padded, dp, f):
    """What parallelize then fully_shard keep at (t, f), by the strategies' own recipe."""
    x = full.movedim(dim, 0)
    x = torch.cat([x, x.new_full((padded - x.shape[0], *x.shape[1:]), -1)])
    x = x.reshape(chunks, tp, padded // (chunks * tp), *x.shape[1:])[:, t]
    x = x.reshape(-1, *x.shape[2:]).movedim(0, dim)
    return x.chunk(dp)[f] if f < len(x.chunk(dp)) else x[:0]


@pytest.mark.timeout(10)
def test_dtensor_layouts_are_recognised():
    """TP with one chunk (padded or not) then FSDP is a DTensor layout exactly when every
    rank's valid rows are DTensor's (torch.chunk of torch.chunk); fused chunks never are."""
    assert _not_a_dtensor(Placement(torch.Size((11, 8)), torch.float32,
                                    tp_then_fsdp(0, 2, 2, 12))) is None
    assert _not_a_dtensor(Placement(torch.Size((6, 8)), torch.float32,
                                    tp_then_fsdp(0, 2, 2, 6))) is None
    # 13 rows over TP 2: 7 per rank (rank 1: 6 valid); FSDP 2 keeps 4 + 3, torch.chunk 3 + 3
    assert "padded" in _not_a_dtensor(Placement(torch.Size((13, 8)), torch.float32,
                                                 tp_then_fsdp(0, 2, 2, 14)))
    fused = (Cut("tp", None, 0, 2, 0, 3, 24),)
    assert "fused" in _not_a_dtensor(Placement(torch.Size((24, 8)), torch.float32, fused))
