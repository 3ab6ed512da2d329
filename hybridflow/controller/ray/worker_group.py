"""RayWorkerGroup: one Ray actor per slot of a RayResourcePool."""

from __future__ import annotations

import gc
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from hybridflow.controller.ray.resource_pool import RayResourcePool, Slot
from hybridflow.controller.ray.verl_api import VerlRayGroupMixin, check_device_name, merge_worker_env
from hybridflow.controller.ray.wait import RankCall
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.controller.worker import COLLECTIVE_TIMEOUT_ENV, NUM_THREADS_ENV, find_free_port
from hybridflow.controller.worker_group import Timeouts, WorkerGroup
from hybridflow.protocol import DataProtoFuture
from hybridflow.utils.device import DEVICE_ENV


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


_SLOT_GROUPS: dict[tuple[str, int], weakref.WeakSet] = {}
"""Live worker groups with a process on each slot (placement group id, bundle index)."""


def _slot_key(slot: Slot) -> tuple[str, int]:
    return slot.pg.id.hex(), slot.bundle_index


def _live_groups(slot: Slot) -> list[RayWorkerGroup]:
    return [g for g in _SLOT_GROUPS.get(_slot_key(slot), ()) if not g._life["shut_down"]]


def _claim_slots(group: RayWorkerGroup, pool: RayResourcePool, slots: list[Slot]) -> None:
    """Record `group` on `slots`, refusing it when a slot already hosts `max_colocate_count` live groups
    (its actors could never be placed: its first call would wait out the whole call timeout)."""
    limit = pool.max_colocate_count
    if any(len(_live_groups(s)) >= limit for s in slots):
        gc.collect()  # groups dropped without shutdown() may linger in reference cycles
    full = {g.name for s in slots for g in _live_groups(s) if len(_live_groups(s)) >= limit}
    if full:
        raise ValueError(
            f"worker group {group.name}: {pool!r} (name_prefix={pool.name_prefix!r}) allows "
            f"max_colocate_count={limit} group(s) per slot and already hosts {sorted(full)}; "
            f"build the pool with RayResourcePool(..., max_colocate_count={limit + 1}) or more, "
            "shutdown() the other group first, or fuse the roles with create_colocated_worker_cls"
        )
    for s in slots:
        _SLOT_GROUPS.setdefault(_slot_key(s), weakref.WeakSet()).add(group)


