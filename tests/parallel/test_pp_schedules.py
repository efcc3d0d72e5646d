"""Pipeline schedules as data, in one process without a process group: the built-in action
lists, the validator's verdicts, the simulator's bubble and memory against the formulas, the
stage split, and the runtime itself on a pipeline of one rank (every stage local)."""

import copy
import random

import pytest
import torch
from torch import nn

from meshrun.parallel.pipelining import (
    Action,
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleError,
    ScheduleInterleaved1F1B,
    ScheduleZBH1,
    ScheduleZBV,
    bubble_formula,
    check_no_shared_parameters,
    forward_only,
    gpipe_order,
    interleaved_1f1b_order,
    one_f_one_b_order,
    parse_order,
    pipeline,
    simulate,
    split_into_stages,
    validate_schedule,
    zb_h1_order,
    zbv_order,
    zero_bubble_formula,
)
from meshrun.parallel.pipelining.split_backward import backward_input

pytestmark = pytest.mark.timeout(60)

GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8, 12)]
INTERLEAVED_GRID = [(p, m, v) for p in (1, 2, 4) for m in (4, 8, 12) for v in (1, 2, 3)
                    if m % p == 0]


# -- actions and built-in orders ----------------------------------------------------------


def test_action_text_round_trip():
    assert str(Action(2, "B", 13)) == "2B13"
    assert Action.parse(" 2B13 ") == Action(2, "B", 13)
    assert parse_order({0: "0F0, 0B0"}) == {0: [Action(0, "F", 0), Action(0, "B", 0)]}
    assert Action.parse("0W1") == Action(0, "W", 1) and str(Action(3, "W", 2)) == "3W2"
    with pytest.raises(ValueError, match="expected STAGE F|B|W MICROBATCH"):
        Action.parse("0I1")
    with pytest.raises(ValueError, match="kind must be"):
        Action(0, "X", 0)
    # a float or bool index passed validation (0.0 == 0) and failed later, inside a step
    for stage, microbatch in ((0, 0.0), (0.5, 0), (True, 0), (0, False)):
        with pytest.raises(ValueError, match="must be an int"):
            Action(stage, "F", microbatch)


def test_1f1b_order_has_warmup_steady_state_and_cooldown():
    order = one_f_one_b_order(4, 6)
    assert " ".join(map(str, order[0])) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert " ".join(map(str, order[3])) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"


def test_interleaved_order_places_chunks_round_robin():
    order = interleaved_1f1b_order(2, 4, 2)
    assert {a.stage for a in order[0]} == {0, 2} and {a.stage for a in order[1]} == {1, 3}
    assert " ".join(map(str, order[1][:6])) == "1F0 1F1 3F0 3B0 3F1 3B1"
    with pytest.raises(ValueError, match="multiple of the number of pipeline ranks"):
        interleaved_1f1b_order(2, 3, 2)


@pytest.mark.parametrize("p, m", GRID)
def test_builtin_orders_validate(p, m):
    validate_schedule(gpipe_order(p, m), p, m)
    validate_schedule(one_f_one_b_order(p, m), p, m)
    validate_schedule(forward_only(one_f_one_b_order(p, m)), p, m, backward=False)


@pytest.mark.parametrize("p, m, v", INTERLEAVED_GRID)
def test_interleaved_orders_validate(p, m, v):
    validate_schedule(interleaved_1f1b_order(p, m, v), p * v, m)


# -- validator ------------------------------------------------------------------------------


def test_rejects_a_deadlock_between_two_stages():
    # rank 0 waits at 0B0 for rank 1's 1B0; rank 1 waits at 1F1 for rank 0's 0F1 (after 0B0)
    order = parse_order({0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"})
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 waits at 0B0 for 1B0 \(rank 1\);"
                                            r" rank 1 waits at 1F1 for 0F1 \(rank 0\)"):
        validate_schedule(order, 2, 2)


def test_rejects_a_deadlock_across_interleaved_chunks():
    # rank 1 starts with stage 3, which needs stage 2, which needs stage 1: on rank 1, later
    order = parse_order({0: "0F0 2F0 2B0 0B0", 1: "3F0 1F0 3B0 1B0"})
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits at 2F0 for 1F0 .rank 1.; "
                                            "rank 1 waits at 3F0 for 2F0 .rank 0."):
        validate_schedule(order, 4, 1)


