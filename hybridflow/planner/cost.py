"""The planner's cost model: a plan's step time from per-operator costs measured on a run. `placement=auto`,
the layout search (planner/auto.py) and `hybridflow plan` (planner/search.py) all predict with it.

A step is the trainer's phases in order (ppo_trainer.train_step): weight sync + generate, reward
model, forward passes (old log-probs, ref log-probs, values), updates (critic, actor), plus the controller's own
time. Phases run one after another; inside a phase, operators of roles on the same placement set run one after
another, and different sets overlap (the trainer issues these calls non-blocking), so a phase takes as long as its
slowest set. An operator's time is its measured seconds-per-token-per-device x its tokens / its role's devices,
scaled by the measured thread speedup (`Workers`), plus what its layout adds: tensor- and sequence-parallel
collectives, FSDP's gathers and gradient reduction, the optimizer step. With the default `Workers` (the profiled
run's threads, no device profile) the collectives cost nothing and data parallel scales perfectly. GPU clusters
this project cannot reach are priced analytically instead (planner/gpu.py), not by this model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.planner.device import DeviceProfile
from hybridflow.planner.plans import Plan, RoleParallel

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


def costs_from_profile(profile: Sequence[dict[str, Any]], devices: int, forward_ops: Sequence[str]) -> OperatorCosts:
    """OperatorCosts from a profile.json (planner/profile.py) of a colocated run on `devices` workers.

    `forward_ops`: the forward operators that run (of old_log_prob, ref_log_prob, values); the run times
    them as one phase, so each is given an equal share of it (same-sized models). The reward phase
    is charged to rm_score (the rule reward on the controller is negligible beside a model)."""
    rows = {row["metric"]: row for row in profile}

    def per_token(metric: str, share: float = 1.0) -> float | None:
        row = rows.get(metric)
        if row is None or not row["tokens_per_step"]:
            return None
        return row["median_s"] * share * devices / row["tokens_per_step"]

    found: dict[str, float | None] = {
        "generate": per_token("timing_s/gen"),
        "rm_score": per_token("timing_s/reward"),
        "update_actor": per_token("timing_s/update_actor_on_worker"),
        "update_critic": per_token("timing_s/update_critic_on_worker"),
    }
    if found["update_actor"] is None:
        found["update_actor"] = per_token("timing_s/update")
    for op in forward_ops:
        found[op] = per_token("timing_s/old_log_prob_ref_values", 1.0 / len(forward_ops))
    fixed = {"weight_sync": rows["timing_s/weight_sync"]["median_s"]} if "timing_s/weight_sync" in rows else {}
    if fixed and found["generate"] is not None:  # the gen phase's time includes the weight sync before it
        gen = rows["timing_s/gen"]
        found["generate"] = max(0.0, gen["median_s"] - fixed["weight_sync"]) * devices / gen["tokens_per_step"]
    if "timing_s/step" in rows:  # what no operator accounts for: advantages, dispatch, the controller's work
        phases = ("timing_s/gen", "timing_s/reward", "timing_s/old_log_prob_ref_values")
        timed = sum(rows[m]["median_s"] for m in phases if m in rows)
        on_workers = ("timing_s/update_actor_on_worker", "timing_s/update_critic_on_worker")
        if "timing_s/update" in rows:  # the update phase as the controller timed it, else as the workers did
            timed += rows["timing_s/update"]["median_s"]
        else:
            timed += sum(rows[m]["median_s"] for m in on_workers if m in rows)
        fixed["controller"] = max(0.0, rows["timing_s/step"]["median_s"] - timed)
    return OperatorCosts({op: v for op, v in found.items() if v is not None}, fixed)


KIND_OF = {
    "generate": "decode",
    "old_log_prob": "forward",
    "ref_log_prob": "forward",
    "values": "forward",
    "rm_score": "forward",
    "update_actor": "train",
    "update_critic": "train",
}
"""The measured operator kind (planner/device.py) whose thread scaling each operator follows."""


@dataclass(frozen=True)
class Workers:
    """How a plan's workers run, for predicting measured runs from a profiled one."""

    threads: int = 1
    """Threads per worker of the plan."""
    base_threads: int = 1
    """Threads per worker of the run the OperatorCosts were measured on."""
    device: DeviceProfile | None = None
    """Thread speedups and all-reduce costs; None: threads do not change speed, collectives are free."""
    layers: int = 0
    """Decoder layers of the model (each costs 2 tensor-parallel all-reduces per forward pass)."""
    hidden: int = 0
    """Hidden size (the all-reduced activation's width)."""
    activation_bytes: int = 4
    """Bytes per all-reduced activation element."""
    decode_steps: float = 0.0
    """Decode steps of one generate call (its all-reduces are one per layer-half per step)."""
    params: float = 0.0
    """Parameters of the trained model (FSDP's traffic over dp: 0 leaves it out)."""
    optimizer_steps: float = 1.0
    """Optimizer steps per training step (mini-batches x epochs): one gradient reduce-scatter each."""
    param_bytes: int = 2
    """Bytes per parameter FSDP all-gathers (the compute dtype)."""
    grad_bytes: int = 4
    """Bytes per gradient element FSDP reduces (engine.reduce_dtype, fp32)."""
    sharded: bool = True
    """FSDP shards the model over the dp ranks (gathers per pass, gradient reduce-scatter); False: every rank
    holds it whole (engine.fsdp_size=1, the CPU default), and the gradients are all-reduced."""
    rows: float = 0.0
    """Sequences per step (prompts x samples), to count micro-batches; 0: one micro-batch per operator."""
    micro_rows: dict[str, float] = field(default_factory=dict)
    """Per operator: rows per micro-batch of one dp group (the *_micro_batch_size_per_device keys); tensor and
    sequence parallel pay their per-layer collectives once per micro-batch. Absent: one micro-batch."""


