"""trainer.placement=auto: the runnable placement the cost model predicts fastest, chosen at load.

Runnable today: colocate, and split when the run has a second role for the other half (critic or
ref) or an off-policy trainer.mode (then split is the only choice). The operators' per-token costs
come from a device profile (planner/device.py: forward, forward + backward and decode per token at
the worker's thread count); tokens per step from the data sizes (every prompt and response at its
maximum length: an upper bound, the same for every plan so the ranking does not depend on it).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import torch

from hybridflow.planner.cost import OperatorCosts, Workers, predict_step_time_v1
from hybridflow.planner.device import DeviceProfile, profile_device
from hybridflow.planner.plans import PlacementSet, Plan, RoleParallel, run_roles
from hybridflow.trainer.run_config import RunConfig


def placement_plan(cfg: RunConfig, placement: str) -> Plan:
    """The planner's Plan of a runnable trainer.placement (sync mode) for `cfg`'s roles and workers."""
    roles, world = run_roles(cfg), cfg.world_size
    if placement == "colocate":
        return Plan((PlacementSet(roles, world),), tuple((r, RoleParallel(world)) for r in roles))
    first = world // 2
    sets = (PlacementSet(("actor_rollout",), first), PlacementSet(roles[1:], world - first))
    return Plan(sets, tuple((r, RoleParallel(s.devices)) for s in sets for r in s.roles))


def device_costs(device: DeviceProfile, threads: int, cfg: RunConfig) -> OperatorCosts:
    """Per-token seconds of each operator on one worker of `threads` threads, from the device profile
    (the point of that thread count closest to 1 thread's when it was not measured; an update costs
    ppo_epochs forward + backward passes)."""
    at = [p for p in device.points if p.threads == threads] or [p for p in device.points if p.threads == 1]
    if not at:
        raise ValueError(f"the device profile of {device.model} has no point at {threads} or 1 thread(s)")
    fwd = min(p.forward_s_per_token for p in at)
    train = min(p.train_s_per_token for p in at)
    decode = min(p.decode_s_per_token for p in at)
    return OperatorCosts({"generate": decode, "old_log_prob": fwd, "ref_log_prob": fwd, "values": fwd,
                          "rm_score": fwd, "update_actor": train * cfg.actor.ppo_epochs,
                          "update_critic": train * cfg.critic.ppo_epochs})


def cached_device_profile(cfg: RunConfig, threads: int) -> DeviceProfile:
    """trainer.device_profile, else a profile cached per model directory, thread count and dtype (measured once)."""
    if cfg.trainer.device_profile:
        return DeviceProfile.load(Path(cfg.trainer.device_profile))
    from hybridflow.models import resolve_model_path
    from hybridflow.models.default import cache_root

    model = resolve_model_path(cfg.model.path)
    dtype = profile_dtype(cfg, threads)
    key = hashlib.sha1(f"{model.resolve()}:{threads}:{dtype}".encode()).hexdigest()[:12]
    path = cache_root() / "device_profiles" / f"{key}.json"
    if path.exists():
        return DeviceProfile.load(path)
    prof = profile_device(str(model), (threads,), [(2, 64)], dtype=dtype, collectives=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.save(path)
    return prof


def profile_dtype(cfg: RunConfig, threads: int) -> torch.dtype:
    """The dtype the run's actor computes in (engine.param_dtype, "auto" resolved as the run will): thread
    speedups of bf16 and fp32 kernels differ, so the profile is measured in the one the run uses."""
    from hybridflow.utils.dtypes import resolve_dtype

    return getattr(torch, resolve_dtype(cfg.actor.engine.param_dtype, cfg.trainer.device, threads))


def optimizer_steps(cfg: RunConfig) -> float:
    """Optimizer steps of the actor per training step: mini-batches x PPO epochs."""
    return cfg.data.train_batch_size / cfg.actor.ppo_mini_batch_size * cfg.actor.ppo_epochs


def predicted_placements(cfg: RunConfig, threads: int, device: DeviceProfile) -> dict[str, float]:
    """Predicted seconds per step of each runnable placement of `cfg` (sync mode)."""
    candidates = ["colocate"] + ["split"] * (cfg.world_size >= 2 and (cfg.use_critic or cfg.use_ref))
    d = cfg.data
    batch = d.train_batch_size * cfg.rollout.n
    tokens, response = batch * (d.max_prompt_length + d.max_response_length), batch * d.max_response_length
    costs = device_costs(device, threads, cfg)
    return {p: predict_step_time_v1(placement_plan(cfg, p), costs, tokens, response, Workers(threads, threads))
            for p in candidates}


def resolve_auto_placement(cfg: RunConfig, threads: int) -> RunConfig:
    """`cfg` with trainer.placement=auto replaced by the chosen placement (unchanged otherwise)."""
    if cfg.trainer.placement != "auto":
        return cfg
    if cfg.trainer.mode != "sync":
        chosen = "split"
    else:
        predicted = predicted_placements(cfg, threads, cached_device_profile(cfg, threads))
        chosen = min(predicted, key=predicted.get)
    return replace(cfg, trainer=replace(cfg.trainer, placement=chosen))