def test_rejects_a_backward_before_its_forward():
    order = parse_order({0: "0F0 0F1 0B0 0B1", 1: "1B0 1F0 1F1 1B1"})
    with pytest.raises(ScheduleError, match="rank 1: 1B0 is a backward before its forward 1F0"):
        validate_schedule(order, 2, 2)


def test_rejects_a_missing_microbatch():
    order = parse_order({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1F1"})
    with pytest.raises(ScheduleError, match="stage 1 never runs the backward of microbatch.* 1 "
                                            r"\(missing microbatch\)"):
        validate_schedule(order, 2, 2)


def test_rejects_a_duplicate_action():
    order = parse_order({0: "0F0 0F0 0B0", 1: "1F0 1B0"})
    with pytest.raises(ScheduleError, match="0F0 appears 2 times"):
        validate_schedule(order, 2, 1)


def test_rejects_reordered_microbatches():
    order = parse_order({0: "0F1 0F0 0B0 0B1", 1: "1F0 1F1 1B0 1B1"})
    with pytest.raises(ScheduleError, match="rank 0: stage 0 runs the forward of microbatch 0 "
                                            "after microbatch 1"):
        validate_schedule(order, 2, 2)


def test_rejects_messages_received_out_of_order():
    # rank 0 sends stage 1's inputs for microbatches 0, 1 before stage 3's; rank 1 wants
    # stage 3's microbatch 0 second: no deadlock, but an in-order transport would mismatch
    order = parse_order({0: "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
                         1: "1F0 3F0 1F1 3F1 3B0 3B1 1B0 1B1"})
    with pytest.raises(ScheduleError, match="rank 0 sends the activation for stage 1, "
                                            "microbatch 1 as its message #1 to rank 1, but rank 1 "
                                            "expects the activation for stage 3, microbatch 0"):
        validate_schedule(order, 4, 2)


def test_rejects_a_stage_on_the_wrong_rank_and_out_of_range_values():
    with pytest.raises(ScheduleError, match="rank 0: 1F0 runs stage 1, which lives on rank 1"):
        validate_schedule(parse_order({0: "1F0", 1: "0F0"}), 2, 1, backward=False)
    with pytest.raises(ScheduleError, match="names microbatch 2, but there are only 2"):
        validate_schedule(parse_order({0: "0F2"}), 1, 2, backward=False)
    with pytest.raises(ScheduleError, match="backward in a forward-only order"):
        validate_schedule(parse_order({0: "0F0 0B0"}), 1, 1, backward=False)


def test_accepts_a_hand_written_order():
    validate_schedule(parse_order({0: "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
                                   1: "1F0 1B0 1F1 1B1 1F2 1F3 1B2 1B3"}), 2, 4)


# -- simulator ------------------------------------------------------------------------------


@pytest.mark.parametrize("backward", [1.0, 2.0])
@pytest.mark.parametrize("p, m", GRID)
def test_gpipe_and_1f1b_bubble_matches_the_formula(p, m, backward):
    for order in (gpipe_order(p, m), one_f_one_b_order(p, m)):
        sim = simulate(order, forward=1.0, backward=backward)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert sim.makespan == pytest.approx((m + p - 1) * (1.0 + backward))


@pytest.mark.parametrize("backward", [1.0, 2.0])
@pytest.mark.parametrize("p, m, v", INTERLEAVED_GRID)
def test_interleaved_bubble_matches_the_formula(p, m, v, backward):
    # a stage costs 1 forward + `backward`; each of the v chunks a rank holds costs 1/v of it
    sim = simulate(interleaved_1f1b_order(p, m, v), forward=1.0 / v, backward=backward / v)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert sim.bubble_fraction == pytest.approx(bubble_formula(p, m, v), abs=1e-12)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (3, 2)])
def test_1f1b_holds_at_most_p_microbatches_where_gpipe_holds_m(p, m):
    gpipe, ofob = simulate(gpipe_order(p, m)), simulate(one_f_one_b_order(p, m))
    assert all(peak == m for peak in gpipe.peak_activations.values())
    assert ofob.peak_activations == {r: min(p - r, m) for r in range(p)}
    assert max(ofob.peak_activations.values()) == min(p, m)


