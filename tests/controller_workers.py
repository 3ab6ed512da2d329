"""Worker classes shared by the controller tests (importable by Ray workers via PYTHONPATH)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.controller.decorator import (
    Dispatch,
    Execute,
    get_dispatch_mode,
    register,
    register_dispatch_mode,
)
from hybridflow.controller.dispatch import make_nd_compute_dataproto_dispatch_fn
from hybridflow.controller.worker import NUM_THREADS_ENV, Worker
from hybridflow.protocol import DataProto, DataProtoFuture

REVERSED = "TEST_REVERSED_SUM"


def _reversed_dispatch(wg: Any, xs: list) -> tuple[tuple, dict]:
    return (list(reversed(xs)),), {}


def _sum_collect(wg: Any, outputs: list) -> Any:
    return sum(outputs)


try:
    get_dispatch_mode(REVERSED)
except ValueError:
    register_dispatch_mode(REVERSED, _reversed_dispatch, _sum_collect)


def rows(n: int, width: int = 3) -> DataProto:
    """Rows 0..n-1: x[i] = [i*10, i*10+1, ...] (int64) and a string uid per row."""
    x = torch.arange(n)[:, None] * 10 + torch.arange(width)
    return DataProto.from_dict({"x": x}, {"uid": [f"u{i}" for i in range(n)]}, {"tag": "in"})


class Probe(Worker):
    """One method per dispatch mode; rank-dependent outputs show who ran what."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def info(self) -> dict:
        """Rank layout, rendezvous address, threads and pid of this worker."""
        return {
            "rank": self.rank, "world_size": self.world_size,
            "local_rank": self.local_rank, "local_world_size": self.local_world_size,
            "master_addr": self.master_addr, "master_port": self.master_port,
            "env_threads": os.environ.get(NUM_THREADS_ENV), "torch_threads": torch.get_num_threads(),
            "pid": os.getpid(), "offset": self.offset,
        }  # fmt: skip

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add_rank(self, x: int, y: int = 0) -> int:
        """x + y + rank."""
        return x + y + self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def tag_all(self, x: Any) -> tuple[int, Any]:
        """(rank, the per-rank argument it got)."""
        return self.rank, x

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def rank_zero(self, x: Any) -> tuple[int, Any]:
        """(rank, x); only rank 0 runs."""
        return self.rank, x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self) -> int:
        """This rank (executed on rank 0 only)."""
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def dp_sum(self, xs: list[int]) -> tuple[int, int]:
        """(rank, sum of this rank's list)."""
        return self.rank, sum(xs)

    @register(dispatch_mode=REVERSED)
    def times_rank_plus_one(self, x: int) -> int:
        """x * (rank + 1), with the custom reversed dispatch and summed collect."""
        return x * (self.rank + 1)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def affine(self, data: DataProto, scale: int = 2) -> DataProto:
        """y = x * scale + 1 + offset, plus the rank that computed each row."""
        y = data.batch["x"] * scale + 1 + self.offset
        ranks = torch.full((len(data),), self.rank)
        return DataProto.from_dict({"y": y, "rank": ranks}, {"uid": data.non_tensor_batch["uid"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def affine_async(self, data: DataProto) -> DataProto:
        """Non-blocking: y = x * 2 + 1 + offset."""
        return DataProto.from_dict({"x": data.batch["x"] * 2 + 1 + self.offset})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def arg_kind(self, data: Any) -> DataProto:
        """Per row: 1 if the argument arrived as a DataProtoFuture (then resolved here)."""
        was_future = isinstance(data, DataProtoFuture)
        data = data.get() if was_future else data
        return DataProto.from_dict({"x": data.batch["x"], "was_future": torch.full((len(data),), int(was_future))})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor], data: DataProto) -> DataProto:
        """y = fn(x) on this shard."""
        return DataProto.from_dict({"y": fn(data.batch["x"])})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def shard_stats(self, data: DataProto) -> dict:
        """Metrics of this shard: rank, rows, sum of x."""
        return {"rank": self.rank, "rows": len(data), "sum": int(data.batch["x"].sum())}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_ranks(self) -> float:
        """Join the gloo group and all_reduce (rank + 1): every rank gets sum(1..world_size)."""
        self.init_process_group()
        self.init_process_group()  # idempotent
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def die_on(self, rank: int) -> int:
        """Rank `rank` kills its process mid-call; the others stay busy for a while."""
        if self.rank == rank:
            os._exit(1)
        time.sleep(30)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail(self) -> None:
        """Raise a ValueError (a user error, not a crash)."""
        raise ValueError(f"bad input on rank {self.rank}")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def fail_async_on_last(self, data: DataProto) -> DataProto:
        """Non-blocking; the last rank raises a ValueError, the others return their shard."""
        if self.rank == self.world_size - 1:
            raise ValueError(f"bad shard on rank {self.rank}")
        return data


class MeshWorker(Worker):
    """Ranks arranged as dp x tp (tp fastest); tp rank 0 of each dp group is collected."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.dp_rank, self.tp_rank = divmod(self.rank, tp)
        self._register_dispatch_collect_info("actor", dp_rank=self.dp_rank, is_collect=self.tp_rank == 0)
        self.labels: list[int] = []

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("actor"))
    def tag(self, data: DataProto, *, label: int = 0) -> DataProto:
        """The shard with the dp, tp and global rank of each row's worker; remembers `label`."""
        self.labels.append(label)
        n = len(data)
        return DataProto.from_dict(
            {
                "x": data.batch["x"],
                "dp": torch.full((n,), self.dp_rank),
                "tp": torch.full((n,), self.tp_rank),
                "rank": torch.full((n,), self.rank),
            }
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def labels_seen(self) -> list[int]:
        """The `label` of every `tag` call on this rank, in order."""
        return self.labels


class ActorRole(Worker):
    """A colocated role."""

    def __init__(self, bias: int) -> None:
        super().__init__()
        self.bias = bias

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> tuple[int, int, str]:
        """(pid, rank, role)."""
        return os.getpid(), self.rank, "actor"

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def shift(self, data: DataProto) -> DataProto:
        """x + bias."""
        return DataProto.from_dict({"x": data.batch["x"] + self.bias})


class CriticRole(Worker):
    """Another colocated role."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> tuple[int, int, str]:
        """(pid, rank, role)."""
        return os.getpid(), self.rank, "critic"

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def negate(self, data: DataProto) -> DataProto:
        """-x."""
        return DataProto.from_dict({"x": -data.batch["x"]})


class Gate(Worker):
    """Two calls that must overlap: `wait_open` sees `open` only if the actor runs calls concurrently."""

    def __init__(self) -> None:
        super().__init__()
        self._opened = threading.Event()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def wait_open(self, timeout_s: float) -> bool:
        """Non-blocking: True if `open` ran before `timeout_s` passed."""
        return self._opened.wait(timeout_s)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def open(self) -> int:
        """Open the gate; returns the rank."""
        self._opened.set()
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def getenv(self, name: str) -> str | None:
        """This worker's environment variable `name`."""
        return os.environ.get(name)


class Staller(Worker):
    """Rank `stuck_rank` stalls in `stall*` (sleeps far past any test timeout) and never joins the
    collective of `all_reduce_without_stuck`; the other ranks return at once (all of them for -1)."""

    def __init__(self, stuck_rank: int = 1) -> None:
        super().__init__()
        self.stuck_rank = stuck_rank

    def _stall_if_stuck(self) -> None:
        if self.rank == self.stuck_rank:
            time.sleep(600)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rank_of(self) -> int:
        """This rank, at once on every rank."""
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stall(self) -> int:
        """This rank; the stuck rank never gets there."""
        self._stall_if_stuck()
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def stall_async(self, data: DataProto) -> DataProto:
        """Non-blocking: this rank's shard back; the stuck rank never gets there."""
        self._stall_if_stuck()
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def stall_proto(self, data: DataProto) -> DataProto:
        """This rank's shard back (a future argument is resolved here first); the stuck rank never gets there."""
        self._stall_if_stuck()
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_without_stuck(self) -> float:
        """Join the gloo group; all ranks but the stuck one all_reduce, so they wait for it (and time out)."""
        self.init_process_group()
        if self.rank == self.stuck_rank:
            return -1.0
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t.item())
