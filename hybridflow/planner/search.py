"""`hybridflow plan [--config FILE] [key=value ...] --profile PROFILE.json`: rank the plans of a run.

Enumerates the plans of the run's roles on its workers (planner/plans.py), drops those that do not
fit the device memory, predicts each one's step time from a colocated run's profile.json
(planner/cost.py), prints the top ones and writes the best runnable one as config overrides
(plan.yaml) that `hybridflow train --config plan.yaml` accepts. Runnable today: the placements
trainer/resolve.py builds -- colocate (one set) and split (actor_rollout on world // 2 workers, the
other roles on the rest); any other plan is printed as "not runnable yet".
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hybridflow.planner.cost import OperatorCosts, costs_from_profile, predict_step_time
from hybridflow.planner.plans import Plan, RoleModel, Workload, enumerate_plans, peak_memory, run_roles
from hybridflow.trainer.run_config import RunConfig


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


def workload_of(cfg: RunConfig, params: float, tokens: float) -> Workload:
    """The run's roles, each with `params` parameters (v0: critic, ref and reward model sized as the actor)."""
    return Workload(
        tuple(RoleModel(r, params, trained=r in ("actor_rollout", "critic")) for r in run_roles(cfg)), tokens
    )


def forward_ops(cfg: RunConfig) -> tuple[str, ...]:
    """The forward operators the profiled (colocated) run timed together as one phase."""
    from hybridflow.trainer.resolve import recompute_old_log_prob

    ops = ("old_log_prob",) if recompute_old_log_prob(cfg, cfg.world_size) else ()
    return ops + ("ref_log_prob",) * cfg.use_ref + ("values",) * cfg.use_critic


def needed_ops(cfg: RunConfig) -> tuple[str, ...]:
    """The per-token operators a step of this run executes."""
    return (
        ("generate", "update_actor")
        + forward_ops(cfg)
        + ("update_critic",) * cfg.use_critic
        + ("rm_score",) * bool(cfg.reward_model.enable)
    )


def rank_plans(
    cfg: RunConfig, costs: OperatorCosts, workload: Workload, response_tokens: float, device_memory: float
) -> list[RankedPlan]:
    """Every plan of the run on its workers that fits `device_memory`, fastest predicted first."""
    world = cfg.world_size
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
    from hybridflow.models import resolve_model_path

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


def plan_config(cfg: RunConfig, placement: str) -> RunConfig | None:
    """`cfg` with trainer.placement set, or None when the config checks reject that placement for this run."""
    try:
        return replace(cfg, trainer=replace(cfg.trainer, placement=placement))
    except ValueError:
        return None


def main(argv: Sequence[str]) -> int:
    """CLI of `hybridflow plan`; returns the exit code."""
    from hybridflow.config_utils import load_config, to_yaml

    parser = argparse.ArgumentParser(
        prog="hybridflow plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML file with the run's config fields")
    parser.add_argument("--profile", help="profile.json of a colocated run of this config (CPU workers)")
    parser.add_argument(
        "--cluster",
        help="plan for a GPU cluster instead, SPEC:GPUS (e.g. a100-80gb:64; specs in planner/gpu.py); needs --shape",
    )
    parser.add_argument("--shape", help="with --cluster: every role's model shape (llama-7b/13b/34b/70b)")
    parser.add_argument("--prompts", type=int, default=1024, help="with --cluster: prompts per step")
    parser.add_argument("--prompt-len", type=int, default=1024, help="with --cluster: tokens per prompt")
    parser.add_argument("--response-len", type=int, default=1024, help="with --cluster: tokens per response")
    parser.add_argument("--params", type=float, help="parameters per model (default: counted from model.path)")
    parser.add_argument(
        "--device-memory-gb", type=float, help="memory per device in GB (default: this machine's RAM / workers)"
    )
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--out", default="plan.yaml", help="where to write the best runnable plan")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.cluster:
        return main_gpu(args)
    if not args.profile:
        raise ValueError("hybridflow plan needs --profile PROFILE.json (a colocated run's) or --cluster SPEC:GPUS")
    cfg = load_config(RunConfig, args.config, args.overrides)
    rows = json.loads(Path(args.profile).read_text())
    by_metric = {r["metric"]: r for r in rows}
    if "timing_s/step" not in by_metric or "timing_s/gen" not in by_metric:
        raise ValueError(f"{args.profile} has no step/generate rows; is it a training run's profile.json?")
    costs = costs_from_profile(rows, cfg.world_size, forward_ops(cfg))
    missing = sorted(set(needed_ops(cfg)) - set(costs.seconds_per_token))
    if missing:
        print(
            f"warning: the profile has no cost for {', '.join(missing)} (counted as 0 s); "
            "profile a colocated run of this config"
        )
    params = args.params if args.params is not None else model_params(cfg.model.path)
    memory = (
        args.device_memory_gb * 1e9
        if args.device_memory_gb is not None
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / cfg.world_size
    )
    workload = workload_of(cfg, params, by_metric["timing_s/step"]["tokens_per_step"])
    ranked = rank_plans(cfg, costs, workload, by_metric["timing_s/gen"]["tokens_per_step"], memory)
    if not ranked:
        print(f"no plan fits {memory / 1e9:.1f} GB per device")
        return 1
    for i, r in enumerate(ranked[: args.top], 1):
        how = f"trainer.placement={r.placement}" if r.placement else "not runnable yet"
        print(f"{i:>2}. {r.step_s:8.2f} s/step  {r.memory_bytes / 1e9:6.2f} GB/device  {r.plan.describe()}  ({how})")
    best = next(((r, c) for r in ranked if r.placement for c in [plan_config(cfg, r.placement)] if c), None)
    if best is None:
        print("no runnable plan fits; nothing written")
        return 1
    Path(args.out).write_text(to_yaml(best[1]))
    print(f"wrote {args.out} (trainer.placement={best[0].placement}, predicted {best[0].step_s:.2f} s/step)")
    return 0


def main_gpu(args: argparse.Namespace) -> int:
    """`hybridflow plan --cluster SPEC:GPUS --shape NAME`: PPO's plans on a GPU cluster spec (planner/gpu_search.py)."""
    from hybridflow.planner.gpu import SHAPES, SPECS, RLWorkload
    from hybridflow.planner.gpu_search import search

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
