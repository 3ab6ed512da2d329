"""The in-process backend and the dispatch/collect functions, without Ray."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from controller_workers import REVERSED, ActorRole, CriticRole, MeshWorker, Probe, rows

from hybridflow import ClassWithInitArgs, DataProto, Dispatch, Worker, register
from hybridflow.controller.colocate import create_colocated_worker_cls
from hybridflow.controller.decorator import get_dispatch_mode, register_dispatch_mode
from hybridflow.controller.dispatch import PAD_SIZE_KEY, make_nd_compute_dataproto_dispatch_fn
from hybridflow.controller.local import LocalFuture, LocalResourcePool, LocalWorkerGroup
from hybridflow.controller.worker_group import GroupInfo
from hybridflow.protocol import unpad_dataproto


@pytest.fixture(scope="module")
def group() -> LocalWorkerGroup:
    return LocalWorkerGroup(LocalResourcePool(), ClassWithInitArgs(Probe, offset=5))


def test_worker_lives_in_this_process_with_rank_zero_env(group):
    info = group.info()
    assert len(info) == 1 and info[0]["pid"] == os.getpid()
    assert (info[0]["rank"], info[0]["world_size"], info[0]["offset"]) == (0, 1, 5)
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    assert group.worker.offset == 5


def test_every_builtin_mode_runs_in_process(group):
    assert group.add_rank(3, y=4) == [7]
    assert group.tag_all(["a"]) == [(0, "a")]
    assert group.rank_zero("z") == (0, "z")
    assert group.only_rank_zero() == [0]
    assert group.dp_sum([[1, 2, 3]]) == [(0, 6)]
    assert group.times_rank_plus_one([7]) == 7
    out = group.affine(rows(5), scale=3)
    assert torch.equal(out.batch["y"], rows(5).batch["x"] * 3 + 6)
    assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(5)]
    assert torch.equal(group.apply(torch.neg, rows(4)).batch["y"], -rows(4).batch["x"])
    assert group.shard_stats(rows(4)) == [{"rank": 0, "rows": 4, "sum": int(rows(4).batch["x"].sum())}]


def test_non_blocking_returns_a_resolved_future_that_chains(group):
    fut = group.affine_async(rows(3))
    assert isinstance(fut, LocalFuture)
    again = group.affine_async(fut)  # a future passed back in is resolved in-process
    assert torch.equal(again.get().batch["x"], (rows(3).batch["x"] * 2 + 6) * 2 + 6)


def test_user_errors_propagate_unchanged(group):
    with pytest.raises(ValueError, match="bad input on rank 0"):
        group.fail()


def test_dp_proto_dispatch_pads_to_world_size_and_collect_unpads():
    mode = get_dispatch_mode(Dispatch.DP_COMPUTE_PROTO)
    args, kwargs = mode.dispatch_fn(GroupInfo("g", 3), rows(7), scale=2)
    shards = args[0]
    assert kwargs["scale"] == [2, 2, 2] and kwargs[PAD_SIZE_KEY] == 2
    assert [len(s) for s in shards] == [3, 3, 3]
    # padding repeats rows from the start; dropping the pad restores the input exactly
    merged = unpad_dataproto(mode.collect_fn(GroupInfo("g", 3), shards), kwargs[PAD_SIZE_KEY])
    assert torch.equal(merged.batch["x"], rows(7).batch["x"])
    assert merged.non_tensor_batch["uid"].tolist() == rows(7).non_tensor_batch["uid"].tolist()


def test_keyword_arguments_reach_every_rank_in_proto_modes():
    """Non-DataProto keywords go whole to every rank (every tp rank of a mesh too); DataProto keywords are split."""
    args, kwargs = get_dispatch_mode(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC).dispatch_fn(
        GroupInfo("g", 2), abs, data=rows(4), step=3, flags=(True, False)
    )
    assert args == ([abs, abs],) and kwargs["step"] == [3, 3] and kwargs["flags"] == [(True, False)] * 2
    assert [len(d) for d in kwargs["data"]] == [2, 2]
    mesh = make_nd_compute_dataproto_dispatch_fn("m")
    info = GroupInfo("g", 4, {"m": [(0, True), (0, False), (1, True), (1, False)]})
    args, kwargs = mesh["dispatch_fn"](info, rows(4), step=3, sampling={"n": 2})
    assert kwargs["step"] == [3] * 4 and kwargs["sampling"] == [{"n": 2}] * 4
    assert [d.batch["x"][0, 0].item() for d in args[0]] == [0, 0, 20, 20]


def test_dp_proto_dispatch_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        get_dispatch_mode(Dispatch.DP_COMPUTE_PROTO).dispatch_fn(GroupInfo("g", 2), rows(4), rows(6))


def test_collect_proto_names_the_fix_when_a_method_returns_no_dataproto():
    with pytest.raises(TypeError, match="DP_COMPUTE_METRIC"):
        get_dispatch_mode(Dispatch.DP_COMPUTE_PROTO).collect_fn(GroupInfo("g", 2), [{"a": 1}, {"a": 2}])


def test_nd_mesh_dispatch_gives_every_tp_rank_its_dp_shard():
    # 2 dp x 2 tp: ranks 0,1 -> dp 0; ranks 2,3 -> dp 1; tp rank 0 collects
    info = GroupInfo("g", 4, {"m": [(0, True), (0, False), (1, True), (1, False)]})
    mode = get_dispatch_mode(make_nd_compute_dataproto_dispatch_fn("m"))
    args, kwargs = mode.dispatch_fn(info, rows(3))
    shards = args[0]
    assert kwargs[PAD_SIZE_KEY] == 1
    assert torch.equal(shards[0].batch["x"], shards[1].batch["x"])
    assert torch.equal(shards[2].batch["x"], shards[3].batch["x"])
    outs = [DataProto.from_dict({"x": s.batch["x"] * (-1 if r % 2 else 1)}) for r, s in enumerate(shards)]
    merged = unpad_dataproto(mode.collect_fn(info, outs), kwargs[PAD_SIZE_KEY])
    assert torch.equal(merged.batch["x"], rows(3).batch["x"])  # the tp rank 1 outputs were dropped


def test_nd_mesh_collect_requires_one_collector_per_dp_group():
    info = GroupInfo("g", 2, {"m": [(0, True), (1, False)]})
    mode = get_dispatch_mode(make_nd_compute_dataproto_dispatch_fn("m"))
    with pytest.raises(ValueError, match="exactly one rank per dp group"):
        mode.collect_fn(info, [rows(1), rows(1)])


def test_mesh_worker_and_colocated_roles_run_in_process():
    mesh = LocalWorkerGroup(None, ClassWithInitArgs(MeshWorker, tp=1))
    out = mesh.tag(rows(3))
    assert torch.equal(out.batch["x"], rows(3).batch["x"]) and out.batch["rank"].tolist() == [0, 0, 0]
    mesh.tag(data=rows(3), label=7)  # the DataProto by keyword, a keyword-only argument
    assert mesh.labels_seen() == [[0, 7]]
    roles_cls = {"actor": ClassWithInitArgs(ActorRole, 100), "critic": CriticRole}
    fused = LocalWorkerGroup(None, create_colocated_worker_cls(roles_cls))
    roles = fused.spawn({"actor", "critic"})
    assert roles["actor"].where() == [(os.getpid(), 0, "actor")]
    assert roles["critic"].where() == [(os.getpid(), 0, "critic")]
    assert torch.equal(roles["critic"].negate(roles["actor"].shift(rows(2))).batch["x"], -(rows(2).batch["x"] + 100))
    assert not hasattr(roles["actor"], "negate")


def test_bad_declarations_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="dispatch_mode='NO_SUCH_MODE' is not a registered dispatch mode"):
        register(dispatch_mode="NO_SUCH_MODE")
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode(REVERSED, lambda wg: ((), {}), lambda wg, o: o)
    with pytest.raises(ValueError, match="no role may start with another"):
        create_colocated_worker_cls({"actor": ActorRole, "actor_ref": CriticRole})
    with pytest.raises(ValueError, match="exactly one process"):
        LocalResourcePool([2])

    class Shadow(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def spawn(self) -> None:
            """Collides with WorkerGroup.spawn."""

    with pytest.raises(ValueError, match="shadows WorkerGroup.spawn"):
        LocalWorkerGroup(None, ClassWithInitArgs(Shadow))


def test_wrong_per_rank_list_length_is_rejected(group):
    with pytest.raises(ValueError, match="one entry per rank"):
        group.dp_sum([[1], [2]])


def test_call_nonblocking_issues_a_blocking_method_as_a_future(group):
    future = group.call_nonblocking("affine", rows(4), scale=3)
    assert isinstance(future, LocalFuture)
    assert torch.equal(future.get().batch["y"], group.affine(rows(4), scale=3).batch["y"])
    roles = LocalWorkerGroup(
        None, create_colocated_worker_cls({"actor": ClassWithInitArgs(ActorRole, 100), "critic": CriticRole})
    ).spawn({"actor", "critic"})
    shifted = roles["actor"].call_nonblocking("shift", rows(2)).get()  # a spawned view finds its role's method
    assert torch.equal(shifted.batch["x"], rows(2).batch["x"] + 100)
    with pytest.raises(AttributeError, match="no registered method 'negate'"):
        roles["actor"].call_nonblocking("negate", rows(2))


def test_the_local_backend_never_imports_ray():
    """Dispatch, collect and the failure classifier run without Ray imported (nor installed, on a GPU box
    with the local backend): a worker error must reach the user as itself, not as "No module named 'ray'"."""
    code = """
import sys
from controller_workers import Probe, rows
from hybridflow import ClassWithInitArgs
from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup
from hybridflow.train.recovery import is_worker_failure
group = LocalWorkerGroup(LocalResourcePool(), ClassWithInitArgs(Probe, offset=5))
assert group.affine(rows(4), scale=2).batch["y"].shape[0] == 4
assert not is_worker_failure(RuntimeError("a bug in a step"), [])
print(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
"""
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
