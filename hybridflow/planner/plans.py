"""Plans of a run: which roles share devices, how many devices each set gets, each role's parallel sizes.

A plan partitions the run's roles (actor_rollout, ref, critic, reward_model -- which exist follows
from the run: planner/inputs.py RunShape.roles) into placement sets, gives every set >= 1 device,
and gives every role a dp size (tp = sp = 1 until the tensor-parallel engine is searched over).
`enumerate_plans` yields every set partition exactly once (Bell(k) of them for k roles) times every
allocation of the devices to its sets (C(N-1, s-1) for s sets); `fits` prunes by a per-device
memory estimate.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations

ADAM_STATE_BYTES = 8
"""Adam's two fp32 moments per trained parameter."""


@dataclass(frozen=True)
class RoleParallel:
    """Parallel sizes of one role inside its placement set (dp * tp * sp = the set's devices)."""

    dp: int
    """Data-parallel (FSDP) size: model state is sharded over these ranks, the batch split across them."""
    tp: int = 1
    """Tensor-parallel size; 1 until the planner searches the tensor-parallel engine."""
    sp: int = 1
    """Ulysses sequence-parallel size: the sp ranks of a dp group get the same rows and split each
    micro-batch's tokens; FSDP shards the model state over dp x sp."""


@dataclass(frozen=True)
class PlacementSet:
    """Roles that share the same devices (colocated: they run one after another)."""

    roles: tuple[str, ...]
    """Roles hosted on every device of the set."""
    devices: int
    """Devices (workers) the set gets; >= 1."""


@dataclass(frozen=True)
class Plan:
    """One layout of the run: placement sets with their devices, and each role's parallel sizes."""

    sets: tuple[PlacementSet, ...]
    """The partition of the roles, each block with its device count; blocks in a canonical order."""
    parallel: tuple[tuple[str, RoleParallel], ...]
    """(role, its parallel sizes) for every role, in the order of `sets`."""

    def of(self, role: str) -> RoleParallel:
        """The parallel sizes of `role`."""
        return dict(self.parallel)[role]

    def set_of(self, role: str) -> PlacementSet:
        """The placement set hosting `role`."""
        return next(s for s in self.sets if role in s.roles)

    def describe(self) -> str:
        """e.g. `[actor_rollout, ref] x2 | [critic] x1`."""
        return " | ".join(f"[{', '.join(s.roles)}] x{s.devices}" for s in self.sets)


@dataclass(frozen=True)
class RoleModel:
    """What the memory estimate needs to know of one role's model."""

    name: str
    """The role: actor_rollout, ref, critic or reward_model."""
    params: float
    """Parameter count."""
    trained: bool
    """True: grads and Adam state are held too (actor, critic); False: parameters only (ref, reward model)."""
    param_bytes: int = 4
    """Bytes per parameter (and per gradient) as held; 4 for fp32, 2 for bf16."""
    activation_bytes_per_token: float = 0.0
    """KV cache / activations per token held at once (for the rollout: its KV cache per token)."""


@dataclass(frozen=True)
class Workload:
    """The run's models and the tokens a step processes."""

    models: tuple[RoleModel, ...]
    """One entry per role of the run."""
    tokens_per_step: float
    """Prompt + response tokens of one step's batch (all samples)."""

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles, in the order of `models`."""
        return tuple(m.name for m in self.models)

    def model(self, role: str) -> RoleModel:
        """The RoleModel of `role`."""
        return next(m for m in self.models if m.name == role)


def set_partitions(items: Sequence[str]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every partition of `items` into non-empty blocks, each exactly once (Bell(len(items)) of them).

    The first item is placed in each block of every partition of the rest, or in a block of its own;
    blocks keep the items' order, and the block holding items[0] comes first."""
    if not items:
        yield ()
        return
    head, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield ((head,),) + partition
        for i, block in enumerate(partition):
            yield ((head,) + block,) + partition[:i] + partition[i + 1 :]


def allocations(devices: int, n_sets: int) -> Iterator[tuple[int, ...]]:
    """Every way to give `devices` devices to `n_sets` ordered sets, each >= 1 (C(devices-1, n_sets-1))."""
    if n_sets < 1 or devices < n_sets:
        return
    for cuts in combinations(range(1, devices), n_sets - 1):
        bounds = (0,) + cuts + (devices,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def enumerate_plans(roles: Sequence[str], devices: int) -> Iterator[Plan]:
    """Every partition of `roles` x every allocation of `devices` to its sets; each role's dp = its set's devices."""
    for partition in set_partitions(tuple(roles)):
        for alloc in allocations(devices, len(partition)):
            sets = tuple(PlacementSet(block, n) for block, n in zip(partition, alloc))
            yield Plan(sets, tuple((role, RoleParallel(dp=s.devices)) for s in sets for role in s.roles))


def role_memory_bytes(model: RoleModel, parallel: RoleParallel, tokens_per_step: float) -> float:
    """Bytes one device holds for `model`: params (+ grads + Adam state when trained) sharded over
    dp * tp * sp (FSDP over dp x sp, tensor parallel), plus activations / KV cache of its share of the step's tokens."""
    per_param = model.param_bytes + (model.param_bytes + ADAM_STATE_BYTES if model.trained else 0)
    state = model.params * per_param / (parallel.dp * parallel.tp * parallel.sp)
    return state + model.activation_bytes_per_token * tokens_per_step / (parallel.dp * parallel.sp)


def memory_per_device(plan: Plan, workload: Workload) -> dict[PlacementSet, float]:
    """Bytes per device of each set: colocated roles all stay resident (no offload between them today)."""
    return {
        s: sum(role_memory_bytes(workload.model(r), plan.of(r), workload.tokens_per_step) for r in s.roles)
        for s in plan.sets
    }


def peak_memory(plan: Plan, workload: Workload) -> float:
    """The largest per-device memory over the plan's sets."""
    return max(memory_per_device(plan, workload).values())


def fits(plan: Plan, workload: Workload, device_memory: float) -> bool:
    """Whether every device of the plan holds its estimate within `device_memory` bytes."""
    return peak_memory(plan, workload) <= device_memory


def feasible_plans(workload: Workload, devices: int, device_memory: float) -> list[Plan]:
    """The plans of `workload` on `devices` devices that fit in `device_memory` bytes each."""
    return [p for p in enumerate_plans(workload.roles, devices) if fits(p, workload, device_memory)]
