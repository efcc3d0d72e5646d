"""Worker: communication hooks on HSDP's replica all-reduce, 4 ranks (2 replicas x 2 shards).

Three runs side by side from the same weights, SGD, every step: HSDP with the hook, HSDP
without one (the uncompressed run), and one process on the global batch (the reference).
Gradients are compared whole (`full_tensor` over the shard axis), then parameters.

- ``allreduce_hook``: equal to both; one bucket per unit and backward, indexed in finishing
  order, ``is_last`` on the last, named from the root;
- fp16 / bf16 compression: within 1e-2 relative of both, and not equal to the uncompressed
  run (the hook ran);
- PowerSGD, rank 1, compressing from step 2: exact when the average gradient is of rank 1
  (every sample the same input, so each weight gradient is ``(sum of output grads) x^T``),
  error feedback included; with inputs that differ it is not exact (the check can fail);
- gradient accumulation (`gradient_sync(model, False)` for the first of two microbatches):
  the hook runs once per unit, at the synchronised backward, on the summed gradients; equal
  to HSDP without a hook and to one process on both microbatches;
- PowerSGD's state through `checkpoint`: saved after step 3 and loaded into a fresh model,
  optimizer and state, step 4 equals the uninterrupted run's (a fresh state at the same
  iteration does not); loaded where this rank holds other rows of a weight (of the same
  size: 5 rows over 2 shards, then over 4), every rank refuses it at its first compressed
  step, before any of its collectives;
- refusals: a unit that is not HSDP, a hook state on another group than the replicas, and a
  hook on a non-root unit (at the first forward, or at once once the root has run).
"""

import copy
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import Mesh, checkpoint, full_tensor, fully_shard, gradient_sync
from meshrun.parallel.comm_hooks import (
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
)
from tests.parallel.harness import run_checks

B = 2  # samples per rank
SHAPE = {"dp_replicate": 2, "dp_shard": 2}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 12),
                         nn.Tanh(), nn.Linear(12, 1))


def hsdp(m, mesh):
    for layer in (m[0], m[2], m[4]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def batch(step, rank=None, same_input=False):
    g = torch.Generator().manual_seed(10 + step)
    x, y = torch.randn(4 * B, 16, generator=g), torch.randn(4 * B, 1, generator=g)
    if same_input:
        x = x[:1].expand(4 * B, 16)
    return (x, y) if rank is None else (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B])


def grads(m):
    return [full_tensor(p, p.grad) for p in m.parameters()]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def train(register, steps, check, same_input=False):
    """HSDP with ``register(model, mesh)``, HSDP without, and one process; ``check(step,
    hooked_grads, plain_grads, ref_grads)`` each step. Each model steps on its own grads."""
    mesh = Mesh(SHAPE)
    rank = dist.get_rank()
    ref = model()
    hooked, plain = hsdp(copy.deepcopy(ref), mesh), hsdp(copy.deepcopy(ref), mesh)
    register(hooked, mesh)
    models = (hooked, plain, ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(steps):
        for m, opt in zip(models, opts, strict=True):
            x, y = batch(step, None if m is ref else rank, same_input)
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        check(step, grads(hooked), grads(plain), [p.grad for p in ref.parameters()])
        for opt in opts:
            opt.step()
    return models


def check_allreduce_hook(ctx):
    calls = []

    def counting(state, bucket):
        calls.append((bucket.index(), bucket.is_last(), tuple(bucket.parameter_names())))
        return allreduce_hook(state, bucket)

    def check(step, hooked, plain, ref):
        for name, a, b, c in zip(NAMES, hooked, plain, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, n=name:
                                       f"step {step} {n} vs uncompressed HSDP: {m}")
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda m, n=name:
                                       f"step {step} {n} vs one process: {m}")

    train(lambda m, mesh: m.register_comm_hook(mesh.group("dp_replicate"), counting), 2, check)
    shard = dist.get_rank(Mesh(SHAPE).group("dp_shard"))
    # backward finishes the units last layer first; layer 4's parameters have one row, none
    # on shard rank 1 (torch.chunk), so that rank's bucket for it names nothing
    last_names = ("4.weight", "4.bias") if shard == 0 else ()
    expected = [(0, False, last_names), (1, False, ("2.weight", "2.bias")),
                (2, True, ("0.weight",))] * 2
    assert calls == expected, calls


NAMES = ["0.weight", "2.weight", "2.bias", "4.weight", "4.bias"]


