"""In-process backend: the same WorkerGroup API with one worker in this process.

Use it to debug a worker: `LocalWorkerGroup(None, ClassWithInitArgs(MyWorker))`
builds `MyWorker` right here (RANK=0, WORLD_SIZE=1), so a breakpoint inside a
worker method stops in your debugger. The `@register` dispatch and collect
functions run as with Ray, synchronously; a non-blocking call returns an
already-computed `LocalFuture` whose `.get()` gives the result. No timeout
applies: calls run synchronously here, and a breakpoint must not trip one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from hybridflow.controller.dispatch import _is_future, _is_object_ref
from hybridflow.controller.resource_pool import ClassWithInitArgs, ResourcePool
from hybridflow.controller.worker import find_free_port
from hybridflow.controller.worker_group import WorkerGroup
from hybridflow.utils.device import DEVICE_ENV


class LocalResourcePool(ResourcePool):
    """A pool of exactly one slot: this process."""

    def __init__(self, process_on_nodes: list[int] | None = None, use_gpu: bool = False) -> None:
        super().__init__(process_on_nodes or [1], use_gpu=use_gpu)
        if self.world_size != 1:
            raise ValueError(
                f"LocalResourcePool holds exactly one process (this one), got process_on_nodes={self.store}; "
                "use RayResourcePool for more"
            )


class LocalFuture:
    """The result of a non-blocking local call, already computed."""

    def __init__(self, outputs: list, collect: Callable[[list], Any]) -> None:
        self._outputs = outputs
        self._collect = collect

    def get(self) -> Any:
        """The collected result."""
        return self._collect(self._outputs)


def _resolve(value: Any) -> Any:
    """Materialise futures and object refs (everything runs here anyway)."""
    if isinstance(value, LocalFuture):
        return value.get()

    if _is_future(value):
        return value.get()
    if _is_object_ref(value):
        import ray  # noqa: PLC0415  (lazy: the local backend runs without Ray)

        return ray.get(value)
    return value


def _process_group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class LocalWorkerGroup(WorkerGroup):
    """A WorkerGroup of one worker instantiated in the controller process."""

    def __init__(
        self,
        resource_pool: LocalResourcePool | None = None,
        cls_with_init: ClassWithInitArgs | None = None,
        name_prefix: str | None = None,
    ) -> None:
        if not isinstance(cls_with_init, ClassWithInitArgs):
            raise TypeError("LocalWorkerGroup needs a ClassWithInitArgs(WorkerCls, *args, **kwargs)")
        if resource_pool is not None and resource_pool.world_size != 1:
            raise ValueError(f"LocalWorkerGroup runs one worker; got a pool of {resource_pool.world_size}")
        super().__init__(name_prefix or f"{cls_with_init.cls.__name__}_{uuid.uuid4().hex[:6]}", 1)
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        os.environ[DEVICE_ENV] = "cuda" if resource_pool is not None and resource_pool.use_gpu else "cpu"
        if not _process_group_ready():
            # A fresh port every time: one inherited from a parent process may still be held by its group.
            os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())})
        self._worker = cls_with_init()
        self._bind_worker_methods(cls_with_init.cls)

    @property
    def worker(self) -> Any:
        """The worker object itself (inspect its state while debugging)."""
        return self._worker

    def _prepare_args(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(_resolve(a) for a in args), {k: _resolve(v) for k, v in kwargs.items()}

    def _execute(self, method_name: str, ranks: list[int], per_rank: list[tuple[tuple, dict]]) -> list:
        method = getattr(self._worker, method_name)
        return [method(*a, **k) for a, k in per_rank]

    def _wait(self, method_name: str, ranks: list[int], outputs: list) -> list:
        return outputs

    def _make_future(
        self, method_name: str, ranks: list[int], outputs: list, collect: Callable, collects_proto: bool
    ) -> Any:
        if collects_proto:
            return LocalFuture(outputs, collect)
        return [LocalFuture([o], lambda outs: outs[0]) for o in outputs]

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Call any worker method with these arguments; its output in a one-element list."""
        return [getattr(self._worker, method_name)(*args, **kwargs)]

    def shutdown(self) -> None:
        """Drop the worker object."""
        self._worker = None
