"""Cost model v0: a plan's step time from per-operator costs measured on a run.

A step is the trainer's phases in order (ppo_trainer.train_step): weight sync + generate, reward
model, forward passes (old log-probs, ref log-probs, values), updates (critic, actor). Phases run one
after another; inside a phase, operators of roles on the same placement set run one after another,
and different sets overlap (the trainer issues these calls non-blocking), so a phase takes as long
as its slowest set. An operator's time is seconds-per-token-per-device x its tokens / its role's dp:
v0 assumes perfect data-parallel scaling and no dispatch or transfer cost between sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from hybridflow.planner.plans import Plan

PHASES: tuple[tuple[tuple[str, str], ...], ...] = (
    (("actor_rollout", "weight_sync"), ("actor_rollout", "generate")),
    (("reward_model", "rm_score"),),
    (("actor_rollout", "old_log_prob"), ("ref", "ref_log_prob"), ("critic", "values")),
    (("critic", "update_critic"), ("actor_rollout", "update_actor")),
)
"""(role, operator) of each phase of a step, in the order the trainer runs them."""

RESPONSE_ONLY = frozenset({"generate"})
"""Operators whose work scales with response tokens; the others process prompt + response tokens."""

FIXED = frozenset({"weight_sync"})
"""Operators with a per-step cost in seconds, not a per-token one."""


@dataclass(frozen=True)
class OperatorCosts:
    """Measured costs of the operators on one kind of device."""

    seconds_per_token: dict[str, float]
    """Per operator: seconds per token on one device (time on dp devices = this x tokens / dp)."""
    fixed_s: dict[str, float] = field(default_factory=dict)
    """Per operator: seconds per step regardless of tokens (weight sync)."""


def operator_seconds(op: str, costs: OperatorCosts, dp: int, tokens: float, response_tokens: float) -> float:
    """Seconds `op` takes on `dp` devices for one step; 0 for an operator without a cost."""
    if op in FIXED:
        return costs.fixed_s.get(op, 0.0)
    n = response_tokens if op in RESPONSE_ONLY else tokens
    return costs.seconds_per_token.get(op, 0.0) * n / dp


def phase_seconds(plan: Plan, costs: OperatorCosts, tokens: float, response_tokens: float) -> list[float]:
    """Seconds of each phase of PHASES: the slowest set, each set summing its roles' operators."""
    roles = {r for s in plan.sets for r in s.roles}
    out = []
    for phase in PHASES:
        per_set: dict[int, float] = {}
        for role, op in phase:
            if role not in roles:
                continue
            idx = next(i for i, s in enumerate(plan.sets) if role in s.roles)
            per_set[idx] = per_set.get(idx, 0.0) + operator_seconds(op, costs, plan.of(role).dp, tokens,
                                                                    response_tokens)
        out.append(max(per_set.values(), default=0.0))
    return out


def predict_step_time(plan: Plan, costs: OperatorCosts, tokens: float, response_tokens: float) -> float:
    """Predicted seconds of one training step of `plan` (tokens: prompt + response of the whole batch)."""
    return sum(phase_seconds(plan, costs, tokens, response_tokens))


def costs_from_profile(profile: Sequence[dict[str, Any]], devices: int, forward_ops: Sequence[str]) -> OperatorCosts:
    """OperatorCosts from a profile.json (planner/profile.py) of a colocated run on `devices` workers.

    `forward_ops`: the forward operators that run (of old_log_prob, ref_log_prob, values); the run times
    them as one phase, so each is given an equal share of it (v0: same-sized models). The reward phase
    is charged to rm_score (the rule reward on the controller is negligible beside a model)."""
    rows = {row["metric"]: row for row in profile}

    def per_token(metric: str, share: float = 1.0) -> float | None:
        row = rows.get(metric)
        if row is None or not row["tokens_per_step"]:
            return None
        return row["median_s"] * share * devices / row["tokens_per_step"]

    found: dict[str, float | None] = {"generate": per_token("timing_s/gen"), "rm_score": per_token("timing_s/reward"),
                                      "update_actor": per_token("timing_s/update_actor_on_worker"),
                                      "update_critic": per_token("timing_s/update_critic_on_worker")}
    if found["update_actor"] is None:
        found["update_actor"] = per_token("timing_s/update")
    for op in forward_ops:
        found[op] = per_token("timing_s/old_log_prob_ref_values", 1.0 / len(forward_ops))
    fixed = {"weight_sync": rows["timing_s/weight_sync"]["median_s"]} if "timing_s/weight_sync" in rows else {}
    return OperatorCosts({op: v for op, v in found.items() if v is not None}, fixed)
