"""The Ray backend with real actor processes on a local 2-CPU Ray."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch
from controller_workers import ActorRole, CriticRole, MeshWorker, Probe, rows

from hybridflow import ClassWithInitArgs, DataProtoFuture
from hybridflow.controller.local import LocalWorkerGroup
from hybridflow.controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
    merge_resource_pool,
    split_resource_pool,
)
from hybridflow.controller.worker_group import WorkerError


def make_group(cls, *args, nodes=(2,), cpus=0.5, name=None, **kwargs) -> tuple[RayResourcePool, RayWorkerGroup]:
    pool = RayResourcePool(list(nodes), num_cpus_per_process=cpus, name_prefix=f"{name or cls.__name__}_")
    return pool, RayWorkerGroup(pool, RayClassWithInitArgs(cls, *args, **kwargs), name_prefix=name)


def release(pool: RayResourcePool, *groups: RayWorkerGroup) -> None:
    for g in groups:
        g.shutdown()
    pool.remove()


@pytest.fixture(scope="module")
def probe(ray_local):
    """Two Probe workers of half a CPU each (the other CPU stays free for the other tests)."""
    pool, group = make_group(Probe, offset=5, name="probe")
    yield group
    release(pool, group)


def test_ranks_and_env_are_injected(probe):
    infos = probe.info()
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2} and {i["local_world_size"] for i in infos} == {2}
    assert [i["local_rank"] for i in infos] == [0, 1]
    assert {i["master_addr"] for i in infos} == {"127.0.0.1"}
    assert len({i["master_port"] for i in infos}) == 1 and infos[0]["master_port"] > 0
    assert {(i["env_threads"], i["torch_threads"]) for i in infos} == {("1", 1)}
    assert len({i["pid"] for i in infos}) == 2 and os.getpid() not in {i["pid"] for i in infos}


def test_every_builtin_mode(probe):
    assert probe.add_rank(3, y=4) == [7, 8]
    assert probe.tag_all(["a", "b"]) == [(0, "a"), (1, "b")]
    assert probe.rank_zero("z") == (0, "z")
    assert probe.only_rank_zero() == [0]
    assert probe.dp_sum([[1, 2], [3, 4, 5]]) == [(0, 3), (1, 12)]
    assert probe.times_rank_plus_one([10, 1]) == 1 * 1 + 10 * 2  # custom mode: reversed, summed
    out = probe.affine(rows(5), scale=3)  # 5 rows over 2 ranks: padded to 6, unpadded on collect
    assert torch.equal(out.batch["y"], rows(5).batch["x"] * 3 + 6)
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(5)]
    assert torch.equal(probe.apply(lambda x: x * x, rows(4)).batch["y"], rows(4).batch["x"] ** 2)
    stats = probe.shard_stats(rows(4))
    assert [(s["rank"], s["rows"]) for s in stats] == [(0, 2), (1, 2)]
    assert sum(s["sum"] for s in stats) == int(rows(4).batch["x"].sum())


def test_futures_chain_without_the_controller_materialising(probe):
    first = probe.affine_async(rows(4))
    assert isinstance(first, DataProtoFuture) and len(first.futures) == 2
    second = probe.affine_async(first)  # chunked per rank, resolved inside the workers
    expect = (rows(4).batch["x"] * 2 + 6) * 2 + 6
    assert torch.equal(second.get().batch["x"], expect)
    kinds = probe.arg_kind(probe.affine_async(rows(4)))
    assert kinds.batch["was_future"].tolist() == [1, 1, 1, 1]
    assert torch.equal(kinds.batch["x"], rows(4).batch["x"] * 2 + 6)
    ref = ray.put(rows(4))  # a bare ObjectRef of a DataProto is split the same way
    assert torch.equal(probe.affine(ref).batch["y"], rows(4).batch["x"] * 2 + 6)


def test_all_reduce_over_the_workers_gloo_group(probe):
    assert probe.all_reduce_ranks() == [3.0, 3.0]


def test_user_error_names_group_rank_and_method(probe):
    with pytest.raises(ValueError, match="bad input on rank") as info:
        probe.fail()
    assert any("group probe rank" in n and "method fail" in n for n in getattr(info.value, "__notes__", []))


def test_error_through_a_future_names_group_rank_and_method(probe):
    future = probe.fail_async_on_last(rows(4))
    assert isinstance(future, DataProtoFuture)
    for part in (future, future.chunk(2)[0]):
        with pytest.raises(ValueError, match="bad shard on rank 1") as info:
            part.get()
        notes = getattr(info.value, "__notes__", [])
        assert any("group probe rank 1 method fail_async_on_last" in n for n in notes), notes


def test_same_results_as_the_local_backend(probe):
    local = LocalWorkerGroup(None, ClassWithInitArgs(Probe, offset=5))
    for n in (1, 4, 7):
        a, b = probe.affine(rows(n), scale=4), local.affine(rows(n), scale=4)
        assert torch.equal(a.batch["y"], b.batch["y"])
        assert a.non_tensor_batch["uid"].tolist() == b.non_tensor_batch["uid"].tolist()
    assert probe.apply(torch.neg, rows(3)).batch["y"].tolist() == local.apply(torch.neg, rows(3)).batch["y"].tolist()


def test_dp_by_tp_mesh_dispatch(ray_local):
    pool, mesh = make_group(MeshWorker, tp=2, nodes=(4,), cpus=0.25, name="mesh")
    try:
        assert mesh.get_dispatch_info("actor") == [(0, True), (0, False), (1, True), (1, False)]
        out = mesh.tag(rows(5))  # 5 rows over dp=2: padded to 6
        assert torch.equal(out.batch["x"], rows(5).batch["x"])
        assert out.batch["dp"].tolist() == [0, 0, 0, 1, 1]
        assert out.batch["tp"].tolist() == [0] * 5 and out.batch["rank"].tolist() == [0, 0, 0, 2, 2]
        mesh.tag(rows(4), label=7)  # a keyword reaches every rank, those not collected too
        assert mesh.labels_seen() == [[0, 7]] * 4
    finally:
        release(pool, mesh)


def test_colocated_roles_share_processes_on_split_and_merged_pools(ray_local):
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="coloc_")
    first, second = split_resource_pool(pool, 1)
    assert (first.world_size, second.world_size) == (1, 1)
    merged = merge_resource_pool(second, first)  # rank 0 now sits on the pool's bundle 1
    assert [s.bundle_index for s in merged.slots()] == [1, 0]
    fused = create_colocated_worker_cls({"actor": ClassWithInitArgs(ActorRole, 100), "critic": CriticRole})
    group = RayWorkerGroup(merged, fused, name_prefix="coloc")
    try:
        roles = group.spawn({"actor", "critic"})
        actor, critic = roles["actor"], roles["critic"]
        a, c = actor.where(), critic.where()
        assert [x[1:] for x in a] == [(0, "actor"), (1, "actor")]
        assert [x[1:] for x in c] == [(0, "critic"), (1, "critic")]
        assert [x[0] for x in a] == [x[0] for x in c] and len({x[0] for x in a}) == 2
        out = critic.negate(actor.shift(rows(3)))
        assert torch.equal(out.batch["x"], -(rows(3).batch["x"] + 100))
        assert actor.name == "coloc_actor" and not hasattr(actor, "negate")
    finally:
        release(pool, group)


def test_a_worker_dying_mid_call_raises_within_seconds(ray_local):
    pool, group = make_group(Probe, nodes=(2,), cpus=0.5, name="doomed")
    try:
        group.info()  # both workers up
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"group doomed rank 1 method die_on died"):
            group.die_on(1)
        # not a speed check: rank 0 sleeps 30 s, so a caller that waited for every rank would be here later
        assert time.monotonic() - start < 25
    finally:
        release(pool, group)


def test_pool_that_cannot_be_placed_fails_clearly(ray_local):
    pool = RayResourcePool([1], num_cpus_per_process=64, ready_timeout_s=1, name_prefix="huge_")
    with pytest.raises(RuntimeError, match="were not scheduled"):
        pool.slots()


def test_max_colocate_count_lets_separate_groups_share_a_pool(ray_local):
    # Half a CPU per bundle, shared by two groups in their own processes: each actor asks for half of that.
    pool = RayResourcePool([2], num_cpus_per_process=0.5, max_colocate_count=2, name_prefix="shared_")
    first = RayWorkerGroup(pool, RayClassWithInitArgs(Probe, offset=1), name_prefix="shared_a")
    second = RayWorkerGroup(pool, RayClassWithInitArgs(Probe, offset=2), name_prefix="shared_b")
    a, b = first.info(), second.info()
    assert [i["offset"] for i in a] == [1, 1] and [i["offset"] for i in b] == [2, 2]
    assert [i["rank"] for i in b] == [0, 1] and a[0]["master_port"] != b[0]["master_port"]
    assert not {i["pid"] for i in a} & {i["pid"] for i in b}
    assert {i["torch_threads"] for i in a + b} == {1}  # a quarter CPU each still gets one thread
    release(pool, first, second)


def _env_of(worker, names: list[str]) -> dict:
    return ray.get(worker.__ray_call__.remote(lambda self: {n: os.environ.get(n) for n in names}))


def test_extra_env_vars_reach_every_worker_and_never_override_the_groups_own(ray_local):
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="env_")
    extra = {"HYBRIDFLOW_TEST_FLAG": "on", "RANK": "99"}
    group = RayWorkerGroup(pool, RayClassWithInitArgs(Probe), name_prefix="env", env_vars=extra)
    envs = [_env_of(w, ["HYBRIDFLOW_TEST_FLAG", "RANK"]) for w in group.workers]
    assert envs == [{"HYBRIDFLOW_TEST_FLAG": "on", "RANK": "0"}, {"HYBRIDFLOW_TEST_FLAG": "on", "RANK": "1"}]
    release(pool, group)
