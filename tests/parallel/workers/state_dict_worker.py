"""State dicts under one layout equal the unsplit model's, whole: `state_dict()` saved with torch
DCP and converted to a ``torch.save`` file, and `full_state_dict()`.

    state_dict_worker.py tp|fsdp|tp_fsdp|pp_fsdp|pp DIR

The model (fixed seed) has a vocabulary not divisible by TP (11 rows, padded to 12 under TP 2),
a TP shard with an odd number of rows (``fc1``: 6 -> 3 per TP rank, 2 and 1 per FSDP rank),
replicated parameters with rows FSDP cuts unevenly (``side``: 3 rows) and a buffer. The
reference is the same model built in this process and never parallelized (for ``pp_fsdp``,
split into the same stages).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor, Replicate

from meshrun.parallel import (
    ColwiseParallel,
    Mesh,
    PipelineStage,
    RowwiseParallel,
    full_state_dict,
    fully_shard,
    parallelize,
    placement,
    split_into_stages,
)
from tests.parallel.harness import run_checks

VOCAB, WIDTH, HIDDEN = 11, 8, 6


class Block(nn.Module):
    def __init__(self, qkv: bool):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)
        self.side = nn.Linear(WIDTH, 3)  # replicated under TP; 3 rows: uneven under FSDP
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH) if qkv else None


class Net(nn.Module):
    def __init__(self, qkv: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(qkv) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("scale", torch.arange(5.0))


PLAN = {"emb": RowwiseParallel(),
        "blocks.*.fc1": ColwiseParallel(),
        "blocks.*.fc2": RowwiseParallel(output_layouts=Replicate()),
        "head": ColwiseParallel(vocab_parallel=True)}


def build(layout: str, seed: int = 0, qkv: bool = False):
    """(the module whose state dict this rank holds, the unsplit reference state dict)."""
    torch.manual_seed(seed)
    model = Net(qkv)
    torch.manual_seed(0)
    reference = Net(qkv)
    if layout == "pp_fsdp":
        mesh = Mesh({"pp": 2, "dp": 2})
        stage = mesh.rank("pp")
        mine = split_into_stages(model.blocks, 2, first=model.emb,
                                 last=nn.Sequential(model.norm, model.head))[stage]
        ref = split_into_stages(reference.blocks, 2, first=reference.emb,
                                last=nn.Sequential(reference.norm, reference.head))[stage]
        for block in mine.blocks.values():
            fully_shard(block, mesh.group("dp"))
        fully_shard(mine, mesh.group("dp"))
        PipelineStage(mine, stage, 2, mesh.group("pp"))
        return mine, ref.state_dict()
    tp = 2 if layout.startswith("tp") else 1
    mesh = Mesh({"dp": dist.get_world_size() // tp, "tp": tp})
    if tp > 1:
        plan = dict(PLAN, **({"blocks.*.qkv": ColwiseParallel(chunks=3)} if qkv else {}))
        parallelize(model, mesh.group("tp"), plan)
    if layout.endswith("fsdp"):
        for block in model.blocks:
            fully_shard(block, mesh.group("dp"))
        fully_shard(model, mesh.group("dp"))
    return model, reference.state_dict()


def assert_equal(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for key, value in want.items():
        assert got[key].shape == value.shape, (what, key, tuple(got[key].shape), value.shape)
        assert torch.equal(got[key], value), (what, key)


def is_first(module) -> bool:
    return all(c.rank == 0 for p in module.parameters() for c in placement.of(p).cuts)


def main():
    layout, out = sys.argv[1], Path(sys.argv[2])

    def check_dcp_save_is_the_unsplit_model(ctx):
        model, want = build(layout)
        sd = model.state_dict()
        for key, value in sd.items():  # every cut parameter is a DTensor of the global shape
            assert value.shape == want[key].shape, (key, tuple(value.shape))
        assert any(isinstance(v, DTensor) for v in sd.values())
        dcp.save(sd, checkpoint_id=str(out / "dcp"))
        dist.barrier()
        if ctx.rank == 0:
            dcp_to_torch_save(str(out / "dcp"), str(out / "full.pt"))
            saved = torch.load(out / "full.pt")
            if layout == "pp_fsdp":  # the checkpoint holds both stages' keys
                torch.manual_seed(0)
                ref = Net()
                stages = split_into_stages(ref.blocks, 2, first=ref.emb,
                                           last=nn.Sequential(ref.norm, ref.head))
                want = {**stages[0].state_dict(), **stages[1].state_dict()}
            assert_equal(saved, want, "dcp_to_torch_save")

    def check_full_state_dict(ctx):
        model, want = build(layout)
        if layout == "pp_fsdp":  # PipelineStage recorded which stage owns each parameter
            stages = {placement.of(p).stage for p in model.parameters()}
            assert stages == {dist.get_rank() // 2}, stages
        full = full_state_dict(model)
        if is_first(model):
            assert_equal(full, want, "full_state_dict")
            assert all(v.device.type == "cpu" for v in full.values())
        else:
            assert full == {}, sorted(full)

    def check_load_state_dict(ctx):
        """A model built from another seed takes the DCP checkpoint, then full tensors."""
        model, want = build(layout, seed=1)
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=str(out / "dcp"))
        model.load_state_dict(sd)
        full = full_state_dict(model)
        if is_first(model):
            assert_equal(full, want, "load_state_dict(dcp.load)")
        other, _ = build(layout, seed=2)
        other.load_state_dict(want)  # full tensors, every rank
        full = full_state_dict(other)
        if is_first(other):
            assert_equal(full, want, "load_state_dict(full tensors)")

    def check_fused_chunks_refused(ctx):
        """qkv (3 fused TP chunks) is not a DTensor layout: state_dict names it and refuses;
        full_state_dict still gives the unsplit tensor."""
        model, want = build(layout, qkv=True)
        try:
            model.state_dict()
        except ValueError as e:
            assert "blocks.0.qkv.weight" in str(e) and "full_state_dict" in str(e), str(e)
        else:
            raise AssertionError("state_dict() of fused TP chunks did not raise")
        full = full_state_dict(model)
        if is_first(model):
            assert_equal(full, want, "full_state_dict with qkv")

    def check_pipeline_only_full_state_dict(ctx):
        """PP 2 and nothing else: each stage's keys on that stage's rank (none is lost)."""
        torch.manual_seed(0)
        model, reference = Net(), Net()
        reference.load_state_dict(model.state_dict())
        split = [split_into_stages(m.blocks, 2, first=m.emb,
                                   last=nn.Sequential(m.norm, m.head)) for m in (model, reference)]
        mine = split[0][ctx.rank]
        PipelineStage(mine, ctx.rank, 2, dist.group.WORLD)
        assert_equal(full_state_dict(mine), split[1][ctx.rank].state_dict(),
                     f"full_state_dict of stage {ctx.rank}")

    if layout == "pp":
        run_checks([check_pipeline_only_full_state_dict])
        return
    checks = [check_dcp_save_is_the_unsplit_model, check_full_state_dict,
              check_load_state_dict]
    if layout.startswith("tp"):
        checks.append(check_fused_chunks_refused)
    run_checks(checks)


if __name__ == "__main__":
    main()
