"""trainer.placement=auto and trainer.n_workers_per_node=null: predicted step times of the runnable layouts.

Runnable today: colocate, and split when the run has a second role for the other half (critic or
ref). The operators' per-token costs come from a device profile (planner/device.py: forward, forward
+ backward and decode per token at the worker's thread count); tokens per step from the data sizes
(every prompt and response at its maximum length: an upper bound, the same for every plan so the
ranking does not depend on it). Every function here is pure except `cached_device_profiles`, which
measures the machine once and caches the result; the trainer calls it before resolving a run
(config/measure.py) and picks the layout from the predictions (config/layout.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.models.default import cache_root
from hybridflow.planner.cost import OperatorCosts, Workers, predict_step_time
from hybridflow.planner.device import DeviceProfile
from hybridflow.planner.inputs import RunShape
from hybridflow.planner.layouts import Layout, profile_layouts
from hybridflow.planner.plans import PlacementSet, Plan, RoleParallel
from hybridflow.utils.hardware import cpu_signature


def placement_plan(shape: RunShape, placement: str) -> Plan:
    """The planner's Plan of a runnable trainer.placement (sync mode) for the run's roles and workers."""
    roles, world = shape.roles, shape.workers
    if placement == "colocate":
        return Plan((PlacementSet(roles, world),), tuple((r, RoleParallel(world)) for r in roles))
    first = world // 2
    sets = (PlacementSet(("actor_rollout",), first), PlacementSet(roles[1:], world - first))
    return Plan(sets, tuple((r, RoleParallel(s.devices)) for s in sets for r in s.roles))


def device_costs(device: DeviceProfile, threads: int, shape: RunShape) -> OperatorCosts:
    """Per-token seconds of each operator on one worker of `threads` threads, from the device profile
    (the point of that thread count closest to 1 thread's when it was not measured; an update costs
    ppo_epochs forward + backward passes)."""
    at = [p for p in device.points if p.threads == threads] or [p for p in device.points if p.threads == 1]
    if not at:
        raise ValueError(f"the device profile of {device.model} has no point at {threads} or 1 thread(s)")
    fwd = min(p.forward_s_per_token for p in at)
    train = min(p.train_s_per_token for p in at)
    decode = min(p.decode_s_per_token for p in at)
    return OperatorCosts(
        {
            "generate": decode,
            "old_log_prob": fwd,
            "ref_log_prob": fwd,
            "values": fwd,
            "rm_score": fwd,
            "update_actor": train * shape.actor_epochs,
            "update_critic": train * shape.critic_epochs,
        },
        {"optimizer_step": min(p.optimizer_s for p in at)},
    )


PROFILE_SHAPE = (8, 64)
"""(batch, length) of the cached device profile: decode per token depends on the batch (each step reads
every weight once), so a few rows, not one; small enough to measure SmolLM2 in well under a minute."""


PROFILE_VERSION = "layouts-4"
"""In the cache key: profiles measured another way (raw HF passes; one worker alone; the optimizer step
inside the per-token update cost; each layout in its own set of processes; bf16 decode before the bf16 products of
rollout/native/panel.py, before this) are measured again."""


@dataclass(frozen=True)
class ProfileSpec:
    """What one cached device profile measures (its cache key, with the model and this CPU)."""

    threads: int
    """torch threads per worker."""
    dtype: torch.dtype
    """The actor's compute dtype."""
    rows_per_thread: int
    """Rows decoded per thread (decode's cost per token falls with the rows per step)."""
    workers: int = 1
    """Workers running at once on the node, each `threads` threads."""
    collectives: bool = True
    """Price gloo's collectives (a run of more than one worker)."""

    def path(self, model: Path) -> Path:
        key = f"{model.resolve()}:{self.threads}:{self.dtype}:{self.rows_per_thread}:{self.workers}"
        key += f":{self.collectives}:{PROFILE_VERSION}:{cpu_signature()}"
        return cache_root() / "device_profiles" / f"{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def cached_device_profiles(model: Path, specs: Sequence[ProfileSpec]) -> list[DeviceProfile]:
    """The device profile of the model directory `model` for each of `specs` (same order): read from the cache,
    else measured (a minute or more; the missing ones of one dtype together, planner/layouts.py) and cached
    per CPU (`cpu_signature`). The one function here that measures."""
    paths = [spec.path(model) for spec in specs]
    missing = [(spec, path) for spec, path in zip(specs, paths) if not path.exists()]
    for dtype in {spec.dtype for spec, _ in missing}:
        todo = [(spec, path) for spec, path in missing if spec.dtype == dtype]
        layouts = [Layout(s.workers, s.threads, s.rows_per_thread * s.threads, s.collectives) for s, _ in todo]
        for (_, path), prof in zip(todo, profile_layouts(str(model), layouts, PROFILE_SHAPE, dtype)):
            prof.save(path)
    return [DeviceProfile.load(path) for path in paths]


def has_collectives(device: DeviceProfile) -> bool:
    """Whether the profile prices the collectives FSDP pays between workers (then the model's size matters)."""
    return device.allreduce_latency_s > 0 or device.allreduce_s_per_byte > 0


def run_workers(
    shape: RunShape, device: DeviceProfile, threads: int, base_threads: int, params: float, **model_shape: float
) -> Workers:
    """The cost model's Workers for a run: its FSDP layout, micro-batches and optimizer steps taken from `shape`;
    `model_shape`: the model-shape fields (layers, hidden, ...) where tensor / sequence parallel needs them."""
    return Workers(
        threads,
        base_threads,
        device,
        params=params,
        optimizer_steps=shape.optimizer_steps,
        param_bytes=2 if device.dtype == "bfloat16" else 4,
        rows=shape.rows,
        micro_rows=dict(shape.micro_rows),
        sharded=shape.sharded,
        **model_shape,
    )


def predicted_placements(shape: RunShape, threads: int, device: DeviceProfile, params: float) -> dict[str, float]:
    """Predicted seconds per step of each runnable placement (sync mode) of a run of `params` parameters
    per model (used only where the profile prices collectives)."""
    candidates = ["colocate"] + ["split"] * (shape.workers >= 2 and (shape.use_critic or shape.use_ref))
    batch = shape.rows
    tokens, response = batch * (shape.prompt_length + shape.response_length), batch * shape.response_length
    costs = device_costs(device, threads, shape)
    w = run_workers(shape, device, threads, threads, params if has_collectives(device) else 0.0)
    skip = frozenset() if shape.recompute_old_log_prob else frozenset({"old_log_prob"})
    return {p: predict_step_time(placement_plan(shape, p), costs, tokens, response, w, skip) for p in candidates}
