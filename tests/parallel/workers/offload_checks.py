"""fully_shard CPU offload checks, on every rank of a 2-process gloo group (one launch).

On CPU the device is the host, so what is checked is the data flow: every all-gather starts
from a fresh copy of the host shard (host -> device, counted), every reduce-scatter's rows are
copied out (device -> host, counted) before they reach ``shard.grad``, the parameters, their
gradients and the optimizer state are views of the host shard, and training is bit-equal to
the same model without offload (the reference: no offload, itself checked against one process
in fsdp_checks.py).
"""

import copy

import torch

from meshrun.parallel import clip_grad_norm_
from meshrun.parallel.fsdp import CPUOffloadPolicy, fully_shard, offload
from tests.parallel.harness import run_checks
from tests.parallel.workers.fsdp_checks import Collectives, Net, batch, my_slice, shard

STEPS = 3


class CountCopies:
    """Wrap offload.to_device / to_host: count them, log them with the collectives' events,
    and keep the tensors they return (to check where gradients and gathers live)."""

    def __init__(self, events):
        self.events, self.copies = events, {"h2d": [], "d2h": []}
        self.originals = (offload.to_device, offload.to_host)

    def __enter__(self):
        to_device, to_host = self.originals

        def counted_to_device(host, *args):
            out = to_device(host, *args)
            self.events.append(("h2d", host.numel()))
            self.copies["h2d"].append((host.data_ptr(), out.data_ptr()))
            return out

        def counted_to_host(grad, *args):
            out = to_host(grad, *args)
            self.events.append(("d2h", grad.numel()))
            self.copies["d2h"].append((grad.data_ptr(), out.data_ptr()))
            return out

        offload.to_device, offload.to_host = counted_to_device, counted_to_host
        return self

    def __exit__(self, *exc):
        offload.to_device, offload.to_host = self.originals


def step(model, opt, ctx, s, accumulate=2):
    opt.zero_grad()
    for micro in range(accumulate):  # the first backward without gradient sync
        idx, tgt = batch(10 * s + micro)
        model.set_requires_gradient_sync(micro == accumulate - 1)
        model(my_slice(idx, ctx), my_slice(tgt, ctx)).backward()
    clip_grad_norm_(model.parameters(), 0.5)
    opt.step()


def check_offload_bit_equal(ctx):
    torch.manual_seed(0)
    plain = Net()
    offloaded = copy.deepcopy(plain)
    shard(plain)
    shard(offloaded, offload_policy=CPUOffloadPolicy(pin_memory=True))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, offloaded)]
    units = [m._fsdp_unit for m in (*offloaded.blocks, offloaded)]
    host = {u.sharded.data_ptr() for u in units}
    for s in range(STEPS):
        step(plain, opts[0], ctx, s)
        if s == 0:  # its first forward also all-gathers the data check's fingerprints
            step(offloaded, opts[1], ctx, s)
            continue
        events = []
        with Collectives(events) as coll, CountCopies(events) as copies:
            step(offloaded, opts[1], ctx, s)
        gathers, scatters = coll.count("gather"), coll.count("reduce_scatter")
        # ZeRO-3, 3 blocks + root, 2 microbatches: at least 2 x (4 forward + 3 backward)
        # gathers (prefetches add some), one reduce-scatter per unit at the synchronised one
        assert gathers >= 14 and scatters == 4, (gathers, scatters)
        assert len(copies.copies["h2d"]) == gathers and len(copies.copies["d2h"]) == scatters, \
            ({k: len(v) for k, v in copies.copies.items()}, gathers, scatters)
        for i, event in enumerate(events):  # each gather right after its shard's copy
            if event[0] == "gather":
                assert events[i - 1] == ("h2d", event[1] // ctx.world_size), events[i - 1:i + 1]
        assert all(src in host and dst not in host for src, dst in copies.copies["h2d"]), \
            "the all-gather must read a device copy of the host shard"
        assert all(src != dst for src, dst in copies.copies["d2h"]), "d2h copied nothing"
        copied = {dst for _, dst in copies.copies["d2h"]}  # alive: the gradients view them
        assert all(p.grad.untyped_storage().data_ptr() in copied
                   for p in offloaded.parameters()), \
            "shard.grad must be the host copy of the reduce-scatter's output"
    for (name, p), q in zip(offloaded.named_parameters(), plain.parameters(), strict=True):
        unit = p._fsdp_unit
        assert p.device.type == "cpu" and \
            p.untyped_storage().data_ptr() == unit.sharded.untyped_storage().data_ptr(), name
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad), name
        state, ref_state = opts[1].state[p], opts[0].state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].device.type == "cpu" and state[key].shape == p.shape, (name, key)
            assert torch.equal(state[key], ref_state[key]), (name, key)


def check_offload_bad_policy(ctx):
    try:
        fully_shard(torch.nn.Linear(2, 2), offload_policy=True)
    except TypeError as e:
        assert "offload_policy must be CPUOffloadPolicy" in str(e), e
    else:
        raise AssertionError("offload_policy=True must raise")


CHECKS = [check_offload_bit_equal, check_offload_bad_policy]


def main():
    run_checks(CHECKS)


if __name__ == "__main__":
    main()
