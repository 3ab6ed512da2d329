"""RayWorkerGroup: one Ray actor per slot of a RayResourcePool."""

from __future__ import annotations

import functools
import uuid
from typing import Any, Callable

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from hybridflow.controller.ray.resource_pool import RayResourcePool, Slot
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.controller.worker import NUM_THREADS_ENV, find_free_port
from hybridflow.controller.worker_group import WorkerError, WorkerGroup

_DEATH = (RayActorError, WorkerCrashedError, ObjectLostError)


@ray.remote(num_cpus=0)
def _free_port_on_node(host: str) -> int:
    return find_free_port(host)


def _rendezvous(slots: list[Slot]) -> tuple[str, int]:
    """MASTER_ADDR / MASTER_PORT: a free port on rank 0's node, at loopback when every
    rank shares that node (traffic then never leaves the machine), else at the node IP Ray reports."""
    slot = slots[0]
    if all(s.node_id == slot.node_id for s in slots):
        addr = "127.0.0.1"
    else:
        addr = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == slot.node_id)
    if slot.node_id == ray.get_runtime_context().get_node_id():
        return addr, find_free_port(addr)
    strategy = NodeAffinitySchedulingStrategy(slot.node_id, soft=False)
    return addr, ray.get(_free_port_on_node.options(scheduling_strategy=strategy).remote(addr))


