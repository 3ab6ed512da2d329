"""Rank the plans of a run (`hybridflow plan`, whose command line lives in cli/plan.py).

Enumerates the plans of the run's roles on its workers (planner/plans.py), drops those that do not
fit the device memory, predicts each one's step time from a colocated run's profile.json
(planner/cost.py), prints the top ones and writes the best runnable one as config overrides
(plan.yaml) that `hybridflow train --config plan.yaml` accepts. Runnable today: the placements
config/resolve.py builds -- colocate (one set) and split (actor_rollout on world // 2 workers, the
other roles on the rest); any other plan is printed as "not runnable yet".
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from hybridflow.models import resolve_model_path
from hybridflow.planner.cost import OperatorCosts, predict_step_time
from hybridflow.planner.gpu import SHAPES, SPECS, RLWorkload
from hybridflow.planner.gpu_search import search
from hybridflow.planner.inputs import RunShape
from hybridflow.planner.plans import Plan, RoleModel, Workload, enumerate_plans, peak_memory


@dataclass(frozen=True)
class RankedPlan:
    """A plan with its predictions."""

    plan: Plan
    """The layout."""
    step_s: float
    """Predicted seconds per training step."""
    memory_bytes: float
    """Predicted peak bytes per device."""
    placement: str | None
    """trainer.placement that builds this plan today (colocate / split), None when none does."""


def placement_of(plan: Plan, world: int) -> str | None:
    """The trainer.placement that builds `plan` on `world` workers, or None (not runnable yet)."""
    if len(plan.sets) == 1:
        return "colocate"
    first, *rest = plan.sets
    if len(rest) == 1 and first.roles == ("actor_rollout",) and first.devices == world // 2:
        return "split"
    return None


def workload_of(shape: RunShape, params: float, tokens: float) -> Workload:
    """The run's roles, each with `params` parameters (critic, ref and reward model sized as the actor)."""
    return Workload(tuple(RoleModel(r, params, trained=r in ("actor_rollout", "critic")) for r in shape.roles), tokens)


def rank_plans(
    workers: int, costs: OperatorCosts, workload: Workload, response_tokens: float, device_memory: float
) -> list[RankedPlan]:
    """Every plan of `workload` on `workers` devices that fits `device_memory`, fastest predicted first."""
    world = workers
    ranked = []
    for plan in enumerate_plans(workload.roles, world):
        memory = peak_memory(plan, workload)
        if memory <= device_memory:
            ranked.append(
                RankedPlan(
                    plan,
                    predict_step_time(plan, costs, workload.tokens_per_step, response_tokens),
                    memory,
                    placement_of(plan, world),
                )
            )
    return sorted(ranked, key=lambda r: (r.step_s, r.placement is None))


def model_params(model_path: str) -> float:
    """Parameter count of a model directory, from its safetensors headers (no weights are read)."""

    total = 0.0
    for file in sorted(resolve_model_path(model_path).glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= d
                total += n
    return total


def main_gpu(args: argparse.Namespace) -> int:
    """`hybridflow plan --cluster SPEC:GPUS --shape NAME`: PPO's plans on a GPU cluster spec (planner/gpu_search.py)."""

    name, _, gpus = args.cluster.partition(":")
    if name not in SPECS or not gpus.isdigit():
        raise ValueError(f"--cluster {args.cluster!r}: expected SPEC:GPUS with SPEC one of {sorted(SPECS)}")
    if args.shape not in SHAPES:
        raise ValueError(f"--shape {args.shape!r}: choose one of {sorted(SHAPES)}")
    workload = RLWorkload(args.prompts, args.prompt_len, args.response_len)
    ranked = search(SHAPES[args.shape], workload, SPECS[name], int(gpus))
    if not ranked:
        print(f"no plan fits {args.shape} x4 roles on {gpus} x {name}")
        return 1
    for i, plan in enumerate(ranked[: args.top], 1):
        print(f"{i:>2}. {plan.step_s:8.1f} s/step  {plan.describe()}")
    return 0
