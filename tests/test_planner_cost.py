"""Cost model v0 (planner/cost.py) on hand-computed plans."""

import pytest

from hybridflow.planner.cost import OperatorCosts, costs_from_profile, phase_seconds, predict_step_time
from hybridflow.planner.plans import PlacementSet, Plan, RoleParallel, enumerate_plans

COSTS = OperatorCosts(
    {
        "generate": 0.01,
        "old_log_prob": 0.001,
        "ref_log_prob": 0.001,
        "values": 0.002,
        "update_actor": 0.004,
        "update_critic": 0.003,
    },
    {"weight_sync": 0.5},
)
ROLES = ("actor_rollout", "ref", "critic")


def plan(*sets):
    return Plan(tuple(PlacementSet(r, n) for r, n in sets), tuple((x, RoleParallel(n)) for r, n in sets for x in r))


def test_colocated_runs_every_operator_in_turn():
    p = plan((ROLES, 2))
    # gen 0.5 + 0.01*400/2; forwards (0.001+0.001+0.002)*1000/2; updates (0.004+0.003)*1000/2
    assert phase_seconds(p, COSTS, 1000, 400) == pytest.approx([2.5, 0.0, 2.0, 3.5])
    assert predict_step_time(p, COSTS, 1000, 400) == pytest.approx(8.0)


def test_split_sets_overlap_within_a_phase():
    p = plan((("actor_rollout", "ref"), 1), (("critic",), 1))
    # gen 0.5 + 4; forwards max(2, 2); updates max(4, 3)
    assert phase_seconds(p, COSTS, 1000, 400) == pytest.approx([4.5, 0.0, 2.0, 4.0])
    assert predict_step_time(p, COSTS, 1000, 400) == pytest.approx(10.5)
    # critic on 3 devices, actor+ref on 1: forwards max(2, 0.667), updates max(4, 1)
    assert predict_step_time(plan((("actor_rollout", "ref"), 1), (("critic",), 3)), COSTS, 1000, 400) == pytest.approx(
        4.5 + 2.0 + 4.0
    )


def test_best_plan_on_two_devices_is_colocated_here():
    times = {p.describe(): predict_step_time(p, COSTS, 1000, 400) for p in enumerate_plans(ROLES, 2)}
    assert len(times) == 4
    assert min(times, key=times.get) == "[actor_rollout, ref, critic] x2"


def test_costs_from_profile():
    profile = [
        {"metric": "timing_s/gen", "median_s": 3.0, "tokens_per_step": 300.0},
        {"metric": "timing_s/old_log_prob_ref_values", "median_s": 2.0, "tokens_per_step": 1000.0},
        {"metric": "timing_s/update", "median_s": 4.5, "tokens_per_step": 1000.0},
        {"metric": "timing_s/update_actor_on_worker", "median_s": 4.0, "tokens_per_step": 1000.0},
        {"metric": "timing_s/weight_sync", "median_s": 0.3, "tokens_per_step": 0.0},
    ]
    costs = costs_from_profile(profile, devices=2, forward_ops=("old_log_prob", "ref_log_prob"))
    assert costs.seconds_per_token == pytest.approx(
        {"generate": 0.018, "old_log_prob": 0.002, "ref_log_prob": 0.002, "update_actor": 0.008}
    )
    assert costs.fixed_s == {"weight_sync": 0.3}  # the gen phase's 3 s include it: (3 - 0.3) * 2 / 300 = 0.018
    # the run it came from: colocated on 2 devices -> its own phases back (3.0 + 2.0 + 4.0)
    p = plan((("actor_rollout", "ref"), 2))
    assert predict_step_time(p, costs, 1000, 300) == pytest.approx(3.0 + 2.0 + 4.0)