def test_simulator_message_delay_and_per_stage_costs():
    order = gpipe_order(2, 1)
    sim = simulate(order, forward=[1.0, 3.0], backward=[2.0, 4.0], comm=0.5)
    # 0F0 [0,1], 1F0 [1.5,4.5], 1B0 [4.5,8.5], 0B0 [9,11]
    assert sim.times[Action(0, "B", 0)] == (9.0, 11.0)
    assert sim.makespan == 11.0
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(parse_order({0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"}))


# -- split ----------------------------------------------------------------------------------


def test_split_into_stages_balances_blocks_and_keeps_first_and_last():
    blocks = [nn.Linear(4, 4) for _ in range(7)]
    first, last = nn.Embedding(10, 4), nn.Linear(4, 2)
    stages = split_into_stages(blocks, 3, first=first, last=last)
    assert [list(s.blocks) for s in stages] == [["0", "1"], ["2", "3"], ["4", "5", "6"]]
    assert stages[0].first is first and stages[-1].last is last
    assert stages[1].first is None and stages[0].last is None
    assert "blocks.5.weight" in dict(stages[2].named_parameters())
    heavy = split_into_stages(blocks[:4], 2, costs=[1, 1, 1, 5])
    assert [list(s.blocks) for s in heavy] == [["0", "1", "2"], ["3"]]
    x = torch.randint(10, (2, 3))
    y = stages[2](stages[1](stages[0](x)))
    assert torch.equal(y, last(nn.Sequential(*blocks)(first(x))))
    with pytest.raises(ValueError, match="1 <= num_stages <= number of blocks"):
        split_into_stages(blocks, 8)


# -- the runtime with every stage on one rank (no process group) ----------------------------


def mse(out, y):
    return ((out - y) ** 2).mean()


def local_pipeline(num_stages=4, n_microbatches=4):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(num_stages)]
    first, last = nn.Linear(5, 8), nn.Linear(8, 3)
    full = nn.Sequential(first, *blocks, last)
    modules = split_into_stages(blocks, num_stages, first=first, last=last)
    stages = [PipelineStage(m, s, num_stages) for s, m in enumerate(modules)]
    return ScheduleInterleaved1F1B(stages, n_microbatches, mse), full, copy.deepcopy(full)


def test_one_rank_pipeline_matches_the_unsplit_model():
    schedule, full, ref = local_pipeline()
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    losses = []
    out = schedule.step(x, target=y, losses=losses)
    ref_out = ref(x)
    mse(ref_out, y).backward()
    torch.testing.assert_close(torch.stack(losses).mean(), mse(ref_out, y).detach())
    torch.testing.assert_close(out, ref_out.detach())
    for p, q in zip(full.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert schedule.last_actions == schedule.pipeline_order[0]
    with torch.no_grad():
        torch.testing.assert_close(schedule.eval(x), ref(x))


def test_runtime_errors_name_the_problem():
    schedule, _, _ = local_pipeline()
    with pytest.raises(ValueError, match="batch dimension 6, which is not a multiple of "
                                         "n_microbatches=4"):
        schedule.step(torch.randn(6, 5), target=torch.randn(6, 3))
    with pytest.raises(ValueError, match="holds the last stage .3. and needs target"):
        schedule.step(torch.randn(8, 5))
    with pytest.raises(RuntimeError, match="pipeline stage 0 .pipeline rank 0.: forward of "
                                           r"microbatch 0 failed on inputs \[\(2, 7\) float32\]"):
        schedule.step(torch.randn(8, 7), target=torch.randn(8, 3))
    stage = schedule.stages[0]
    with pytest.raises(ValueError, match=r"the order runs stages \[0, 1, 2, 3\] on pipeline "
                                         r"rank 0, but this rank built stages \[0\]"):
        PipelineSchedule(stage, 4, mse, order=interleaved_1f1b_order(1, 4, 4))
    with pytest.raises(ValueError, match="runs one stage per rank, but there are 4 stages"):
        Schedule1F1B(stage, 4, mse)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        pipeline([nn.Linear(2, 2)], schedule="zb", n_microbatches=1)


def test_a_parameter_tied_across_pipeline_ranks_is_refused():
    emb, head = nn.Embedding(11, 4), nn.Linear(4, 11, bias=False)
    head.weight = emb.weight  # tied input and output embeddings
    blocks = [nn.Linear(4, 4) for _ in range(4)]
    stages = split_into_stages(blocks, 2, first=emb, last=head)
    with pytest.raises(ValueError, match=r"'first.weight' of stage 0 is also 'last.weight' of "
                                         r"stage 1.*Untie them"):
        check_no_shared_parameters(stages, num_ranks=2)
    check_no_shared_parameters(stages, num_ranks=1)  # both stages on one rank: one copy
    head.weight = nn.Parameter(emb.weight.detach().clone())  # untied
    check_no_shared_parameters(split_into_stages(blocks, 2, first=emb, last=head), 2)


# -- zero-bubble schedules: B and W as separate actions -----------------------------------

ZB_GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8, 12)]


def test_zero_bubble_orders_as_text():
    assert " ".join(map(str, zb_h1_order(2, 4)[1])) == (
        "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1F3 1B3 1W2 1W3")  # rank 1 postpones one W
    zbv = zbv_order(2, 4)
    assert {a.stage for a in zbv[0]} == {0, 3} and {a.stage for a in zbv[1]} == {1, 2}
    assert " ".join(map(str, zbv[1][:9])) == "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0"


@pytest.mark.parametrize("p, m", ZB_GRID)
def test_zero_bubble_orders_validate(p, m):
    validate_schedule(zb_h1_order(p, m), p, m)
    validate_schedule(zbv_order(p, m), 2 * p, m, placement="v")
    validate_schedule(forward_only(zbv_order(p, m)), 2 * p, m, backward=False, placement="v")


def test_validator_rules_for_w():
    with pytest.raises(ScheduleError, match="rank 1: 1W0 is a weight gradient before its "
                                            "backward 1B0"):
        validate_schedule(parse_order({0: "0F0 0B0", 1: "1F0 1W0 1B0"}), 2, 1)
    with pytest.raises(ScheduleError, match=r"stage 1 splits the backward of microbatch\(es\) 0 "
                                            r"\(W\) but not of 1: .* \(missing W\)"):
        validate_schedule(parse_order({0: "0F0 0F1 0B0 0B1",
                                       1: "1F0 1B0 1W0 1F1 1B1"}), 2, 2)
    with pytest.raises(ScheduleError, match="1W1 appears 2 times"):
        validate_schedule(parse_order({0: "0F0 0F1 0B0 0B1",
                                       1: "1F0 1B0 1W0 1F1 1B1 1W1 1W1"}), 2, 2)
    with pytest.raises(ScheduleError, match="stage 0 runs the W of microbatch 0 after "
                                            "microbatch 1"):
        validate_schedule(parse_order({0: "0F0 0F1 0B0 0B1 0W1 0W0"}), 1, 2)
    with pytest.raises(ScheduleError, match="0W0 is a backward in a forward-only order"):
        validate_schedule(parse_order({0: "0F0 0W0"}), 1, 1, backward=False)
    with pytest.raises(ScheduleError, match=r"rank 0: 2F0 runs stage 2, which lives on rank 1 "
                                            r"\(v placement\)"):  # the loop placement
        validate_schedule(parse_order({0: "0F0 2F0", 1: "1F0 3F0"}), 4, 1, backward=False,
                          placement="v")
    with pytest.raises(ValueError, match="unknown stage placement 'zigzag'"):
        validate_schedule(zbv_order(2, 4), 4, 4, placement="zigzag")
    # a W is a wait for nobody: B of the stage below does not wait for it
    validate_schedule(parse_order({0: "0F0 0B0 0W0", 1: "1F0 1B0 1W0"}), 2, 1)


@pytest.mark.parametrize("p, m", [(p, m) for p, m in ZB_GRID if m >= p])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    """ZB-H1 against Qi et al. (ICLR 2024, section 2.1): with F, B, W costing t_F, t_B, t_W
    (t_W <= t_F) the makespan is ``m (t_F + t_B + t_W) + (p - 1)(t_F + t_B - t_W)``; with
    all three equal the idle time ``(p - 1) t`` per rank is a third of 1F1B's ``3 (p - 1) t``
    (bubble fraction ``(p - 1)/(3 m + p - 1)``), at 1F1B's peak memory (p microbatches)."""
    zb = simulate(zb_h1_order(p, m), forward=1.0, backward=2.0, weight=1.0)
    ofob = simulate(one_f_one_b_order(p, m), forward=1.0, backward=2.0)
    assert zb.makespan == pytest.approx(3 * m + (p - 1))
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert zb.bubble_fraction == pytest.approx(zero_bubble_formula("zbh1", p, m), abs=1e-12)
    assert zb.makespan - 3 * m == pytest.approx((ofob.makespan - 3 * m) / 3)
    assert zb.peak_activations == {r: p for r in range(p)}
    assert max(zb.peak_activations.values()) == max(ofob.peak_activations.values())
    for f, b, w in [(1.0, 1.2, 0.8), (1.0, 1.5, 0.7), (1.0, 1.0, 0.5)]:
        sim = simulate(zb_h1_order(p, m), forward=f, backward=b + w, weight=w)
        assert sim.makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))
        assert sim.bubble_fraction == pytest.approx(zero_bubble_formula(
            "zbh1", p, m, forward=f, backward_input=b, weight=w), abs=1e-12)