def compression(hook, dtype_tol):
    def check(step, hooked, plain, ref):
        for name, a, b, c in zip(NAMES, hooked, plain, ref, strict=True):
            assert rel(a, b) < dtype_tol, f"step {step} {name}: {rel(a, b):.2e} vs uncompressed"
            assert rel(a, c) < dtype_tol, f"step {step} {name}: {rel(a, c):.2e} vs one process"
        assert any(not torch.equal(a, b) for a, b in zip(hooked, plain, strict=True)), \
            f"step {step}: compressed gradients bit-equal to uncompressed (hook not applied?)"

    train(lambda m, mesh: m.register_comm_hook(mesh.group("dp_replicate"), hook), 2, check)


def check_fp16_compress_hook(ctx):
    compression(fp16_compress_hook, 1e-2)


def check_bf16_compress_hook(ctx):
    compression(bf16_compress_hook, 1e-2)


def powersgd(same_input):
    states = []

    def register(m, mesh):
        states.append(PowerSGDState(mesh.group("dp_replicate"), matrix_approximation_rank=1,
                                    start_powerSGD_iter=2))
        m.register_comm_hook(states[0], powerSGD_hook)

    errors = []

    def check(step, hooked, plain, ref):
        errors.append(max(rel(a, c) for a, c in zip(hooked, ref, strict=True)))
        if same_input:
            for name, a, b, c in zip(NAMES, hooked, plain, ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name:
                                           f"step {step} {n} vs uncompressed HSDP: {m}")
                torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda m, n=name:
                                           f"step {step} {n} vs one process: {m}")

    train(register, 4, check, same_input)
    state = states[0]
    assert state.iter == 4, state.iter
    ratio = state.compression_stats()[0]
    assert sorted(state.error_dict) == ["0.weight", "2.weight"] and ratio > 1, \
        (list(state.error_dict), ratio)
    return errors


def check_powersgd_exact_on_rank_one(ctx):
    powersgd(same_input=True)


def check_powersgd_approximates_otherwise(ctx):
    errors = powersgd(same_input=False)
    assert max(errors[:2]) < 1e-5, errors  # plain all-reduce before start_powerSGD_iter
    assert min(errors[2:]) > 1e-3, errors  # rank 1 of a rank-16 gradient: not exact


def check_gradient_accumulation(ctx):
    mesh, rank = Mesh(SHAPE), dist.get_rank()
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    ref = model()
    hooked, plain = hsdp(copy.deepcopy(ref), mesh), hsdp(copy.deepcopy(ref), mesh)
    hooked.register_comm_hook(mesh.group("dp_replicate"), counting)
    for m in (hooked, plain, ref):
        for micro in range(2):
            with gradient_sync(m, micro == 1):
                x, y = batch(micro, None if m is ref else rank)
                (torch.nn.functional.mse_loss(m(x), y) / 2).backward()
            if m is hooked and micro == 0:
                assert calls == [], f"the hook ran in an unsynchronised backward: {calls}"
    assert calls == [0, 1, 2], calls
    for name, a, b, c in zip(NAMES, grads(hooked), grads(plain), [p.grad for p in ref.parameters()],
                             strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, n=name:
                                   f"{n} vs uncompressed HSDP: {m}")
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda m, n=name:
                                   f"{n} vs one process: {m}")


