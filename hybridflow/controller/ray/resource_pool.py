"""Ray resource pools: placement groups of CPU (and GPU) bundles, one per node; SubRayResourcePool: a part of one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from hybridflow.controller.resource_pool import ClassWithInitArgs, ResourcePool


@dataclass(frozen=True)
class Slot:
    """One bundle of a placement group: where one rank's process runs."""

    pg: PlacementGroup
    """The placement group holding the bundle."""
    bundle_index: int
    """Index of the bundle inside `pg`."""
    node_id: str
    """Ray node id the bundle was placed on."""
    num_cpus: float
    """CPUs in the bundle."""


class RayClassWithInitArgs(ClassWithInitArgs):
    """ClassWithInitArgs whose Ray actor options can be added to (e.g. `{"max_concurrency": 2}`)."""

    def update_options(self, options: dict[str, Any]) -> RayClassWithInitArgs:
        """Merge `options` into the Ray actor options; returns self."""
        self.ray_options.update(options)
        return self


class RayResourcePool(ResourcePool):
    """Process slots as Ray placement groups: one STRICT_PACK group per node entry.

    Ranks are numbered node by node: the slots of `process_on_nodes[0]` come
    first. Each slot is a bundle of `num_cpus_per_process` CPUs (and one GPU
    with `use_gpu`); up to `max_colocate_count` worker groups may share it,
    each process then asking for its share of the bundle's CPUs.
    """

    def __init__(
        self,
        process_on_nodes: list[int] | None = None,
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        name_prefix: str = "",
        num_cpus_per_process: float = 1.0,
        ready_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(process_on_nodes, max_colocate_count, use_gpu)
        if num_cpus_per_process <= 0:
            raise ValueError(f"num_cpus_per_process must be > 0, got {num_cpus_per_process}")
        self.name_prefix = name_prefix
        """Prefix of the placement group names."""
        self.num_cpus_per_process = num_cpus_per_process
        """CPUs of each slot's bundle."""
        self.ready_timeout_s = ready_timeout_s
        """How long to wait for the placement groups to be scheduled before failing."""
        self._slots: list[Slot] | None = None
        self._pgs: list[PlacementGroup] = []

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus_per_process}
        if self.use_gpu:
            bundle["GPU"] = 1
        return bundle

    def get_placement_groups(self) -> list[PlacementGroup]:
        """Create (once) and return the ready placement groups, one per node entry."""
        if self._slots is None:
            self._slots = self._create_slots()
        return list(self._pgs)

    def slots(self) -> list[Slot]:
        """The bundles in rank order (placement groups are created on first use)."""
        self.get_placement_groups()
        return list(self._slots)

    def _create_slots(self) -> list[Slot]:
        if not ray.is_initialized():
            raise RuntimeError("RayResourcePool needs Ray: call ray.init(...) or init_local_ray() first")
        self._pgs = [
            placement_group([self._bundle()] * n, strategy="STRICT_PACK", name=f"{self.name_prefix}pg_{i}")
            for i, n in enumerate(self._store)
            if n > 0
        ]
        ready, _ = ray.wait([pg.ready() for pg in self._pgs], num_returns=len(self._pgs), timeout=self.ready_timeout_s)
        if len(ready) < len(self._pgs):
            self.remove()
            raise RuntimeError(
                f"{self!r}: placement groups of {self._bundle()} x {self._store} were not scheduled within "
                f"{self.ready_timeout_s}s; the cluster offers {ray.available_resources()} — lower "
                "process_on_nodes / num_cpus_per_process or free the resources other pools hold"
            )
        slots = []
        for pg in self._pgs:
            nodes = placement_group_table(pg)["bundles_to_node_id"]
            slots += [Slot(pg, i, nodes[i], self.num_cpus_per_process) for i in range(pg.bundle_count)]
        return slots

    def remove(self) -> None:
        """Release the placement groups (kill the worker groups on this pool first).

        A pool made by split/merge does not own its placement groups: this is a no-op there.
        """
        if not self._pgs:
            return
        for pg in self._pgs:
            remove_placement_group(pg)
        self._pgs, self._slots = [], None