@pytest.mark.parametrize("p, m", [(1, 4), (2, 4), (2, 8), (3, 5), (3, 12), (4, 8), (4, 12),
                                  (8, 16)])
def test_zbv_bubble_is_only_the_pipe_filling(p, m):
    """ZB-V against Qi et al. (section 6): with every chunk's F, B and W costing t (a chunk is
    half a stage) and m >= 2p - 1, the makespan is ``(6 m + p - 1) t``: the only idle time
    is rank p - 1 waiting for p - 1 chunk forwards before its first (no schedule can do
    better), bubble ``(p - 1)/(6 m + p - 1)``, which the paper's table rounds to 0; 1F1B on
    the same p ranks idles ``3 (p - 1)`` stage-units = 6 (p - 1) t. Peak: 2p chunks = 1F1B's
    p stages."""
    sim = simulate(zbv_order(p, m), forward=1.0, backward=2.0, weight=1.0)
    assert sim.makespan == pytest.approx(6 * m + p - 1)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
    assert sim.bubble_fraction == pytest.approx(zero_bubble_formula("zbv", p, m), abs=1e-12)
    # a stage is 2 chunks: 1F1B's stage F = 2t, B = 4t, idle 6 (p - 1) t: six times more
    ofob = simulate(one_f_one_b_order(p, m), forward=2.0, backward=4.0)
    assert sim.makespan - 6 * m == pytest.approx((ofob.makespan - 6 * m) / 6)
    assert max(sim.peak_activations.values()) == 2 * p