class RayWorkerGroup(VerlRayGroupMixin, WorkerGroup):
    """A WorkerGroup whose ranks are Ray actors placed on a RayResourcePool's bundles.

    Each actor gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and its thread count through `runtime_env` env vars, on top of
    `env_vars` (extra variables for every worker process). A call
    whose worker died raises `WorkerError` naming the group, rank and method
    (checked every `poll_interval_s` while waiting).

    No call waits forever (`timeouts`): ranks that have not returned `timeouts.call_s` after a call
    was issued raise `WorkerTimeoutError` — for a blocking call and for the `DataProtoFuture` of a
    non-blocking one, wherever it is resolved — and are killed, since a stuck actor would hold its
    devices and block every call queued behind it. The group is then broken: later calls fail at
    once naming the dead ranks; `shutdown()` it and build a new one to recover. To debug a hang,
    raise the timeout and attach py-spy to the stuck process while it hangs. `timeouts.collective_s`
    reaches the workers' `init_process_group` as HYBRIDFLOW_COLLECTIVE_TIMEOUT_S. (A non-blocking
    call whose result is not a DataProto returns bare object refs: bound their `ray.get` yourself.)

    verl's keywords: `device_name` ("cuda" or "cpu"; the pool's use_gpu decides the device), `worker_env`
    (extra variables; redefining one of the group's own is refused) and `detached` (named actors that
    outlive this driver: `worker_names`, `from_detached`). As in verl, workers also see
    RAY_LOCAL_WORLD_SIZE (= LOCAL_WORLD_SIZE), WG_PREFIX (the group's name) and WG_BACKEND=ray.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: ClassWithInitArgs,
        name_prefix: str | None = None,
        poll_interval_s: float = 0.5,
        env_vars: dict[str, str] | None = None,
        timeouts: Timeouts | None = None,
        *,
        device_name: str = "cuda",
        worker_env: dict[str, str] | None = None,
        detached: bool = False,
    ) -> None:
        if not isinstance(ray_cls_with_init, ClassWithInitArgs):
            raise TypeError("RayWorkerGroup needs a RayClassWithInitArgs(WorkerCls, *args, **kwargs)")
        name = name_prefix or f"{ray_cls_with_init.cls.__name__}_{uuid.uuid4().hex[:6]}"
        slots = resource_pool.slots()
        self._init_state(name, len(slots), poll_interval_s, timeouts)
        self._env_vars = dict(env_vars or {})
        self.device_name = check_device_name(device_name)
        """verl's device name; the pool's use_gpu decides the device."""
        self._worker_env, self._detached = dict(worker_env or {}), detached
        _claim_slots(self, resource_pool, slots)
        self._workers = self._create_workers(resource_pool, slots, ray_cls_with_init)
        self._bind_worker_methods(ray_cls_with_init.cls)

    def _init_state(self, name: str, world_size: int, poll_interval_s: float, timeouts: Timeouts | None) -> None:
        WorkerGroup.__init__(self, name, world_size)
        self._poll_interval_s = poll_interval_s
        self._timeouts = timeouts or Timeouts()
        self._life = {"shut_down": False}  # shared with the groups spawn() makes: one set of processes
        self._worker_names: list[str] = []
        self._method_handles: dict[str, list[Any]] = {}

    @classmethod
    def _attach(cls, name: str | None, handles: list[Any], names: list[str], cwa: Any, **kwargs: Any) -> RayWorkerGroup:
        """A group over running actors (see `from_detached`)."""
        group = object.__new__(cls)
        group._init_state(
            name or f"detached_{uuid.uuid4().hex[:6]}",
            len(handles),
            kwargs.pop("poll_interval_s", 0.5),
            kwargs.pop("timeouts", None),
        )
        group.device_name = check_device_name(kwargs.pop("device_name", "cuda"))
        if kwargs:
            raise TypeError(f"from_detached: unexpected arguments {sorted(kwargs)}")
        group._env_vars, group._worker_env, group._detached = {}, {}, True
        group._workers, group._worker_names = handles, names
        if cwa is not None:
            group._bind_worker_methods(cwa.cls)
        return group

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
                COLLECTIVE_TIMEOUT_ENV: str(self._timeouts.collective_s),
                DEVICE_ENV: "cuda" if pool.use_gpu else "cpu",
                "RAY_LOCAL_WORLD_SIZE": str(local_ws), "WG_PREFIX": self._name, "WG_BACKEND": "ray",
            }  # fmt: skip
            env = merge_worker_env(env, self._worker_env)
            actor_options = {
                **options,
                "num_cpus": cpus,
                "num_gpus": 1 / pool.max_colocate_count if pool.use_gpu else 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(slot.pg, slot.bundle_index),
                "runtime_env": _with_env_vars(options.get("runtime_env"), env),
            }
            if self._detached:
                self._worker_names.append(f"{self._name}{cwa.cls.__name__}_{rank}:{local_rank}")
                actor_options.update(name=self._worker_names[-1], lifetime="detached")
            workers.append(remote_cls.options(**actor_options).remote(*cwa.args, **cwa.kwargs))
        return workers

    # --- backend hooks ----------------------------------------------------
    def _execute(self, method_name: str, ranks: list[int], per_rank: list[tuple[tuple, dict]]) -> list:
        handles = self._method_handles.get(method_name)
        if handles is None:
            handles = self._method_handles[method_name] = [getattr(w, method_name) for w in self._workers]
        return [handles[r].remote(*a, **k) for r, (a, k) in zip(ranks, per_rank)]

    def _wait(self, method_name: str, ranks: list[int], outputs: list) -> list:
        return self._rank_call(method_name, ranks)(outputs)

    def _rank_call(self, method_name: str, ranks: list[int]) -> RankCall:
        """The call just issued to `ranks`; waiting on it applies the group's call timeout."""
        t = self._timeouts
        return RankCall(
            self._name,
            method_name,
            tuple(ranks),
            tuple(self._workers[r] for r in ranks),
            time.time(),
            t.call_s,
            t.call_setting,
            self._poll_interval_s,
        )

    def _make_future(
        self, method_name: str, ranks: list[int], outputs: list, collect: Callable, collects_proto: bool
    ) -> Any:
        if not collects_proto:
            return outputs

        return DataProtoFuture(collect_fn=collect, futures=outputs, fetch_fn=self._rank_call(method_name, ranks))

    # --- raw calls and lifetime ---------------------------------------------
    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Call any worker method on every rank with the same arguments; wait; outputs in rank order."""
        ranks = list(range(self._world_size))
        refs = self._execute(method_name, ranks, [(args, kwargs)] * len(ranks))
        return self._wait(method_name, ranks, refs)

    def shutdown(self) -> None:
        """Kill the worker actors (of every group spawned from this one too)."""
        self._life["shut_down"] = True
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