class SubRayResourcePool(RayResourcePool):
    """One part of a split pool (verl's class and constructor): the slots `start_bundle_index` ..
    `start_bundle_index + subgroup_world_size - 1` of the bundles of `placement_groups`, taken in order.

    `split_resource_pool` returns these; split again, a part stays a SubRayResourcePool whose
    `start_bundle_index` counts from the first bundle of the original pool's placement groups (`pgs`), as in
    verl. A part does not own the placement groups: `remove()` the original pool.
    """

    def __init__(
        self,
        placement_groups: list[PlacementGroup],
        start_bundle_index: int,
        subgroup_world_size: int,
        **kwargs: Any,
    ) -> None:
        bundles = [
            Slot(pg, i, placement_group_table(pg)["bundles_to_node_id"][i], pg.bundle_specs[i].get("CPU", 1.0))
            for pg in placement_groups
            for i in range(pg.bundle_count)
        ]
        if start_bundle_index < 0 or subgroup_world_size < 1 or start_bundle_index + subgroup_world_size > len(bundles):
            raise ValueError(
                f"SubRayResourcePool: bundles {start_bundle_index} .. {start_bundle_index + subgroup_world_size - 1} "
                f"are not all among the {len(bundles)} bundles of its placement groups"
            )
        slots = bundles[start_bundle_index : start_bundle_index + subgroup_world_size]
        kwargs.pop("process_on_nodes", None)  # verl passes the original's; a part's is counted from its slots
        kwargs.setdefault("num_cpus_per_process", slots[0].num_cpus)
        super().__init__(_per_node(slots), **kwargs)
        self.pgs = list(placement_groups)
        """The original pool's placement groups (verl's attribute)."""
        self.start_bundle_index = start_bundle_index
        """Index of this part's first slot among the bundles of `pgs`."""
        self.subgroup_world_size = subgroup_world_size
        """This part's world size (verl's attribute)."""
        self._slots = slots

    @classmethod
    def part_of(cls, pool: RayResourcePool, slots: list[Slot], name_prefix: str) -> SubRayResourcePool:
        """The part of `pool` made of its `slots` (consecutive, in rank order), as `split_resource_pool` cuts it."""
        if isinstance(pool, SubRayResourcePool):
            pgs, first = pool.pgs, pool.start_bundle_index + pool.slots().index(slots[0])
        else:  # a pool made by merge_resource_pool owns no placement groups: its slots' groups, in order
            pgs, first = pool.get_placement_groups() or list(dict.fromkeys(s.pg for s in pool.slots())), 0
            first += pool.slots().index(slots[0])
        part = cls.__new__(cls)  # the slots are known: skip the constructor's lookup of the bundles
        RayResourcePool.__init__(
            part, _per_node(slots), pool.use_gpu, pool.max_colocate_count, name_prefix, pool.num_cpus_per_process
        )
        part.pgs, part.start_bundle_index, part.subgroup_world_size = list(pgs), first, len(slots)
        part._slots = list(slots)
        return part

    def get_placement_groups(self) -> list[PlacementGroup]:
        """The original pool's placement groups, as verl returns them (this part's slots are some of their
        bundles: `start_bundle_index`)."""
        return list(self.pgs)


def _per_node(slots: list[Slot]) -> list[int]:
    per_node: dict[str, int] = {}
    for s in slots:
        per_node[s.node_id] = per_node.get(s.node_id, 0) + 1
    return list(per_node.values())


def _view_pool(slots: list[Slot], like: RayResourcePool, name_prefix: str) -> RayResourcePool:
    pool = RayResourcePool(
        _per_node(slots), like.use_gpu, like.max_colocate_count, name_prefix, like.num_cpus_per_process
    )
    pool._slots = list(slots)
    pool._pgs = []  # a view does not own the placement groups; remove() the original pool
    return pool


def split_resource_pool(resource_pool: RayResourcePool, split_size: int | list[int]) -> list[SubRayResourcePool]:
    """Split a pool's slots, in rank order, into SubRayResourcePools of `split_size` slots each
    (an int: equal parts; a list: those sizes, summing to the pool's world size)."""
    pool, n = resource_pool, resource_pool.world_size
    sizes = [split_size] * (n // split_size) if isinstance(split_size, int) else list(split_size)
    if sum(sizes) != n or any(s <= 0 for s in sizes):
        raise ValueError(f"split_resource_pool: sizes {sizes} must be positive and sum to the world size {n}")
    slots, out, start = pool.slots(), [], 0
    for i, size in enumerate(sizes):
        out.append(SubRayResourcePool.part_of(pool, slots[start : start + size], f"{pool.name_prefix}split{i}_"))
        start += size
    return out


def merge_resource_pool(first: RayResourcePool, second: RayResourcePool) -> RayResourcePool:
    """One pool with the slots of `first` followed by those of `second`."""
    if first.use_gpu != second.use_gpu or first.num_cpus_per_process != second.num_cpus_per_process:
        raise ValueError("merge_resource_pool: pools differ in use_gpu or num_cpus_per_process")
    return _view_pool(first.slots() + second.slots(), first, f"{first.name_prefix}merged_")