@pytest.mark.parametrize("seed", range(4))
def test_zbv_formula_with_unequal_chunk_costs(seed):
    """ZB-V with a chunk's B dearer than its F: the formula's idle ``(p - 1) max(t_F, t_B)``
    (rank p - 1's forced waits) against the simulator, seeded random costs. Exact where the
    docstring says (t_F <= t_B, t_B / 2 <= t_W <= t_B); a lower bound anywhere else, and not
    exact there (a B cheaper than its F costs more idle), so the region is no wider than
    claimed."""
    rng = random.Random(seed)
    exact = below = 0
    for _ in range(40):
        p, f = rng.randint(2, 6), rng.uniform(0.5, 2.0)
        m = rng.randint(2 * p - 1, 4 * p)
        if rng.random() < 0.5:  # inside the region
            b = f * rng.uniform(1.0, 1.6)
            w = b * rng.uniform(0.5, 1.0)
        else:  # anywhere
            b, w = rng.uniform(0.2, 3.0), rng.uniform(0.05, 3.0)
        sim = simulate(zbv_order(p, m), 2 * p, forward=f, backward=b + w, weight=w)
        work = 2 * m * (f + b + w)
        formula = zero_bubble_formula("zbv", p, m, forward=f, backward_input=b, weight=w)
        assert formula == pytest.approx((p - 1) * max(f, b) / (work + (p - 1) * max(f, b)))
        assert sim.makespan >= work + (p - 1) * max(f, b) - 1e-9
        if f <= b and b / 2 <= w <= b:
            assert sim.makespan == pytest.approx(work + (p - 1) * max(f, b), abs=1e-9)
            assert sim.bubble_fraction == pytest.approx(formula, abs=1e-12)
            exact += 1
        elif p > 2 and b < 0.9 * f:  # a cheap B: other ranks wait too
            assert sim.makespan > work + (p - 1) * f + 1e-6
            below += 1
    assert exact >= 10 and below >= 1  # both branches ran


