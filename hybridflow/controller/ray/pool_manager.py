"""verl's `ResourcePoolManager`: named pools from a spec, and which role runs on which pool.

A verl program builds its placement like this and then creates one worker group per role on
`manager.get_resource_pool(role)`; a role is any hashable key (verl's PPO `Role` enum lives with the trainer,
hybridflow/train/roles.py: this runtime knows nothing of RL). Here the pools are `RayResourcePool`s with hybridflow's defaults
(`use_gpu` from `use_gpu`, False by default where verl's is True: the device is the run's choice, not
the class's; one worker group per slot, `max_colocate_count=1`, as verl creates them).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import ray

from hybridflow.controller.ray.resource_pool import RayResourcePool


@dataclass
class ResourcePoolManager:
    """Named pools (`resource_pool_spec`: name -> processes per node) and the role -> pool name `mapping`."""

    resource_pool_spec: dict[str, list[int]]
    """Pool name -> processes on each node, e.g. {"global_pool": [2]}."""
    mapping: dict[Hashable, str]
    """Role (any hashable key: a name, verl's `Role` enum) -> the name of the pool its worker group runs on."""
    use_gpu: bool = False
    """Whether each process slot holds a GPU (verl always asks for one)."""
    num_cpus_per_process: float = 1.0
    """CPUs of each process slot."""
    resource_pool_dict: dict[str, RayResourcePool] = field(default_factory=dict)
    """Name -> pool, filled by `create_resource_pool`."""
    release_wait_s: float = 10.0
    """How long to wait for resources that the cluster has but that are still held (Ray frees a removed pool's or
    a killed worker's CPUs asynchronously, so a program that just shut down a group may see them as taken)."""

    def create_resource_pool(self) -> None:
        """Check the cluster can hold every pool at once, then create them (placement groups come on first use)."""
        unknown = sorted({str(name) for name in self.mapping.values()} - set(self.resource_pool_spec))
        if unknown:
            raise ValueError(
                f"ResourcePoolManager: the mapping names pools {unknown} that resource_pool_spec lacks "
                f"(it has {sorted(self.resource_pool_spec)}); add them to the spec or map the roles to existing pools"
            )
        self._check_resource_available()
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes,
                use_gpu=self.use_gpu,
                max_colocate_count=1,
                name_prefix=name,
                num_cpus_per_process=self.num_cpus_per_process,
            )

    def get_resource_pool(self, role: Hashable) -> RayResourcePool:
        """The pool `role` is mapped to (after `create_resource_pool`)."""
        if role not in self.mapping:
            raise KeyError(f"ResourcePoolManager: {role} has no pool in the mapping (mapped: {list(self.mapping)})")
        name = self.mapping[role]
        if name not in self.resource_pool_dict:
            raise RuntimeError("ResourcePoolManager: call create_resource_pool() before get_resource_pool()")
        return self.resource_pool_dict[name]

    def get_n_gpus(self) -> int:
        """Processes over all pools (verl's name: one GPU per process)."""
        return sum(n for nodes in self.resource_pool_spec.values() for n in nodes)

    def _check_resource_available(self) -> None:
        """Refuse a spec the cluster cannot hold: the processes' total CPUs (and GPUs) against what Ray offers."""
        if not ray.is_initialized():
            raise RuntimeError("ResourcePoolManager needs Ray: call ray.init(...) or init_local_ray() first")
        need = {"CPU": self.get_n_gpus() * self.num_cpus_per_process}
        if self.use_gpu:
            need["GPU"] = float(self.get_n_gpus())
        total = ray.cluster_resources()
        deadline = time.monotonic() + self.release_wait_s
        while True:
            available = ray.available_resources()
            short = {kind: amount for kind, amount in need.items() if amount > available.get(kind, 0.0)}
            if not short:
                return
            fits_when_free = all(amount <= total.get(kind, 0.0) for kind, amount in short.items())
            if not fits_when_free or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        kind, amount = next(iter(short.items()))
        raise ValueError(
            f"ResourcePoolManager: the pools {self.resource_pool_spec} need {amount:g} {kind} but the cluster "
            f"has {available.get(kind, 0.0):g} available (of {total.get(kind, 0.0):g}); shrink the spec, free what "
            f"other pools hold, or add nodes"
        )
