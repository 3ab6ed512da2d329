"""The cost model (planner/cost.py) on other layouts: thread speedups, tensor-parallel all-reduces, the controller's share."""

import pytest

from hybridflow.planner.cost import (
    OperatorCosts,
    Workers,
    costs_from_profile,
    dp_sync_seconds,
    micro_batches,
    optimizer_seconds,
    predict_one_step_off,
    predict_step_time,
    sp_collective_seconds,
    tp_collective_seconds,
    without_dp_sync,
)
from hybridflow.planner.device import DevicePoint, DeviceProfile
from hybridflow.planner.plans import PlacementSet, Plan, RoleParallel

COSTS = OperatorCosts(
    {"generate": 0.02, "old_log_prob": 0.002, "values": 0.002, "update_actor": 0.008, "update_critic": 0.004},
    {"controller": 1.0},
)
# per-token seconds at 1 and 2 threads: speedups forward 2, train 1.6, decode 1.5
DEVICE = DeviceProfile(
    "tiny",
    "float32",
    [DevicePoint(1, 4, 64, 1.0, 2.0, 3.0), DevicePoint(2, 4, 64, 0.5, 1.25, 2.0)],
    allreduce_latency_s=0.001,
    allreduce_s_per_byte=1e-9,
)
ROLES = ("actor_rollout", "critic")


def plan(*sets, par=None):
    return Plan(
        tuple(PlacementSet(r, n) for r, n in sets), tuple((x, par or RoleParallel(n)) for r, n in sets for x in r)
    )


def test_speedup_is_the_ratio_of_per_token_costs():
    assert DEVICE.speedup("forward", 2) == 2.0 and DEVICE.speedup("train", 2) == 1.6
    assert DEVICE.speedup("decode", 1) == 1.0 and DEVICE.speedup("decode", 4) == 1.0  # not measured: no speedup


def test_one_worker_of_two_threads():
    # gen 0.02*400/1.5 = 5.3333; forward 2*0.002*1000/2 = 2; update (8 + 4)/1.6 = 7.5; controller 1
    got = predict_step_time(plan((ROLES, 1)), COSTS, 1000, 400, Workers(threads=2, device=DEVICE))
    assert got == pytest.approx(1 + 400 * 0.02 / 1.5 + 2 + 7.5)


def test_split_overlaps_sets_within_a_phase():
    # gen 8 on the actor's worker; forward max(2, 2); update max(8, 4); controller 1
    got = predict_step_time(plan((("actor_rollout",), 1), (("critic",), 1)), COSTS, 1000, 400, Workers(device=DEVICE))
    assert got == pytest.approx(1 + 8 + 2 + 8)


def test_tensor_parallel_adds_all_reduces():
    w = Workers(device=DEVICE, layers=2, hidden=8, activation_bytes=4, decode_steps=10)
    got = predict_step_time(plan((ROLES, 2), par=RoleParallel(1, tp=2)), COSTS, 1000, 400, w)
    gen = 4 + 44 * 0.001 + 2 * 2 * 400 * 8 * 4 * 1e-9  # 2 all-reduces x 2 layers x 11 passes
    fwd = 2 * (1 + 4 * 0.001 + 2 * 2 * 1000 * 32 * 1e-9)
    update = 4 + 2 + 2 * (8 * 0.001 + 2 * 2 * 2000 * 32 * 1e-9)  # forward + backward: twice the traffic
    assert got == pytest.approx(1 + gen + fwd + update)
    # without a device profile collectives are free and threads change nothing
    assert predict_step_time(
        plan((ROLES, 2), par=RoleParallel(1, tp=2)), COSTS, 1000, 400, Workers(layers=2, hidden=8)
    ) == pytest.approx(1 + 4 + 2 + 6)


def test_sequence_parallel_adds_all_to_alls_but_not_to_generation():
    w = Workers(device=DEVICE, layers=2, hidden=8, activation_bytes=4, decode_steps=10)
    got = predict_step_time(plan((ROLES, 2), par=RoleParallel(1, sp=2)), COSTS, 1000, 400, w)
    gen = 4  # both workers generate as rollout dp ranks: no collectives
    # 4 all-to-alls x 2 layers per pass; each rank sends half of its 500 tokens' q/k/v/out activations
    fwd = 2 * (1 + 8 * 0.001 + 4 * 2 * 500 * 32 * 0.5 * 1e-9)
    update = 4 + 2 + 2 * (16 * 0.001 + 4 * 2 * 1000 * 32 * 0.5 * 1e-9)  # forward + backward
    assert got == pytest.approx(1 + gen + fwd + update)


def test_tp_and_sp_collectives_are_paid_per_micro_batch():
    one = Workers(device=DEVICE, layers=2, hidden=8, activation_bytes=4)
    four = Workers(device=DEVICE, layers=2, hidden=8, activation_bytes=4, rows=64, micro_rows={"update_actor": 8})
    assert micro_batches("update_actor", 2, four) == 4 and micro_batches("old_log_prob", 2, four) == 1
    # 64 rows over 2 dp groups in micro-batches of 8: 4 micro-batches, each paying every per-layer call
    extra_calls = 3 * 4 * 2 * 2  # 3 more micro-batches x 4 all-to-alls x 2 layers x 2 passes
    assert sp_collective_seconds("update_actor", 2, 2, 1000, four) == pytest.approx(
        sp_collective_seconds("update_actor", 2, 2, 1000, one) + extra_calls * 0.001
    )
    assert tp_collective_seconds("update_actor", 2, 2, 1000, 400, four) == pytest.approx(
        tp_collective_seconds("update_actor", 2, 2, 1000, 400, one) + 3 * 2 * 2 * 2 * 0.001
    )


