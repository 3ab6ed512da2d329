"""Plan enumeration and memory pruning (planner/plans.py), against hand-computed counts and bytes."""

from math import comb

import pytest

from hybridflow.planner.plans import (
    PlacementSet,
    Plan,
    RoleModel,
    RoleParallel,
    Workload,
    allocations,
    enumerate_plans,
    feasible_plans,
    fits,
    memory_per_device,
    peak_memory,
    role_memory_bytes,
    set_partitions,
)

ROLES = ("actor_rollout", "ref", "critic", "reward_model")


@pytest.mark.parametrize("k,bell", [(1, 1), (2, 2), (3, 5), (4, 15)])
def test_every_set_partition_exactly_once(k, bell):
    parts = list(set_partitions(ROLES[:k]))
    assert len(parts) == bell
    canonical = {frozenset(frozenset(block) for block in p) for p in parts}
    assert len(canonical) == bell  # no partition twice
    for p in parts:  # each is a partition: every role in exactly one non-empty block
        assert sorted(r for block in p for r in block) == sorted(ROLES[:k])
        assert all(block for block in p)


@pytest.mark.parametrize("n,s", [(1, 1), (4, 1), (4, 2), (4, 3), (4, 4), (6, 3), (2, 3)])
def test_allocations_give_each_set_at_least_one_device(n, s):
    allocs = list(allocations(n, s))
    assert len(allocs) == (comb(n - 1, s - 1) if n >= s else 0)
    assert len(set(allocs)) == len(allocs)
    assert all(sum(a) == n and min(a) >= 1 and len(a) == s for a in allocs)


def test_plan_counts():
    # 2 roles on 2 devices: [a, r] x2, and [a] x1 | [r] x1
    assert len(list(enumerate_plans(ROLES[:2], 2))) == 2
    # 3 roles on 4 devices: 1 one-set partition x C(3,0) + 3 two-set x C(3,1) + 1 three-set x C(3,2) = 13
    plans = list(enumerate_plans(ROLES[:3], 4))
    assert len(plans) == 1 + 3 * 3 + 3
    assert len(set(plans)) == len(plans)
    # 4 roles on 2 devices: only partitions into <= 2 sets: 1 + 7 two-set partitions (S(4,2)=7)
    assert len(list(enumerate_plans(ROLES, 2))) == 8
    for p in plans:
        assert all(p.of(r).dp == p.set_of(r).devices and p.of(r).tp == 1 for r in ROLES[:3])


ACTOR = RoleModel("actor_rollout", params=1e6, trained=True, activation_bytes_per_token=100)
REF = RoleModel("ref", params=1e6, trained=False)
CRITIC = RoleModel("critic", params=2e6, trained=True, param_bytes=2)
WORK = Workload((ACTOR, REF, CRITIC), tokens_per_step=1000)


def test_role_memory_hand_computed():
    # trained fp32: 4 params + 4 grads + 8 Adam = 16 B/param, sharded over dp=2; activations 100 B x 1000 / 2
    assert role_memory_bytes(ACTOR, RoleParallel(dp=2), 1000) == 16e6 / 2 + 100 * 1000 / 2
    assert role_memory_bytes(REF, RoleParallel(dp=4), 1000) == 4e6 / 4
    # trained bf16: 2 + 2 + 8 = 12 B/param
    assert role_memory_bytes(CRITIC, RoleParallel(dp=1), 1000) == 24e6


def test_plan_memory_and_pruning():
    colocated = Plan((PlacementSet(ROLES[:3], 2),), tuple((r, RoleParallel(2)) for r in ROLES[:3]))
    # per device: actor 8e6 + 5e4, ref 2e6, critic 12e6
    assert peak_memory(colocated, WORK) == 8e6 + 5e4 + 2e6 + 12e6
    split = Plan(
        (PlacementSet(("actor_rollout", "ref"), 1), PlacementSet(("critic",), 1)),
        (("actor_rollout", RoleParallel(1)), ("ref", RoleParallel(1)), ("critic", RoleParallel(1))),
    )
    mem = memory_per_device(split, WORK)
    assert mem[split.sets[0]] == 16e6 + 1e5 + 4e6 and mem[split.sets[1]] == 24e6
    assert fits(colocated, WORK, 23e6) and not fits(split, WORK, 23e6)
    # 2 devices, 23 MB each: 5 partitions -> 1 + 3 plans; only the all-colocated one (dp=2) fits
    feasible = feasible_plans(WORK, devices=2, device_memory=23e6)
    assert [p.describe() for p in feasible] == ["[actor_rollout, ref, critic] x2"]
    assert len(feasible_plans(WORK, devices=2, device_memory=1e9)) == 4


def test_run_roles_follow_the_config():
    from hybridflow.config.plan_inputs import run_roles
    from hybridflow.config.run import RunConfig
    from hybridflow.utils.config_loader import load_config

    assert run_roles(load_config(RunConfig, None, ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=false"])) == (
        "actor_rollout",
    )
    assert run_roles(load_config(RunConfig, None, ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true"])) == (
        "actor_rollout",
        "ref",
        "critic",
    )