def check_powersgd_checkpoint(ctx):
    mesh, rank = Mesh(SHAPE), dist.get_rank()

    def build():
        m = hsdp(model(), mesh)
        state = PowerSGDState(mesh.group("dp_replicate"), matrix_approximation_rank=1,
                              start_powerSGD_iter=2)
        m.register_comm_hook(state, powerSGD_hook)
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), state

    def step(m, opt, i):
        x, y = batch(i, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        return grads(m)

    def parts(run, hook=True):
        m, opt, state = run
        out = {"model": checkpoint.model_state(m), "optim": checkpoint.optimizer_state(opt, m)}
        return {**out, "comm_hook": state} if hook else out

    whole = build()
    expected = [step(*whole[:2], i) for i in range(4)][3]  # steps 2, 3 compressed
    first = build()
    for i in range(3):
        step(*first[:2], i)
    with tempfile.TemporaryDirectory() as tmp:
        box = [tmp]
        dist.broadcast_object_list(box)
        checkpoint.save(parts(first), f"{box[0]}/step_3")
        resumed, fresh = build(), build()
        checkpoint.load(parts(resumed), f"{box[0]}/step_3")
        checkpoint.load(parts(fresh, hook=False), f"{box[0]}/step_3")
        dist.barrier()
    assert resumed[2].iter == 3 and sorted(resumed[2].error_dict) == ["0.weight", "2.weight"]
    for name, a, b in zip(NAMES, step(*resumed[:2], 3), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7,
                                   msg=lambda m, n=name: f"resumed step 3 {n}: {m}")
    fresh[2].iter = 3  # compressing too, but without the saved error feedback and Q
    got = step(*fresh[:2], 3)
    assert not torch.allclose(got[0], expected[0], rtol=1e-3), "PowerSGD state did not matter"


def check_powersgd_state_of_other_rows(ctx):
    def build(shape):
        mesh = Mesh(shape)
        torch.manual_seed(0)
        m = fully_shard(nn.Sequential(nn.Linear(16, 5, bias=False)), mesh=mesh)
        state = PowerSGDState(mesh.group("dp_replicate"), matrix_approximation_rank=1,
                              start_powerSGD_iter=2, min_compression_rate=1)
        m.register_comm_hook(state, powerSGD_hook)
        return m, state

    def step(m):
        x = torch.randn(B, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
        m(x).square().sum().backward()

    saved, state = build(SHAPE)
    for _ in range(3):
        step(saved)
    # rank 1 held rows 3-4 of the weight at (2 replicas, 2 shards) and holds rows 2-3 at
    # (1, 4): the same size, so its saved error feedback and Q would be added to other rows
    with tempfile.TemporaryDirectory() as tmp:
        box = [tmp]
        dist.broadcast_object_list(box)
        checkpoint.save({"comm_hook": state}, f"{box[0]}/ckpt")
        other, other_state = build({"dp_replicate": 1, "dp_shard": 4})
        checkpoint.load({"comm_hook": other_state}, f"{box[0]}/ckpt")
        dist.barrier()
    if dist.get_rank() == 1:
        assert other_state.error_dict["0.weight"].shape == (2, 16), other_state.error_dict
    try:
        step(other)
    except ValueError as e:
        assert "another sharding or world size" in str(e), e
    else:
        raise AssertionError("PowerSGD state kept for other rows was used")


def check_refusals(ctx):
    mesh = Mesh(SHAPE)
    flat = fully_shard(model())
    try:
        flat.register_comm_hook(None, allreduce_hook)
    except ValueError as e:
        assert "not HSDP" in str(e), e
    else:
        raise AssertionError("a hook on plain fully_shard was accepted")
    m = hsdp(model(), mesh)
    for state in (None, mesh.group("dp_shard"), PowerSGDState(None, start_powerSGD_iter=2)):
        try:
            m.register_comm_hook(state, allreduce_hook)
        except ValueError as e:
            assert "replica group" in str(e), e
        else:
            raise AssertionError(f"a hook on group {state} was accepted")
    m.register_comm_hook(mesh.group("dp_replicate"), allreduce_hook)
    try:
        m.register_comm_hook(mesh.group("dp_replicate"), allreduce_hook)
    except RuntimeError as e:
        assert "already" in str(e), e
    else:
        raise AssertionError("a second hook was accepted")
    # a hook on part of the units (a non-root unit) never sees is_last(): PowerSGD never
    # counted a step (iter stayed 0, no compression, silently); refused at the first forward,
    # or at once when the root has run
    part = hsdp(model(), mesh)
    part[4].register_comm_hook(PowerSGDState(mesh.group("dp_replicate"), start_powerSGD_iter=2),
                               powerSGD_hook)
    x, _ = batch(0, dist.get_rank())
    try:
        part(x)
    except ValueError as e:
        assert "share one hook" in str(e) and "4.weight" in str(e), e
    else:
        raise AssertionError("a hook on a non-root unit was accepted at the first forward")
    ran = hsdp(model(), mesh)
    ran(x)
    try:
        ran[2].register_comm_hook(mesh.group("dp_replicate"), allreduce_hook)
    except ValueError as e:
        assert "on the root" in str(e), e
    else:
        raise AssertionError("a hook on a non-root unit was accepted after the first forward")
    ran.register_comm_hook(mesh.group("dp_replicate"), allreduce_hook)  # the root: fine


if __name__ == "__main__":
    run_checks([check_allreduce_hook, check_fp16_compress_hook, check_bf16_compress_hook,
                check_powersgd_exact_on_rank_one, check_powersgd_approximates_otherwise,
                check_gradient_accumulation, check_powersgd_checkpoint,
                check_powersgd_state_of_other_rows, check_refusals])
