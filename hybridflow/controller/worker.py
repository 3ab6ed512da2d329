"""`Worker`: the base class of a process that runs one SPMD rank.

A backend starts one process per rank with these environment variables set
and instantiates the worker class there:

    RANK, WORLD_SIZE              this rank and the group size
    LOCAL_RANK, LOCAL_WORLD_SIZE  rank among, and number of, the group's processes on this node
    MASTER_ADDR, MASTER_PORT      where rank 0 listens for torch.distributed rendezvous
    HYBRIDFLOW_NUM_THREADS        CPU threads this process may use (its CPU share)
    HYBRIDFLOW_COLLECTIVE_TIMEOUT_S  torch.distributed timeout of `init_process_group` (default 300)

Subclasses call `super().__init__()` first, then build their state; their
`@register` methods are what the controller calls.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.controller.decorator import Dispatch, register
from hybridflow.utils.device import device_kind, dist_backend

NUM_THREADS_ENV = "HYBRIDFLOW_NUM_THREADS"
COLLECTIVE_TIMEOUT_ENV = "HYBRIDFLOW_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


def collective_timeout_s() -> float:
    """This worker's torch.distributed timeout (HYBRIDFLOW_COLLECTIVE_TIMEOUT_S, set by its group)."""
    return _env_float(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S)


class Worker:
    """One SPMD rank: reads its place in the group from the environment."""

    def __init__(self) -> None:
        self._rank = _env_int("RANK", 0)
        self._world_size = _env_int("WORLD_SIZE", 1)
        self._local_rank = _env_int("LOCAL_RANK", 0)
        self._local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        self._master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._master_port = _env_int("MASTER_PORT", 0)
        self._dispatch_info: dict[str, tuple[int, bool]] = {}
        _apply_thread_limit()

    @property
    def rank(self) -> int:
        """Global rank of this process in its worker group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes in the worker group."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank among the group's processes on this node."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """Number of the group's processes on this node."""
        return self._local_world_size

    @property
    def master_addr(self) -> str:
        """Address of rank 0 for torch.distributed rendezvous."""
        return self._master_addr

    @property
    def master_port(self) -> int:
        """Port of rank 0 for torch.distributed rendezvous."""
        return self._master_port

    def get_master_addr_port(self) -> tuple[str, str]:
        """verl's: (MASTER_ADDR, MASTER_PORT) of the group's rendezvous, the port as a string."""
        return self._master_addr, str(self._master_port)

    def get_cuda_visible_devices(self) -> str:
        """verl's: this process's CUDA_VISIBLE_DEVICES, or "not set"."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "not set")

    def init_process_group(self, backend: str | None = None, timeout_s: float | None = None) -> None:
        """Join the default torch.distributed group of all ranks (idempotent).

        `backend` defaults to nccl for a cuda worker, gloo for a cpu one (its group's device, `utils/device.py`). `timeout_s` bounds every
        collective's wait for a peer (gloo raises, NCCL aborts the process); None: the group's
        HYBRIDFLOW_COLLECTIVE_TIMEOUT_S, else DEFAULT_COLLECTIVE_TIMEOUT_S.
        """
        if dist.is_initialized():
            return
        if self._world_size > 1 and not self._master_port:
            raise RuntimeError(
                f"rank {self._rank}: MASTER_PORT is not set; start workers through a WorkerGroup "
                "or set MASTER_ADDR/MASTER_PORT before init_process_group"
            )
        if backend is None:
            backend = dist_backend(device_kind())
        port = self._master_port or find_free_port()
        timeout_s = timeout_s or collective_timeout_s()
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self._master_addr}:{port}",
            rank=self._rank,
            world_size=self._world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's place in the named mesh for mesh-aware dispatch.

        `dp_rank`: which data shard this rank receives; `is_collect`: whether its
        output is kept (exactly one rank per dp group, e.g. tp rank 0).
        """
        self._dispatch_info[mesh_name] = (int(dp_rank), bool(is_collect))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> tuple[int, bool]:
        """This rank's `(dp_rank, is_collect)` in `mesh_name` (controller side)."""
        if mesh_name not in self._dispatch_info:
            raise KeyError(
                f"rank {self._rank} declared no mesh {mesh_name!r} (declared: {sorted(self._dispatch_info)}); "
                "call self._register_dispatch_collect_info(mesh_name, dp_rank, is_collect) in __init__"
            )
        return self._dispatch_info[mesh_name]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        """verl's: run `func(self, *shard_args, **shard_kwargs)` on every rank, DataProto arguments split
        over the ranks and the outputs concatenated (`func` must be picklable)."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def execute_func_rank_zero(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        """verl's: run `func(*args, **kwargs)` (no worker argument) on rank 0 only; returns its output."""
        return func(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _hf_process_info(self) -> dict:
        """pid, host name and rank layout of this process (for tests and debugging)."""
        return {
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "rank": self._rank,
            "world_size": self._world_size,
            "local_rank": self._local_rank,
            "local_world_size": self._local_world_size,
            "num_threads": torch.get_num_threads(),
        }


def _apply_thread_limit() -> None:
    """Use as many torch threads as CPUs given to this process, so ranks do not oversubscribe."""
    n = _env_int(NUM_THREADS_ENV, 0)
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)