def micro_batches(op: str, dp: int, w: Workers) -> float:
    """Micro-batches `op` runs on each of its `dp` groups in one step (1 when not known)."""
    per = w.micro_rows.get(op, 0.0)
    return float(max(1, math.ceil(w.rows / dp / per))) if per and w.rows else 1.0


def tp_collective_seconds(op: str, tp: int, dp: int, tokens: float, response_tokens: float, w: Workers) -> float:
    """Seconds of a tensor-parallel operator's all-reduces: 2 per layer per forward pass of each micro-batch
    (attention and MLP outputs, Megatron-style), twice that for an update (backward), one pass per decode
    step for generate."""
    if tp == 1 or w.device is None:
        return 0.0
    if op == "generate":
        calls, rows = 2 * w.layers * (w.decode_steps + 1), response_tokens / dp
    else:
        passes = 2 if op.startswith("update") else 1
        calls, rows = 2 * w.layers * passes * micro_batches(op, dp, w), tokens / dp * passes
    nbytes = 2 * w.layers * rows * w.hidden * w.activation_bytes
    return calls * w.device.allreduce_latency_s + nbytes * w.device.allreduce_s_per_byte


def sp_collective_seconds(op: str, sp: int, dp: int, tokens: float, w: Workers) -> float:
    """Seconds of a Ulysses sequence-parallel operator's all-to-alls: 4 per layer per forward pass of each
    micro-batch (q, k, v to heads-split before attention, the output back to sequence-split after it), twice
    that for an update. The latency term dominates: every call is a point where the sp ranks wait for each
    other;
    each moves (sp - 1) / sp of a rank's q/k/v/output activations. Priced with the device profile's
    all-reduce latency and per-byte cost (an all-to-all sends each byte once, a ring all-reduce about twice:
    this over-charges bandwidth, which is small beside latency at these sizes). Generate does not use sp."""
    if sp == 1 or w.device is None or op == "generate":
        return 0.0
    passes = 2 if op.startswith("update") else 1
    calls = 4 * w.layers * passes * micro_batches(op, dp, w)
    per_rank_tokens = tokens / (dp * sp) * passes
    nbytes = 4 * w.layers * per_rank_tokens * w.hidden * w.activation_bytes * (sp - 1) / sp
    return calls * w.device.allreduce_latency_s + nbytes * w.device.allreduce_s_per_byte


def dp_sync_seconds(op: str, ranks: int, w: Workers) -> float:
    """Seconds of FSDP's own traffic for `op` sharded over `ranks` (dp x sp): every micro-batch's forward pass
    all-gathers the parameters (its backward again: FSDP2 frees them after each use), every optimizer step
    reduce-scatters the gradients. Each moves (ranks - 1) / ranks of the full buffer per rank, priced at the
    device profile's all-reduce cost per byte, which counts a ring all-reduce's two passes: a reduce-scatter
    or all-gather is about half of it. With the model whole on every rank (`Workers.sharded` False) only the
    gradient all-reduce per optimizer step is paid."""
    if ranks == 1 or w.device is None or not w.params or op == "generate":
        return 0.0
    update = op.startswith("update")
    if not w.sharded:
        if not update:
            return 0.0
        return w.optimizer_steps * (
            w.device.allreduce_latency_s + w.params * w.grad_bytes * w.device.allreduce_s_per_byte
        )
    d = w.device
    share = (ranks - 1) / ranks / 2
    # measured gather / scatter costs: per byte of the full buffer between 2 ranks (share 1/4); else half an all-reduce
    gather_s = d.allgather_s_per_byte * 4 * share if d.allgather_s_per_byte else d.allreduce_s_per_byte * share
    scatter_s = d.reducescatter_s_per_byte * 4 * share if d.reducescatter_s_per_byte else d.allreduce_s_per_byte * share
    gathers = (2 if update else 1) * micro_batches(op, ranks, w)
    seconds = gathers * w.params * w.param_bytes * gather_s
    if update:
        seconds += w.optimizer_steps * w.params * w.grad_bytes * scatter_s
    calls = gathers + (w.optimizer_steps if update else 0)
    return calls * d.allreduce_latency_s + seconds