def test_simulator_splits_costs_only_where_the_order_splits():
    order = parse_order({0: "0F0 0B0 0W0", 1: "1F0 1B0"})  # stage 1 unsplit, stage 0 split
    sim = simulate(order, forward=1.0, backward=3.0, weight=1.0)
    assert sim.times[Action(1, "B", 0)] == (2.0, 5.0)  # full backward: 3
    assert sim.times[Action(0, "B", 0)] == (5.0, 7.0)  # B: 3 - 1
    assert sim.times[Action(0, "W", 0)] == (7.0, 8.0)  # W: 1
    with pytest.raises(ValueError, match="weight <= backward"):
        simulate(order, backward=1.0, weight=2.0)


class _Count(torch.autograd.Function):
    """Identity that counts its backward calls (in ``calls``)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Count.calls += 1
        return grad


class _Tied(nn.Module):
    """Two layers, one of them used twice (its W reaches it from two places)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):
        h = _Count.apply(torch.tanh(self.a(x)))
        h = self.b(h) + h
        return self.norm(self.a(h)) * 2


@pytest.mark.parametrize("module", ["tied", "mlp", "first stage"])
def test_split_backward_equals_the_full_backward(module):
    """B gives the input gradient and leaves .grad alone; W then gives exactly the gradients
    of one full backward, and (without a tied weight) does not run the input side again."""
    torch.manual_seed(0)
    if module == "mlp":
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        model.insert(2, _CountModule())
    else:
        model = _Tied()
    ref = copy.deepcopy(model)
    x, g = torch.randn(3, 4), torch.randn(3, 4)
    needs_grad = module != "first stage"
    xi = x.clone().requires_grad_(needs_grad)
    params = list(model.parameters())
    _Count.calls = 0
    dx, weights = backward_input([model(xi)], [g], [xi] if needs_grad else [], params)
    after_b = _Count.calls
    assert all(p.grad is None for p in params), "B touched a parameter's gradient"
    weights.backward_weight()
    after_w = _Count.calls
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
    if needs_grad:
        torch.testing.assert_close(dx[0], xr.grad)
    if module == "mlp":
        assert (after_b, after_w) == (1, 1), "W ran the input side again"


class _CountModule(nn.Module):
    def forward(self, x):
        return _Count.apply(x)


