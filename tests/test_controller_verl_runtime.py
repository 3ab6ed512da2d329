"""verl's runtime API on the controller side, and the two runtime bugs of issue 34:
`async def` worker methods, and a group refused on a pool that has no room for it."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
import torch
from controller_workers import rows
from tensordict import TensorDict

from hybridflow import ClassWithInitArgs, DataProto, Dispatch, Worker, register
from hybridflow.controller import ResourcePool, WorkerGroup
from hybridflow.controller.colocate import create_colocated_worker_cls
from hybridflow.controller.dispatch import make_nd_compute_dataproto_dispatch_fn
from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup
from hybridflow.controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    SubRayResourcePool,
    create_colocated_worker_cls_fused,
    split_resource_pool,
)
from hybridflow.controller.worker_group import GroupInfo
from hybridflow.train.roles import Role


class AsyncWorker(Worker):
    """A worker with `async def` registered methods next to a plain one."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def add_later(self, x: int) -> int:
        await asyncio.sleep(0.01)
        self.calls += 1
        return x + self.rank

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    async def fail_later(self) -> None:
        await asyncio.sleep(0)
        raise RuntimeError("async boom")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def count(self) -> int:
        return self.calls

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self, name: str) -> str | None:
        return os.environ.get(name)


def test_async_method_is_awaited_on_the_local_backend():
    group = LocalWorkerGroup(LocalResourcePool(), ClassWithInitArgs(AsyncWorker))
    assert group.add_later(3) == [3]
    assert group.count() == [1]
    assert group.execute_all_sync("add_later", 4) == [4]
    with pytest.raises(RuntimeError, match="async boom"):
        group.fail_later()
    group.shutdown()


def test_async_method_is_awaited_from_inside_a_running_loop_locally():
    group = LocalWorkerGroup(LocalResourcePool(), ClassWithInitArgs(AsyncWorker))

    async def caller() -> list:
        return group.add_later(5)

    assert asyncio.run(caller()) == [5]
    group.shutdown()


def test_async_role_method_of_a_colocated_worker_is_awaited():
    fused = create_colocated_worker_cls({"a": AsyncWorker})
    group = LocalWorkerGroup(LocalResourcePool(), fused)
    view = group.spawn({"a"})["a"]
    assert view.add_later(2) == [2]
    view.shutdown()  # stops the loop the views share: the next async call starts a new one
    assert group.spawn({"a"})["a"].add_later(3) == [3]
    group.shutdown()


def test_async_method_through_ray(ray_local):
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="async_")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(AsyncWorker), name_prefix="async")
    assert group.add_later(10) == [10, 11]
    assert group.count() == [1, 1]
    with pytest.raises(RuntimeError, match="async boom"):
        group.fail_later()
    group.shutdown()
    pool.remove()


def test_async_role_method_of_a_colocated_worker_through_ray(ray_local):
    pool = RayResourcePool([1], num_cpus_per_process=0.5, name_prefix="async_fused_")
    try:
        group = RayWorkerGroup(pool, create_colocated_worker_cls({"a": AsyncWorker}), name_prefix="async_fused")
        view = group.spawn({"a"})["a"]
        assert view.add_later(6) == [6] and view.count() == [1]  # awaited in the actor, not pickled un-awaited
        group.shutdown()
    finally:
        pool.remove()


def test_a_group_on_a_full_pool_is_refused_at_once(ray_local, monkeypatch):
    pool = RayResourcePool([1], num_cpus_per_process=0.5, name_prefix="full_")
    try:  # a failure here must not leave the pool holding the session's CPUs for the tests after it
        first = RayWorkerGroup(pool, RayClassWithInitArgs(AsyncWorker), name_prefix="full_a")
        created: list[str] = []
        create = RayWorkerGroup._create_workers

        def spy(group, *args, **kwargs):
            created.append(group.name)
            return create(group, *args, **kwargs)

        monkeypatch.setattr(RayWorkerGroup, "_create_workers", spy)
        with pytest.raises(ValueError, match=r"full_.*max_colocate_count=1.*full_a.*max_colocate_count=2"):
            RayWorkerGroup(pool, RayClassWithInitArgs(AsyncWorker), name_prefix="full_b")
        assert created == []  # refused before any actor exists: nothing waits on a placement that cannot happen
        first.shutdown()  # a shut-down group frees its slots
        second = RayWorkerGroup(pool, RayClassWithInitArgs(AsyncWorker), name_prefix="full_c")
        assert second.count() == [0]
        second.shutdown()
    finally:
        pool.remove()