def without_dp_sync(costs: OperatorCosts, ranks: int, tokens: float, w: Workers) -> OperatorCosts:
    """`costs` measured on a run of `ranks`-way FSDP, with that run's FSDP traffic (`dp_sync_seconds`) taken
    out of each forward / update operator's per-token cost, so that predictions for other dp sizes add back
    their own. Per-token costs are per device: the run's traffic time x ranks / tokens."""
    out = dict(costs.seconds_per_token)
    for op, per_token in costs.seconds_per_token.items():
        if op not in RESPONSE_ONLY:
            out[op] = max(0.0, per_token - dp_sync_seconds(op, ranks, w) * ranks / tokens)
    return OperatorCosts(out, costs.fixed_s)


def optimizer_seconds(op: str, costs: OperatorCosts, ranks: int, w: Workers) -> float:
    """Seconds of an update's optimizer steps on each of its `ranks` workers: the profiled step over the
    whole model (OperatorCosts.fixed_s["optimizer_step"], 0 where not measured apart), once per optimizer
    step, on a 1 / ranks shard where FSDP shards the model, else in full on every worker."""
    if not op.startswith("update"):
        return 0.0
    return w.optimizer_steps * costs.fixed_s.get("optimizer_step", 0.0) / (ranks if w.sharded else 1)


def operator_seconds(
    op: str, costs: OperatorCosts, par: RoleParallel, tokens: float, response_tokens: float, w: Workers
) -> float:
    """`op` on par.dp x par.tp x par.sp workers of w.threads threads: the profiled per-token cost scaled by the
    devices and by the measured thread speedup (relative to the profiled run's threads), plus the tensor-
    and sequence-parallel collectives and FSDP's own traffic. Generation uses every worker too: the rollout's own layout is dp x tp
    (rollout.tensor_model_parallel_size, equal to the role's tp here), so a role's sp ranks generate as
    separate data-parallel rollout ranks."""
    if op in FIXED:
        return costs.fixed_s.get(op, 0.0)
    n = response_tokens if op in RESPONSE_ONLY else tokens
    speed = 1.0
    if w.device is not None:
        kind = KIND_OF.get(op, "forward")
        speed = w.device.speedup(kind, w.threads) / w.device.speedup(kind, w.base_threads)
    split = par.dp * par.tp * par.sp
    compute = costs.seconds_per_token.get(op, 0.0) * n / (split * speed)
    if not compute:
        return 0.0
    return (
        compute
        + optimizer_seconds(op, costs, split, w) / speed
        + tp_collective_seconds(op, par.tp, par.dp, tokens, response_tokens, w)
        + sp_collective_seconds(op, par.sp, par.dp, tokens, w)
        + dp_sync_seconds(op, par.dp * par.sp, w)
    )


def phase_seconds(
    plan: Plan,
    costs: OperatorCosts,
    tokens: float,
    response_tokens: float,
    w: Workers = Workers(),
    skip: frozenset[str] = frozenset(),
) -> list[float]:
    """Seconds of each phase of PHASES: the slowest set, each set summing its roles' operators (those in `skip`
    left out)."""
    roles = {r for s in plan.sets for r in s.roles}
    out = []
    for phase in PHASES:
        per_set: dict[int, float] = {}
        for role, op in phase:
            if role in roles and op not in skip:
                idx = plan.sets.index(plan.set_of(role))
                par = plan.of(role)
                per_set[idx] = per_set.get(idx, 0.0) + operator_seconds(op, costs, par, tokens, response_tokens, w)
        out.append(max(per_set.values(), default=0.0))
    return out


def predict_step_time(
    plan: Plan,
    costs: OperatorCosts,
    tokens: float,
    response_tokens: float,
    w: Workers = Workers(),
    skip: frozenset[str] = frozenset(),
) -> float:
    """Seconds of one step of `plan` (tokens: prompt + response of the whole batch): its phases in turn (roles of
    one set in turn, sets overlapping inside a phase) plus the controller's own time, measured on the profiled
    run; operators in `skip` are left out. `w` default: the profiled run's own threads, collectives free."""
    return costs.fixed_s.get("controller", 0.0) + sum(phase_seconds(plan, costs, tokens, response_tokens, w, skip))


def predict_one_step_off(
    train_plan: Plan,
    rollout_devices: int,
    costs: OperatorCosts,
    tokens: float,
    response_tokens: float,
    w: Workers,
    transfer_s: float,
) -> float:
    """Seconds per step of trainer.mode=one_step_off: batch k+1 is generated on the rollout's own
    `rollout_devices` workers while batch k's forward passes and updates run on `train_plan`'s sets, so a
    step takes the longer of the two, plus the weight transfer to the rollout (it waits for the new weights)."""
    gen = operator_seconds("generate", costs, RoleParallel(rollout_devices), tokens, response_tokens, w)
    rest = predict_step_time(train_plan, costs, tokens, response_tokens, w, frozenset({"generate", "weight_sync"}))
    return max(gen, rest) + transfer_s