def test_fsdp_traffic_over_dp_is_charged_and_can_be_taken_out_of_a_measured_run():
    w = Workers(device=DEVICE, params=1e6, optimizer_steps=2, param_bytes=2, grad_bytes=4)
    # update on 2 ranks: 2 gathers (fwd + bwd) of 2 MB + 2 reduce-scatters of 4 MB, each a quarter of the buffer
    assert dp_sync_seconds("update_actor", 2, w) == pytest.approx(4 * 0.001 + (2 * 2e6 + 2 * 4e6) / 4 * 1e-9)
    assert dp_sync_seconds("old_log_prob", 2, w) == pytest.approx(0.001 + 2e6 / 4 * 1e-9)
    assert dp_sync_seconds("generate", 2, w) == 0 and dp_sync_seconds("update_actor", 1, w) == 0
    # a 2-rank run's costs, traffic taken out, then predicted on 1 rank: no traffic; on 2 ranks: the run itself
    plain = without_dp_sync(COSTS, 2, 1000, w)
    assert plain.seconds_per_token["update_actor"] == pytest.approx(
        0.008 - dp_sync_seconds("update_actor", 2, w) * 2 / 1000
    )
    assert plain.seconds_per_token["generate"] == COSTS.seconds_per_token["generate"]
    two = predict_step_time(plan((ROLES, 2)), plain, 1000, 400, w)
    assert two == pytest.approx(predict_step_time(plan((ROLES, 2)), COSTS, 1000, 400, Workers(device=DEVICE)))
    # FSDP2 gathers again for every micro-batch: 64 rows over 2 ranks in micro-batches of 8 -> 4 x (fwd + bwd)
    micro = Workers(device=DEVICE, params=1e6, optimizer_steps=2, rows=64, micro_rows={"update_actor": 8})
    assert dp_sync_seconds("update_actor", 2, micro) == pytest.approx(10 * 0.001 + (8 * 2e6 + 2 * 4e6) / 4 * 1e-9)
    # every rank holding the model (engine.fsdp_size=1): only a full gradient all-reduce per optimizer step
    whole = Workers(device=DEVICE, params=1e6, optimizer_steps=2, grad_bytes=4, sharded=False)
    assert dp_sync_seconds("update_actor", 2, whole) == pytest.approx(2 * (0.001 + 4e6 * 1e-9))
    assert dp_sync_seconds("old_log_prob", 2, whole) == 0


def test_the_optimizer_step_is_paid_per_step_in_full_by_every_worker_holding_the_whole_model():
    costs = OperatorCosts(COSTS.seconds_per_token, {"controller": 1.0, "optimizer_step": 0.5})
    whole, sharded = Workers(optimizer_steps=2, sharded=False), Workers(optimizer_steps=2, sharded=True)
    assert optimizer_seconds("update_actor", costs, 2, whole) == 1.0  # 2 steps x 0.5 s on each of the 2 workers
    assert optimizer_seconds("update_actor", costs, 2, sharded) == 0.5  # each steps its half of the model
    assert (
        optimizer_seconds("old_log_prob", costs, 2, whole) == 0
        and optimizer_seconds("update_actor", COSTS, 2, whole) == 0
    )
    # in a step: 1 worker pays what 2 workers holding the model whole each pay, beside half the tokens each
    one = predict_step_time(plan((ROLES, 1)), costs, 1000, 400, whole)
    two = predict_step_time(plan((ROLES, 2)), costs, 1000, 400, whole)
    assert one - predict_step_time(plan((ROLES, 1)), COSTS, 1000, 400, whole) == pytest.approx(2 * 1.0)  # actor, critic
    assert two - predict_step_time(plan((ROLES, 2)), COSTS, 1000, 400, whole) == pytest.approx(2 * 1.0)


def test_costs_from_profile_subtracts_weight_sync_and_keeps_the_controller_share():
    rows = [
        {"metric": "timing_s/step", "median_s": 12.0, "tokens_per_step": 1000.0},
        {"metric": "timing_s/gen", "median_s": 4.0, "tokens_per_step": 400.0},
        {"metric": "timing_s/weight_sync", "median_s": 1.0, "tokens_per_step": 0.0},
        {"metric": "timing_s/old_log_prob_ref_values", "median_s": 2.0, "tokens_per_step": 1000.0},
        {"metric": "timing_s/update", "median_s": 5.5, "tokens_per_step": 1000.0},
    ]
    costs = costs_from_profile(rows, 2, ("old_log_prob",))
    assert costs.seconds_per_token["generate"] == pytest.approx(3 * 2 / 400)
    assert costs.seconds_per_token["update_actor"] == pytest.approx(5.5 * 2 / 1000)
    assert costs.fixed_s == pytest.approx({"weight_sync": 1.0, "controller": 0.5})


def test_one_step_off_overlaps_generation_with_training():
    # training set: actor + critic on 1 worker, in turn: forward 2 + 2, updates 8 + 4, controller 1 -> 17;
    # generate on 1 worker: 8 -> the step is max(8, 17) + 0.5 s transfer; with a slower generate (20 s): 20.5
    train = plan((ROLES, 1))
    assert predict_one_step_off(train, 1, COSTS, 1000, 400, Workers(), 0.5) == pytest.approx(17.5)
    slow_gen = OperatorCosts({**COSTS.seconds_per_token, "generate": 0.05}, COSTS.fixed_s)
    assert predict_one_step_off(train, 1, slow_gen, 1000, 400, Workers(), 0.5) == pytest.approx(20.5)
    # the sync step on 2 colocated workers for comparison: controller 1 + gen 4 + forward 2 + updates 6 = 13
    assert predict_step_time(plan((ROLES, 2)), COSTS, 1000, 400, Workers()) == pytest.approx(13)