def double_x(worker: Worker, data: DataProto) -> DataProto:
    """A function for execute_with_func_generator: each rank doubles its shard and tags its rank."""
    return DataProto.from_dict({"x": data.batch["x"] * 2, "r": torch.full((len(data),), worker.rank)})


def plus(a: int, b: int) -> tuple[int, int]:
    return a + b, int(os.environ["RANK"])


@pytest.fixture(scope="module")
def verl_group(ray_local):
    """Two detached AsyncWorkers of half a CPU, built with verl's keywords."""
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="verlapi_")
    group = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(AsyncWorker),
        name_prefix="verlapi",
        device_name="cpu",
        worker_env={"MY_FLAG": "on"},
        detached=True,
    )
    yield group
    group.shutdown()
    pool.remove()


def test_worker_env_and_verl_variables_reach_the_workers(verl_group):
    assert verl_group.env("MY_FLAG") == ["on", "on"]
    assert verl_group.env("RAY_LOCAL_WORLD_SIZE") == ["2", "2"]
    assert verl_group.env("WG_BACKEND") == ["ray", "ray"] and verl_group.device_name == "cpu"


def test_execute_all_async_splits_per_worker_lists_else_broadcasts(verl_group):
    assert ray.get(verl_group.execute_all_async("add_later", [10, 20])) == [10, 21]
    assert ray.get(verl_group.execute_all_async("add_later", 5)) == [5, 6]
    assert ray.get(verl_group.execute_all("add_later", x=[1, 2])) == [1, 3]
    assert verl_group.execute_rank_zero_sync("add_later", 7) == 7


def test_func_execution_helpers(verl_group):
    out = verl_group.execute_with_func_generator(double_x, rows(3))
    assert out.batch["x"].tolist() == (rows(3).batch["x"] * 2).tolist() and out.batch["r"].tolist() == [0, 0, 1]
    assert verl_group.execute_func_rank_zero(plus, 2, b=3) == (5, 0)


def test_detached_workers_are_named_and_can_be_attached_to(verl_group):
    names = verl_group.worker_names
    assert names == ["verlapiAsyncWorker_0:0", "verlapiAsyncWorker_1:1"]
    attached = RayWorkerGroup.from_detached(
        name_prefix="verlapi2", worker_names=names, ray_cls_with_init=RayClassWithInitArgs(AsyncWorker)
    )
    assert attached.world_size == 2 and attached.add_later(1) == [1, 2]


def test_verl_keywords_refused_where_hybridflow_cannot_honour_them(ray_local):
    pool = RayResourcePool([1], num_cpus_per_process=0.5, name_prefix="refuse_")
    with pytest.raises(ValueError, match="device_name='npu'"):
        RayWorkerGroup(pool, RayClassWithInitArgs(AsyncWorker), device_name="npu")
    with pytest.raises(ValueError, match=r"cannot override .*\['RANK'\]"):
        RayWorkerGroup(pool, RayClassWithInitArgs(AsyncWorker), worker_env={"RANK": "3"})
    group = RayWorkerGroup(pool, RayClassWithInitArgs(AsyncWorker), name_prefix="unnamed")
    with pytest.raises(RuntimeError, match="detached=True"):
        _ = group.worker_names
    group.shutdown()
    pool.remove()


def test_split_resource_pool_takes_verls_keyword(ray_local):
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="splitkw_")
    parts = split_resource_pool(resource_pool=pool, split_size=1)
    assert [p.world_size for p in parts] == [1, 1]
    pool.remove()


