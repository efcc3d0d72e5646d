"""Pipeline schedules as data, in one process without a process group: the built-in action
lists, the validator's verdicts, the simulator's bubble and memory against the formulas, the
stage split, and the runtime itself on a pipeline of one rank (every stage local)."""

import copy

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
)

pytestmark = pytest.mark.timeout(60)

GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8, 12)]
INTERLEAVED_GRID = [(p, m, v) for p in (1, 2, 4) for m in (4, 8, 12) for v in (1, 2, 3)
                    if m % p == 0]


# -- actions and built-in orders ----------------------------------------------------------


def test_action_text_round_trip():
    assert str(Action(2, "B", 13)) == "2B13"
    assert Action.parse(" 2B13 ") == Action(2, "B", 13)
    assert parse_order({0: "0F0, 0B0"}) == {0: [Action(0, "F", 0), Action(0, "B", 0)]}
    with pytest.raises(ValueError, match="expected STAGE F|B MICROBATCH"):
        Action.parse("0W1")
    with pytest.raises(ValueError, match="kind must be"):
        Action(0, "X", 0)


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