@pytest.mark.parametrize("schedule_cls", [ScheduleZBH1, ScheduleZBV])
def test_one_rank_zero_bubble_pipeline_matches_the_unsplit_model(schedule_cls):
    torch.manual_seed(0)
    n = 2 if schedule_cls is ScheduleZBV else 1
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)]
    first, last = nn.Linear(5, 8), nn.Linear(8, 3)
    full = nn.Sequential(first, *blocks, last)
    ref = copy.deepcopy(full)
    modules = split_into_stages(blocks, n, first=first, last=last)
    stages = [PipelineStage(m, s, n, placement="v" if n == 2 else "loop")
              for s, m in enumerate(modules)]
    schedule = schedule_cls(stages if n == 2 else stages[0], 4, mse)
    assert any(a.kind == "W" for a in schedule.pipeline_order[0])
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    losses = []
    schedule.step(x, target=y, losses=losses)
    mse(ref(x), y).backward()
    torch.testing.assert_close(torch.stack(losses).mean(), mse(ref(x), y).detach())
    for p, q in zip(full.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_zero_bubble_errors_name_the_fix():
    torch.manual_seed(0)
    loop = [PipelineStage(nn.Linear(2, 2), s, 2) for s in range(2)]
    with pytest.raises(ValueError, match=r"build the stages with PipelineStage\(\.\.\., "
                                         r"placement='v'\)"):
        ScheduleZBV(loop, 4, mse)
    with pytest.raises(ValueError, match="needs exactly 2 stages per rank"):
        ScheduleZBV(loop[:1], 4, mse)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        ScheduleZBH1(loop[0], 4, mse)
    with pytest.raises(ValueError, match=r"schedule 'zbv' runs 2 stage\(s\) per rank, but there "
                                         r"are 3 stages on 1 ranks"):
        pipeline([nn.Linear(2, 2) for _ in range(3)], schedule="zbv", n_microbatches=2)
    class Sharded(nn.Linear):  # FSDP-style, without set_reshard_after_backward
        def set_requires_gradient_sync(self, enabled):
            raise AssertionError("not reached")

    class Replicated(nn.Linear):  # what ddp adds
        def no_sync(self):
            raise AssertionError("not reached")

    with pytest.raises(NotImplementedError, match="stage 0 switches gradient sync like FSDP "
                                                  "but has no set_reshard_after_backward"):
        ScheduleZBH1(PipelineStage(Sharded(2, 2), 0, 1), 2, mse)
    with pytest.raises(NotImplementedError, match="stage 0 has ddp on a submodule, not on the "
                                                  "stage module itself"):
        ScheduleZBH1(PipelineStage(nn.Sequential(Replicated(2, 2)), 0, 1), 2, mse)
    ScheduleZBH1(PipelineStage(Replicated(2, 2), 0, 1), 2, mse)  # ddp on the stage: allowed
    zbv = pipeline([nn.Linear(2, 2) for _ in range(2)], schedule="ZB-V", n_microbatches=2)
    assert isinstance(zbv, ScheduleZBV)
    assert isinstance(pipeline([nn.Linear(2, 2)], schedule="zbh1", n_microbatches=2),
                      ScheduleZBH1)


def test_zbv_keeps_a_tied_embedding_on_rank_0():
    """With the V placement the first and last stages share rank 0, so an input embedding
    tied to the output layer is allowed, and both stages' W's add into its one gradient."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(11, 8), nn.Linear(8, 11, bias=False)
    head.weight = emb.weight
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)]
    full = nn.Sequential(emb, *blocks, head)
    ref = copy.deepcopy(full)
    four = split_into_stages([nn.Linear(8, 8) for _ in range(4)], 4, first=emb, last=head)
    check_no_shared_parameters(four, 2, "v")  # stages 0 and 3 both on rank 0
    with pytest.raises(ValueError, match="on another pipeline rank"):
        check_no_shared_parameters(four, 2)  # loop: stage 3 on rank 1
    modules = split_into_stages(blocks, 2, first=emb, last=head)
    stages = [PipelineStage(m, s, 2, placement="v") for s, m in enumerate(modules)]

    def ce(logits, y):
        return nn.functional.cross_entropy(logits.reshape(-1, 11), y.reshape(-1))

    x, y = torch.randint(11, (4, 3)), torch.randint(11, (4, 3))
    ScheduleZBV(stages, 2, ce).step(x, target=y)
    ce(ref(x), y).backward()
    for (name, p), q in zip(full.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")


class _FSDPStyle(nn.Linear):
    """What fully_shard adds that the pipeline uses; records the switches' latest values."""

    def set_requires_gradient_sync(self, enabled):
        self.sync = enabled

    def set_reshard_after_backward(self, enabled):
        self.reshard = enabled


def test_zero_bubble_data_parallel_checks_run_at_each_step():
    """fully_shard (no no_sync) on a stage was refused as "ddp on a submodule"; ddp or
    torch's DDP applied after the schedule was built (as the example applies dp) went
    unchecked; torch's DDP under a pipeline trained on wrong gradients without an error."""
    torch.manual_seed(0)
    ScheduleZBH1(PipelineStage(_FSDPStyle(2, 2), 0, 1), 2, mse)  # was NotImplementedError
    stage_module = nn.Sequential(nn.Linear(2, 2))
    schedule = ScheduleZBH1(PipelineStage(stage_module, 0, 1), 2, mse)
    stage_module[0].no_sync = lambda: None  # ddp on a submodule, after the schedule
    with pytest.raises(NotImplementedError, match="stage 0 has ddp on a submodule"):
        schedule.step(torch.randn(4, 2), target=torch.randn(4, 2))
    del stage_module[0].no_sync
    schedule.step(torch.randn(4, 2), target=torch.randn(4, 2))  # a refusal spoils nothing

    class TorchDDP(torch.nn.parallel.DistributedDataParallel):  # isinstance, no group
        def __init__(self, module):
            nn.Module.__init__(self)
            self.module = module

        def forward(self, *args):
            return self.module(*args)

    with pytest.raises(NotImplementedError, match="torch's DistributedDataParallel, whose "
                                                  "no_sync\\(\\) must wrap the forward"):
        Schedule1F1B(PipelineStage(TorchDDP(nn.Linear(2, 2)), 0, 1), 2, mse)


def test_a_failed_zero_bubble_step_restores_the_fsdp_switches():
    """A W that raises midway left the stage with gradient sync and reshard-after-backward
    off (B switched them off, only the last W switches them back)."""
    torch.manual_seed(0)
    module = _FSDPStyle(2, 2)
    calls = []

    def fail_second(grad):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("W failed")
        return grad

    module.weight.register_hook(fail_second)
    schedule = ScheduleZBH1(PipelineStage(module, 0, 1), 4, mse)
    with pytest.raises(ValueError, match="W failed"):
        schedule.step(torch.randn(8, 2), target=torch.randn(8, 2))
    assert (module.sync, module.reshard) == (True, True)
    with pytest.raises(RuntimeError, match="an earlier step failed midway"):
        schedule.step(torch.randn(8, 2), target=torch.randn(8, 2))


@pytest.mark.parametrize("args, kwargs, named", [
    (("zbv", 0, 8), {}, "num_ranks"),
    (("zbh1", 2, 0), {}, "n_microbatches"),
    (("zbh1", 2.0, 4), {}, "num_ranks"),
    (("zbv", 2, 4), {"forward": -1.0}, "forward"),
    (("zbv", 2, 4), {"weight": float("nan")}, "weight"),
    (("zbh1", 2, 4), {"backward_input": float("inf")}, "backward_input"),
    (("zbv", 2, 4), {"forward": 0, "backward_input": 0, "weight": 0}, "all 0"),
    (("1f1b", 2, 4), {}, "schedule"),
    (("zbv", 2, 2), {}, "at least 3 microbatches"),
    (("zbh1", 4, 3), {}, "at least 4 microbatches"),
    (("zbh1", 2, 4), {"forward": True}, "forward"),
    (("zbh1", 2, 4), {"weight": "1"}, "weight"),
    (("zbv", 2, 4), {"forward": 1e308, "backward_input": 1e308}, "too large"),
    (("zbv", 10**400, 10**401), {}, "too large"),
])
def test_zero_bubble_formula_refuses_what_has_no_bubble(args, kwargs, named):
    with pytest.raises(ValueError, match=named):
        zero_bubble_formula(*args, **kwargs)


def test_formulas_take_numpy_and_torch_numbers():
    import numpy as np
    import torch

    plain = zero_bubble_formula("zbh1", 2, 4, forward=1.0, backward_input=1.2, weight=0.8)
    assert zero_bubble_formula("zbh1", np.int64(2), torch.tensor(4), forward=np.float32(1.0),
                               backward_input=torch.tensor(1.2, dtype=torch.float64),
                               weight=0.8) == pytest.approx(plain)
    assert bubble_formula(np.int64(2), torch.tensor(4)) == bubble_formula(2, 4)


@pytest.mark.parametrize("seed", range(3))
def test_zb_h1_formula_with_any_costs(seed):
    """ZB-H1's idle ``(p - 1) max(t_F, t_B, t_F + t_B - t_W)`` against the simulator with
    seeded random costs and m >= p: the paper's ``(p - 1)(t_F + t_B - t_W)`` where W is the
    cheapest, and the larger of F and B where it is not (there the paper's formula is below
    the simulator: the case is made, not assumed)."""
    rng = random.Random(seed)
    dear_w = 0
    for _ in range(60):
        p = rng.randint(2, 6)
        m = rng.randint(p, 3 * p)
        f, b, w = (rng.uniform(0.1, 3.0) for _ in range(3))
        sim = simulate(zb_h1_order(p, m), p, forward=f, backward=b + w, weight=w)
        formula = zero_bubble_formula("zbh1", p, m, forward=f, backward_input=b, weight=w)
        assert sim.makespan == pytest.approx(m * (f + b + w) + (p - 1) * max(f, b, f + b - w))
        assert sim.bubble_fraction == pytest.approx(formula, abs=1e-12)
        if w > min(f, b):
            assert sim.makespan > m * (f + b + w) + (p - 1) * (f + b - w) + 1e-9
            dear_w += 1
    assert dear_w >= 10


def test_formulas_of_one_rank_have_no_bubble():
    assert bubble_formula(1, 4) == 0
    assert zero_bubble_formula("zbh1", 1, 4) == 0
    assert zero_bubble_formula("zbv", 1, 1, forward=2.0, backward_input=3.0, weight=0) == 0
    with pytest.raises(ValueError, match="chunks_per_rank"):
        bubble_formula(2, 4, 0)
