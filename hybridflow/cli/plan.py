"""`hybridflow plan [--config FILE] [key=value ...] --profile PROFILE.json`: rank the plans of a run.

The command line of planner/search.py: loads the run config, describes it to the planner
(config/plan_inputs.py), prints the ranking and writes the best runnable plan as a config
(plan.yaml) that `hybridflow train --config plan.yaml` accepts.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hybridflow.config.plan_inputs import run_shape
from hybridflow.config.run import RunConfig
from hybridflow.planner import search
from hybridflow.planner.cost import costs_from_profile
from hybridflow.planner.inputs import forward_ops, needed_ops
from hybridflow.utils.config_loader import load_config, to_yaml


def plan_config(cfg: RunConfig, placement: str) -> RunConfig | None:
    """`cfg` with trainer.placement set, or None when the config checks reject that placement for this run."""
    try:
        return replace(cfg, trainer=replace(cfg.trainer, placement=placement))
    except ValueError:
        return None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `hybridflow plan`."""
    parser = argparse.ArgumentParser(
        prog="hybridflow plan", description=search.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
    return parser


def main(argv: Sequence[str]) -> int:
    """CLI of `hybridflow plan`; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.cluster:
        return search.main_gpu(args)
    if not args.profile:
        raise ValueError("hybridflow plan needs --profile PROFILE.json (a colocated run's) or --cluster SPEC:GPUS")
    cfg = load_config(RunConfig, args.config, args.overrides)
    rows = json.loads(Path(args.profile).read_text())
    by_metric = {r["metric"]: r for r in rows}
    if "timing_s/step" not in by_metric or "timing_s/gen" not in by_metric:
        raise ValueError(f"{args.profile} has no step/generate rows; is it a training run's profile.json?")
    shape = run_shape(cfg)
    costs = costs_from_profile(rows, cfg.world_size, forward_ops(shape))
    missing = sorted(set(needed_ops(shape)) - set(costs.seconds_per_token))
    if missing:
        print(
            f"warning: the profile has no cost for {', '.join(missing)} (counted as 0 s); "
            "profile a colocated run of this config"
        )
    params = args.params if args.params is not None else search.model_params(cfg.model.path)
    memory = (
        args.device_memory_gb * 1e9
        if args.device_memory_gb is not None
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / cfg.world_size
    )
    workload = search.workload_of(shape, params, by_metric["timing_s/step"]["tokens_per_step"])
    ranked = search.rank_plans(cfg.world_size, costs, workload, by_metric["timing_s/gen"]["tokens_per_step"], memory)
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
