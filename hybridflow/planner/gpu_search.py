"""The placement search on a GPU cluster spec (planner/gpu.py costs): Algorithm 1 of the paper, run on paper.

For PPO's four roles (actor with its rollout, reference, critic, reward model) every partition into
placement sets (planner/plans.py: Bell(4) = 15) x every allocation of the cluster's nodes to the sets
x, per set, every tensor-parallel size for its training roles and for generation; a set's roles run
one after another, sets overlap inside a phase of the step (planner/cost.py PHASES), plans whose
model states and one sequence's KV cache do not fit a GPU are dropped. Each set's parallel sizes are
chosen independently (the one minimising the set's own time): sets only interact through the phase
maxima, so this is the paper's per-set auto-parallel step. Devices go to sets in whole nodes once the
cluster has several (GPUs of a node share NVLink; the paper's allocations are in nodes too).
`hybridflow plan --cluster a100-80gb:64 --shape llama-13b` prints the top plans.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.planner.cost import PHASES
from hybridflow.planner.gpu import (
    MEMORY_USABLE,
    GpuSpec,
    ModelShape,
    RLWorkload,
    forward_seconds,
    generate_seconds,
    reshard_seconds,
    state_bytes,
    train_seconds,
)
from hybridflow.planner.plans import allocations, set_partitions

PPO_ROLES = ("actor_rollout", "ref", "critic", "reward_model")
"""The roles of PPO with a reward model, as the paper runs it."""
TRAINED = frozenset({"actor_rollout", "critic"})
"""Roles that hold gradients and optimizer state."""
TP_SIZES = (1, 2, 4, 8)
"""Tensor-parallel sizes searched (inside one node)."""


@dataclass(frozen=True)
class SetLayout:
    """One placement set with its chosen parallel sizes and predicted operator times."""

    roles: tuple[str, ...]
    """Roles sharing the set's GPUs."""
    devices: int
    """GPUs of the set."""
    tp: int
    """Tensor-parallel size of its training and forward passes (dp = devices // tp)."""
    tp_gen: int
    """Tensor-parallel size of generation (0 when the set has no rollout)."""
    seconds: dict[tuple[str, str], float]
    """(role, operator) -> predicted seconds per step."""
    memory_bytes: float
    """Model states resident per GPU (before the KV cache)."""

    def describe(self) -> str:
        """e.g. `[actor_rollout, ref] x32 tp4 gen-tp2`."""
        gen = f" gen-tp{self.tp_gen}" if self.tp_gen else ""
        return f"[{', '.join(self.roles)}] x{self.devices} tp{self.tp}{gen}"


@dataclass(frozen=True)
class GpuPlan:
    """A plan on the cluster with its predicted step time."""

    sets: tuple[SetLayout, ...]
    """The placement sets."""
    step_s: float
    """Predicted seconds per PPO step."""

    def describe(self) -> str:
        """The sets, `|`-separated."""
        return " | ".join(s.describe() for s in self.sets)


def tp_options(devices: int, shape: ModelShape, spec: GpuSpec) -> list[int]:
    """Tensor-parallel sizes that divide the set's GPUs and the heads and stay inside a node."""
    return [
        t
        for t in TP_SIZES
        if devices % t == 0 and t <= spec.gpus_per_node and shape.heads % t == 0 and shape.kv_heads % t == 0
    ]


def layout(
    roles: tuple[str, ...], devices: int, tp: int, tp_gen: int, shape: ModelShape, w: RLWorkload, spec: GpuSpec
) -> SetLayout | None:
    """The set's operator times with these sizes, or None when its states (or one sequence's KV cache) do not fit."""
    dp = devices // tp
    resident = sum(state_bytes(shape, r in TRAINED, dp, tp) for r in roles)
    if tp_gen:
        resident += 2 * shape.params / tp_gen  # the generation shard, gathered next to the training shards
    free = spec.memory_bytes * MEMORY_USABLE - resident
    if free <= 0:
        return None
    seconds: dict[tuple[str, str], float] = {}
    for role in roles:
        if role in TRAINED:
            seconds[(role, "update_critic" if role == "critic" else "update_actor")] = train_seconds(
                shape, w, spec, dp, tp
            )
        op = {"actor_rollout": "old_log_prob", "ref": "ref_log_prob", "critic": "values", "reward_model": "rm_score"}[
            role
        ]
        seconds[(role, op)] = forward_seconds(shape, w, spec, dp, tp)
    if tp_gen:
        gen = generate_seconds(shape, w, spec, devices, tp_gen, free)
        if gen is None:
            return None
        seconds[("actor_rollout", "generate")] = gen
        seconds[("actor_rollout", "weight_sync")] = reshard_seconds(shape, spec, devices, tp_gen)
    return SetLayout(roles, devices, tp, tp_gen, seconds, resident)


