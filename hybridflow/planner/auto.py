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
    return OperatorCosts(
        {
            "generate": decode,
            "old_log_prob": fwd,
            "ref_log_prob": fwd,
            "values": fwd,
            "rm_score": fwd,
            "update_actor": train * cfg.actor.ppo_epochs,
            "update_critic": train * cfg.critic.ppo_epochs,
        }
    )


PROFILE_SHAPE = (8, 64)
"""(batch, length) of the cached device profile: decode per token depends on the batch (each step reads
every weight once), so a few rows, not one; small enough to measure SmolLM2 in well under a minute."""


PROFILE_VERSION = "engine-ops-1"
"""In the cache key: profiles measured another way (raw HF passes before this) are measured again."""


def cached_device_profile(cfg: RunConfig, threads: int) -> DeviceProfile:
    """trainer.device_profile, else a profile cached per model directory, thread count, dtype and decode rows
    (measured once). Decode runs at the rows one of `cfg`'s workers generates (decode's cost per token falls
    with the rows per step), stored per thread so that the key is the same for every layout of one batch."""
    if cfg.trainer.device_profile:
        return DeviceProfile.load(Path(cfg.trainer.device_profile))
    from hybridflow.models import resolve_model_path
    from hybridflow.models.default import cache_root

    model = resolve_model_path(cfg.model.path)
    dtype = profile_dtype(cfg, threads)
    per_thread = max(1, cfg.data.train_batch_size * cfg.rollout.n // max(1, cfg.world_size * threads))
    key = hashlib.sha1(f"{model.resolve()}:{threads}:{dtype}:{per_thread}:{PROFILE_VERSION}".encode()).hexdigest()[:12]
    path = cache_root() / "device_profiles" / f"{key}.json"
    if path.exists():
        return DeviceProfile.load(path)
    prof = profile_device(
        str(model), (threads,), [PROFILE_SHAPE], dtype=dtype, collectives=True, decode_rows_per_thread=per_thread
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.save(path)
    return prof


def profile_dtype(cfg: RunConfig, threads: int) -> torch.dtype:
    """The dtype the run's actor computes in (engine.param_dtype, "auto" resolved as the run will): thread
    speedups of bf16 and fp32 kernels differ, so the profile is measured in the one the run uses."""
    from hybridflow.utils.dtypes import DTYPES, resolve_dtype

    return DTYPES[resolve_dtype(cfg.actor.engine.param_dtype, cfg.trainer.device, threads)]


def micro_rows(cfg: RunConfig) -> dict[str, float]:
    """Rows per micro-batch of each operator (0 where token budgets size them: left out of the count)."""
    a, c = cfg.actor, cfg.critic
    rows = {
        "update_actor": 0 if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_device,
        "old_log_prob": 0 if a.use_dynamic_bsz else a.log_prob_micro_batch_size_per_device,
        "ref_log_prob": 0 if cfg.ref.log_prob_use_dynamic_bsz else cfg.ref.log_prob_micro_batch_size_per_device,
        "update_critic": 0 if c.use_dynamic_bsz else c.ppo_micro_batch_size_per_device,
        "values": 0 if c.use_dynamic_bsz else c.ppo_micro_batch_size_per_device,
    }
    return {op: float(n) for op, n in rows.items() if n}


def fsdp_sharded(cfg: RunConfig) -> bool:
    """Whether the actor's FSDP shards the model over its workers (else each holds it whole: CPU's default)."""
    workers = max(1, cfg.world_size)
    return cfg.actor.engine.resolve_fsdp_size(torch.device(cfg.trainer.device), workers) > 1


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
    from hybridflow.planner.search import model_params

    collectives = device.allreduce_latency_s > 0 or device.allreduce_s_per_byte > 0
    w = run_workers(cfg, device, threads, threads, model_params(cfg.model.path) if collectives else 0.0)
    return {p: predict_step_time_v1(placement_plan(cfg, p), costs, tokens, response, w) for p in candidates}


def run_workers(
    cfg: RunConfig, device: DeviceProfile, threads: int, base_threads: int, params: float, **shape: float
) -> Workers:
    """Cost model v1's Workers for a run: its FSDP layout, micro-batches and optimizer steps taken from `cfg`;
    `shape`: the model-shape fields (layers, hidden, ...) where tensor / sequence parallel needs them."""
    return Workers(
        threads,
        base_threads,
        device,
        params=params,
        optimizer_steps=optimizer_steps(cfg),
        param_bytes=2 if device.dtype == "bfloat16" else 4,
        rows=cfg.data.train_batch_size * cfg.rollout.n,
        micro_rows=micro_rows(cfg),
        sharded=fsdp_sharded(cfg),
        **shape,
    )


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


def resolve_auto_layout(cfg: RunConfig, cores: int) -> RunConfig:
    """`cfg` with trainer.n_workers_per_node=null replaced by a number of workers (unchanged otherwise).

    CUDA: one worker per visible GPU. The local backend: 1. CPU: every split of this node's `cores` into
    W workers x cores / W threads that the config accepts (batch sizes must divide over W), each priced by
    cost model v1 from a device profile at its thread count (measured once per thread count and cached),
    with trainer.placement=auto searched jointly; the fastest wins and the predictions are printed. With
    trainer.cpus_per_worker set, W is cores // cpus_per_worker (nothing to search)."""
    t = cfg.trainer
    if t.n_workers_per_node is not None:
        return cfg
    if t.device == "cuda":
        return _with_workers(cfg, torch.cuda.device_count())
    if t.backend == "local" or cores == 1:
        return _with_workers(cfg, 1)
    if t.cpus_per_worker:
        return _with_workers(cfg, max(1, cores // t.cpus_per_worker))
    predicted: dict[int, tuple[float, str]] = {}
    for workers in [w for w in range(1, cores + 1) if cores % w == 0]:
        try:
            candidate = _with_workers(cfg, workers)
        except ValueError:
            continue  # e.g. the mini-batch does not divide over this many workers
        threads = cores // workers
        times = predicted_placements(candidate, threads, cached_device_profile(candidate, threads))
        if t.placement != "auto":
            times = {t.placement: times[t.placement]} if t.placement in times else {}
        if times:
            best = min(times, key=times.get)
            predicted[workers] = (times[best], best)
    if not predicted:
        raise ValueError(
            f"trainer.n_workers_per_node=null: no split of {cores} cores into workers fits this run's "
            "batch sizes; set trainer.n_workers_per_node"
        )
    chosen = min(predicted, key=lambda w: predicted[w][0])
    print(
        "trainer.n_workers_per_node=null -> "
        + str(chosen)
        + " (predicted s/step: "
        + ", ".join(f"{w} x {cores // w} threads {s:.1f} ({p})" for w, (s, p) in sorted(predicted.items()))
        + ")",
        flush=True,
    )
    return _with_workers(cfg, chosen)


def _with_workers(cfg: RunConfig, workers: int) -> RunConfig:
    """`cfg` with trainer.n_workers_per_node set (every load-time check runs again on the result)."""
    return replace(cfg, trainer=replace(cfg.trainer, n_workers_per_node=workers))