def test_split_resource_pool_returns_verls_sub_pools(ray_local):
    pool = RayResourcePool([4], num_cpus_per_process=0.25, name_prefix="subpool_")
    try:
        halves = split_resource_pool(resource_pool=pool, split_size=2)
        quarters = split_resource_pool(halves[1], [1, 1])  # split again: counted from the original's first bundle
        parts = [*halves, *quarters]
        assert all(isinstance(p, SubRayResourcePool) for p in parts)
        shape = [(p.start_bundle_index, p.subgroup_world_size, p.world_size) for p in parts]
        assert shape == [(0, 2, 2), (2, 2, 2), (2, 1, 1), (3, 1, 1)]
        assert quarters[1].slots() == pool.slots()[3:] and quarters[1].pgs == pool.get_placement_groups()
        direct = SubRayResourcePool(  # verl's constructor
            placement_groups=pool.get_placement_groups(), start_bundle_index=1, subgroup_world_size=2, use_gpu=False
        )
        assert direct.slots() == pool.slots()[1:3] and direct.store == [2]
        with pytest.raises(ValueError, match="bundles 3 .. 4 are not all among the 4 bundles"):
            SubRayResourcePool(pool.get_placement_groups(), 3, 2)
        group = RayWorkerGroup(quarters[1], RayClassWithInitArgs(AsyncWorker), name_prefix="onsub")
        assert group.add_later(10) == [10]  # a world of one, on the original's last bundle
        group.shutdown()
        halves[0].remove()  # a part owns no placement groups: the original's stay
        assert pool.get_placement_groups() and pool.slots()[0].pg.bundle_count == 4
    finally:
        pool.remove()


def test_resource_pool_manager_places_each_role_on_its_pool(ray_local):
    spec = {"actor_pool": [1], "critic_pool": [1]}
    manager = ResourcePoolManager(
        spec, {Role.ActorRollout: "actor_pool", Role.Critic: "critic_pool"}, num_cpus_per_process=0.5
    )
    with pytest.raises(RuntimeError, match="create_resource_pool"):
        manager.get_resource_pool(Role.Critic)
    manager.create_resource_pool()
    assert manager.get_n_gpus() == 2
    groups = [
        RayWorkerGroup(
            manager.get_resource_pool(role), RayClassWithInitArgs(AsyncWorker), name_prefix=f"rpm{role.value}"
        )
        for role in (Role.ActorRollout, Role.Critic)
    ]
    try:
        assert [g.add_later(10) for g in groups] == [[10], [10]]  # each group is a world of its own
        with pytest.raises(KeyError, match="RefPolicy has no pool"):
            manager.get_resource_pool(Role.RefPolicy)
    finally:
        for group in groups:
            group.shutdown()
        for pool in manager.resource_pool_dict.values():
            pool.remove()


def test_resource_pool_manager_refuses_a_spec_the_cluster_cannot_hold(ray_local):
    with pytest.raises(ValueError, match=r"need 64 CPU but the cluster has"):
        ResourcePoolManager({"big": [64]}, {Role.Actor: "big"}).create_resource_pool()
    with pytest.raises(ValueError, match=r"names pools \['nope'\]"):
        ResourcePoolManager({"big": [1]}, {Role.Actor: "nope"}).create_resource_pool()


def test_worker_reports_its_rendezvous_and_visible_devices(monkeypatch):
    group = LocalWorkerGroup(LocalResourcePool(), ClassWithInitArgs(AsyncWorker))
    addr, port = group.worker.get_master_addr_port()
    assert (addr, port) == (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert group.worker.get_cuda_visible_devices() == "not set"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert group.worker.get_cuda_visible_devices() == "1"
    group.shutdown()


def test_base_names_and_fused_colocation():
    assert ResourcePool([2]).world_size == 2 and issubclass(LocalWorkerGroup, WorkerGroup)
    group = LocalWorkerGroup(LocalResourcePool(), create_colocated_worker_cls_fused({"a": AsyncWorker}))
    group.fuse({"a"})
    assert group.a.add_later(4) == [4]
    group.shutdown()


def test_mesh_dispatch_splits_a_tensordict_and_concatenates_tensordict_outputs():
    mode = make_nd_compute_dataproto_dispatch_fn("m")
    info = GroupInfo("g", 4, {"m": [(0, True), (0, False), (1, True), (1, False)]})
    td = TensorDict({"x": torch.arange(4)}, batch_size=[4])
    (shards,), kwargs = mode["dispatch_fn"](info, td)
    assert [s["x"].tolist() for s in shards] == [[0, 1], [0, 1], [2, 3], [2, 3]] and kwargs == {}
    outs = [TensorDict({"x": s["x"] + 10}, batch_size=[2]) for s in shards]
    assert mode["collect_fn"](info, outs)["x"].tolist() == [10, 11, 12, 13]
    with pytest.raises(ValueError, match="split evenly"):
        mode["dispatch_fn"](info, TensorDict({"x": torch.arange(3)}, batch_size=[3]))