def best_layout(
    roles: tuple[str, ...], devices: int, shape: ModelShape, w: RLWorkload, spec: GpuSpec
) -> SetLayout | None:
    """The fitting parallel sizes minimising the set's own total time; None when none fits."""
    options = tp_options(devices, shape, spec)
    gens = options if "actor_rollout" in roles else [0]
    found = [lay for tp in options for g in gens if (lay := layout(roles, devices, tp, g, shape, w, spec))]
    return min(found, key=lambda s: sum(s.seconds.values()), default=None)


def step_seconds(sets: tuple[SetLayout, ...]) -> float:
    """Phases in turn; inside a phase each set runs its roles' operators in turn and the sets overlap."""
    total = 0.0
    for phase in PHASES:
        total += max((sum(s.seconds.get(key, 0.0) for key in phase) for s in sets), default=0.0)
    return total


def allocation_unit(n_gpus: int, spec: GpuSpec) -> int:
    """GPUs per allocation step: whole nodes once the cluster has more than one."""
    return spec.gpus_per_node if n_gpus > spec.gpus_per_node and n_gpus % spec.gpus_per_node == 0 else 1


def evaluate(
    blocks: tuple[tuple[str, ...], ...], sizes: tuple[int, ...], shape: ModelShape, w: RLWorkload, spec: GpuSpec
) -> GpuPlan | None:
    """A placement (role blocks, GPUs per block) with each set's best sizes; None when a set fits no layout."""
    sets = []
    for roles, devices in zip(blocks, sizes):
        lay = best_layout(roles, devices, shape, w, spec)
        if lay is None:
            return None
        sets.append(lay)
    return GpuPlan(tuple(sets), step_seconds(tuple(sets)))


def search(
    shape: ModelShape, w: RLWorkload, spec: GpuSpec, n_gpus: int, roles: tuple[str, ...] = PPO_ROLES
) -> list[GpuPlan]:
    """Every fitting plan of `roles` on `n_gpus` GPUs, fastest predicted first."""
    unit = allocation_unit(n_gpus, spec)
    plans = []
    for blocks in set_partitions(roles):
        for alloc in allocations(n_gpus // unit, len(blocks)):
            plan = evaluate(blocks, tuple(a * unit for a in alloc), shape, w, spec)
            if plan is not None:
                plans.append(plan)
    return sorted(plans, key=lambda p: p.step_s)


def named_placements(n_gpus: int, spec: GpuSpec) -> dict[str, tuple[tuple[tuple[str, ...], ...], tuple[int, ...]]]:
    """The paper's baseline placements: colocate (all roles on all GPUs), split (actor + ref | critic + reward
    model, half each) and standalone (each role on a quarter), where the cluster divides that way."""
    unit = allocation_unit(n_gpus, spec)
    out = {"colocate": ((PPO_ROLES,), (n_gpus,))}
    if n_gpus % (2 * unit) == 0:
        out["split"] = ((("actor_rollout", "ref"), ("critic", "reward_model")), (n_gpus // 2,) * 2)
    if n_gpus % (4 * unit) == 0:
        out["standalone"] = (tuple((r,) for r in PPO_ROLES), (n_gpus // 4,) * 4)
    return out


def one_step_off(shape: ModelShape, w: RLWorkload, spec: GpuSpec, n_gpus: int) -> tuple[float, int, GpuPlan] | None:
    """trainer.mode=one_step_off: generation on its own GPUs overlaps the training roles' phases (the best
    colocated layout on the rest); a step takes the longer of the two plus the weight broadcast to the
    rollout over the network. Returns (s/step, rollout GPUs, training plan) of the best split, or None."""
    unit = allocation_unit(n_gpus, spec)
    best = None
    for r in range(unit, n_gpus, unit):
        train = evaluate((PPO_ROLES,), (n_gpus - r,), shape, w, spec)
        gens = [
            g
            for t in tp_options(r, shape, spec)  # the rollout's GPUs hold only its bf16 weight shard
            if (g := generate_seconds(shape, w, spec, r, t, spec.memory_bytes * MEMORY_USABLE - 2 * shape.params / t))
            is not None
        ]
        if train is None or not gens:
            continue
        gen = min(gens)
        rest = step_seconds(train.sets) - sum(
            train.sets[0].seconds.get(("actor_rollout", op), 0.0) for op in ("generate", "weight_sync")
        )
        transfer = 2 * shape.params / spec.inter_node_bytes_per_s + spec.collective_latency_s
        step = max(gen, rest) + transfer
        if best is None or step < best[0]:
            best = (step, r, train)
    return best