def _local_layout(slots: list[Slot]) -> list[tuple[int, int]]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) of each rank, from the nodes of the slots."""
    counts: dict[str, int] = {}
    seen: dict[str, int] = {}
    for s in slots:
        counts[s.node_id] = counts.get(s.node_id, 0) + 1
    layout = []
    for s in slots:
        layout.append((seen.get(s.node_id, 0), counts[s.node_id]))
        seen[s.node_id] = seen.get(s.node_id, 0) + 1
    return layout


def _remote_class(cls: type, options: dict[str, Any]) -> Any:
    """`ray.remote(cls)`, taking out of `options` those Ray accepts only at decoration."""
    at_decoration = {key: options.pop(key) for key in ("concurrency_groups",) if key in options}
    return ray.remote(**at_decoration)(cls) if at_decoration else ray.remote(cls)


def _with_env_vars(runtime_env: dict[str, Any] | None, env_vars: dict[str, str]) -> dict[str, Any]:
    """The user's runtime_env (from ray_options) plus the group's env vars, which win on a clash."""
    runtime_env = dict(runtime_env or {})
    return {**runtime_env, "env_vars": {**(runtime_env.get("env_vars") or {}), **env_vars}}


def fetch_named(group: str, method_name: str, ranks: list[int], refs: list) -> list:
    """`ray.get(refs)` (refs[i] from rank ranks[i]); a failure names the group, rank and method.

    A module-level function, so a future carrying it can be sent to and resolved on other workers.
    """
    try:
        return ray.get(refs)
    except _DEATH + (RayTaskError,) as err:
        rank = _failed_rank(ranks, refs)
        if isinstance(err, RayTaskError):
            err.add_note(f"hybridflow: raised in group {group} rank {rank} method {method_name}")
            raise
        raise WorkerError(
            f"worker of group {group} rank {rank} method {method_name} died: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}"
        ) from err


def _failed_rank(ranks: list[int], refs: list) -> int | None:
    for rank, ref in zip(ranks, refs):
        try:
            ray.get(ref)
        except Exception:
            return rank
    return None


class RayWorkerGroup(WorkerGroup):
    """A WorkerGroup whose ranks are Ray actors placed on a RayResourcePool's bundles.

    Each actor gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and its thread count through `runtime_env` env vars, on top of
    `env_vars` (extra variables for every worker process). A call
    whose worker died raises `WorkerError` naming the group, rank and method
    (checked every `poll_interval_s` while waiting).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: ClassWithInitArgs,
        name_prefix: str | None = None,
        poll_interval_s: float = 0.5,
        env_vars: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(ray_cls_with_init, ClassWithInitArgs):
            raise TypeError("RayWorkerGroup needs a RayClassWithInitArgs(WorkerCls, *args, **kwargs)")
        name = name_prefix or f"{ray_cls_with_init.cls.__name__}_{uuid.uuid4().hex[:6]}"
        slots = resource_pool.slots()
        super().__init__(name, len(slots))
        self._poll_interval_s = poll_interval_s
        self._env_vars = dict(env_vars or {})
        self._workers = self._create_workers(resource_pool, slots, ray_cls_with_init)
        self._method_handles: dict[str, list[Any]] = {}
        self._bind_worker_methods(ray_cls_with_init.cls)

    @property
    def workers(self) -> list[Any]:
        """The Ray actor handles, in rank order."""
        return list(self._workers)

    def _create_workers(self, pool: RayResourcePool, slots: list[Slot], cwa: ClassWithInitArgs) -> list[Any]:
        addr, port = _rendezvous(slots)
        options = dict(cwa.ray_options)
        remote_cls = _remote_class(cwa.cls, options)
        workers = []
        for rank, (slot, (local_rank, local_ws)) in enumerate(zip(slots, _local_layout(slots))):
            cpus = slot.num_cpus / pool.max_colocate_count
            threads = str(max(1, int(cpus)))
            env = {
                **self._env_vars,
                "RANK": str(rank), "WORLD_SIZE": str(len(slots)),
                "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_ws),
                "MASTER_ADDR": addr, "MASTER_PORT": str(port),
                NUM_THREADS_ENV: threads, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                "HYBRIDFLOW_WORKER_GROUP": self._name,
            }  # fmt: skip
            actor_options = {
                **options,
                "num_cpus": cpus,
                "num_gpus": 1 / pool.max_colocate_count if pool.use_gpu else 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(slot.pg, slot.bundle_index),
                "runtime_env": _with_env_vars(options.get("runtime_env"), env),
            }
            workers.append(remote_cls.options(**actor_options).remote(*cwa.args, **cwa.kwargs))
        return workers

    # --- backend hooks ----------------------------------------------------
    def _execute(self, method_name: str, ranks: list[int], per_rank: list[tuple[tuple, dict]]) -> list:
        handles = self._method_handles.get(method_name)
        if handles is None:
            handles = self._method_handles[method_name] = [getattr(w, method_name) for w in self._workers]
        return [handles[r].remote(*a, **k) for r, (a, k) in zip(ranks, per_rank)]

    def _wait(self, method_name: str, ranks: list[int], outputs: list) -> list:
        values: dict[Any, Any] = {}
        pending = list(outputs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self._poll_interval_s)
            if ready:
                values.update(zip(ready, self._get(method_name, ranks, outputs, ready)))
        return [values[ref] for ref in outputs]

    def _get(self, method_name: str, ranks: list[int], outputs: list, ready: list) -> list:
        return fetch_named(self._name, method_name, [ranks[outputs.index(ref)] for ref in ready], ready)

    def _make_future(self, method_name: str, ranks: list[int], outputs: list, collect: Callable,
                     collects_proto: bool) -> Any:
        if not collects_proto:
            return outputs
        from hybridflow.protocol import DataProtoFuture

        fetch = functools.partial(fetch_named, self._name, method_name, ranks)
        return DataProtoFuture(collect_fn=collect, futures=outputs, fetch_fn=fetch)

    # --- raw calls and lifetime ---------------------------------------------
    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Call any worker method on every rank with the same arguments; wait; outputs in rank order."""
        ranks = list(range(self._world_size))
        refs = self._execute(method_name, ranks, [(args, kwargs)] * len(ranks))
        return self._wait(method_name, ranks, refs)

    def shutdown(self) -> None:
        """Kill the worker actors (of every group spawned from this one too)."""
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
