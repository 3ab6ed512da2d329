"""DataProto through a real local Ray, and DataProtoFuture with real object refs."""

import subprocess
import sys

import pytest
import ray
import torch

from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.protocol.keys import META_METRICS


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One loopback-only Ray for this module (reused if another module already started one)."""
    # the tests directory is not on the workers' sys.path: ship this module's functions by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=1, include_dashboard=False)
    yield
    if started:
        ray.shutdown()


def make(n: int, start: int = 0) -> DataProto:
    """Rows start..start+n-1 with an int64, a bf16 and a string column."""
    rows = torch.arange(start, start + n)
    return DataProto.from_dict(
        {"x": rows[:, None] * 10 + torch.arange(4), "h": rows.to(torch.bfloat16)[:, None].repeat(1, 3) / 7},
        {"uid": [f"u{i}" for i in rows.tolist()]},
        {"temperature": 1.0},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    """Same length, tensors (with dtypes), strings and meta_info."""
    assert len(a) == len(b) and sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        assert a.batch[key].dtype == b.batch[key].dtype and torch.equal(a.batch[key], b.batch[key]), key
    assert a.non_tensor_batch["uid"].tolist() == b.non_tensor_batch["uid"].tolist()
    assert a.meta_info == b.meta_info


@ray.remote(num_cpus=0)
def produce(n: int, start: int) -> DataProto:
    """A worker output: rows start..start+n-1 and a per-worker metric."""
    out = make(n, start)
    out.meta_info[META_METRICS] = {"rows": [n]}
    return out


@ray.remote(num_cpus=0)
def double_x(data) -> DataProto:
    """A worker step that receives a DataProto or a DataProtoFuture and resolves it itself."""
    if isinstance(data, DataProtoFuture):
        data = data.get()
    data.batch["x"] *= 2
    return data


def test_importing_protocol_does_not_import_ray():
    code = "import sys, hybridflow.protocol; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ray_put_get_round_trip():
    d = make(256)
    back = ray.get(ray.put(d))
    assert_same(back, d)


def test_mutating_a_fetched_batch_leaves_the_stored_object_intact():
    ref = ray.put(make(1024))
    first = ray.get(ref)
    first.batch["x"].add_(1)
    assert_same(ray.get(ref), make(1024))


def test_dataproto_as_task_argument_and_result():
    out = ray.get(double_x.remote(make(8)))
    assert torch.equal(out.batch["x"], make(8).batch["x"] * 2)


def test_future_concat_collects_worker_outputs_in_order():
    refs = [produce.remote(3, 3 * i) for i in range(3)]
    future = DataProtoFuture.concat(refs)
    assert future.dispatch_fn is None and future.futures == refs
    result = future.get()
    expected = DataProto.concat([make(3, 0), make(3, 3), make(3, 6)])
    assert_same(result.select(meta_info_keys=["temperature"]), expected)
    assert result.meta_info[META_METRICS] == {"rows": [3]}  # equal across workers: kept once


def test_future_chunk_resolves_each_part_on_the_worker():
    refs = [produce.remote(4, 0), produce.remote(4, 4)]
    chunks = DataProtoFuture.concat(refs).chunk(4)
    assert len(chunks) == 4 and all(c.futures == refs for c in chunks)
    outputs = ray.get([double_x.remote(c) for c in chunks])  # the futures travel, not the data
    assert [o.non_tensor_batch["uid"].tolist() for o in outputs] == [[f"u{2 * i}", f"u{2 * i + 1}"] for i in range(4)]
    assert torch.equal(DataProto.concat(outputs).batch["x"], make(8).batch["x"] * 2)


def test_future_chunk_of_chunk_and_errors():
    future = DataProtoFuture.concat([ray.put(make(8))])
    inner = future.chunk(2)[1].chunk(2)[0]
    assert inner.get().non_tensor_batch["uid"].tolist() == ["u4", "u5"]
    with pytest.raises(ValueError, match="not divisible by 3 chunks"):
        future.chunk(3)[0].get()
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        future.chunk(0)


def test_future_with_custom_collect_and_dispatch():
    future = DataProtoFuture(collect_fn=sum, futures=[ray.put(2), ray.put(5)], dispatch_fn=lambda v: v * 10)
    assert future.get() == 70
