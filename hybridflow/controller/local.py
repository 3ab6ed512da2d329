"""In-process backend: the same WorkerGroup API with one worker in this process.

Use it to debug a worker: `LocalWorkerGroup(None, ClassWithInitArgs(MyWorker))`
builds `MyWorker` right here (RANK=0, WORLD_SIZE=1), so a breakpoint inside a
worker method stops in your debugger. The `@register` dispatch and collect
functions run as with Ray, synchronously; a non-blocking call returns an
already-computed `LocalFuture` whose `.get()` gives the result. No timeout
applies: calls run synchronously here, and a breakpoint must not trip one.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
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


class _LoopThread:
    """One event loop on a daemon thread that runs a local worker's `async def` methods to completion.

    One loop for the worker's lifetime, so state an async method keeps (locks, tasks) stays on
    one loop; a thread of its own, so a call works even from inside the caller's running loop.
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hybridflow-local-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Any) -> Any:
        """Run `coro` on the loop and return its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def alive(self) -> bool:
        """False once stopped (e.g. by the shutdown of a group spawned from the same worker)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop the loop and its thread."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


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
        self._loop: _LoopThread | None = None
        self._bind_worker_methods(cls_with_init.cls)

    @property
    def worker(self) -> Any:
        """The worker object itself (inspect its state while debugging)."""
        return self._worker

    def _prepare_args(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(_resolve(a) for a in args), {k: _resolve(v) for k, v in kwargs.items()}

    def _run(self, method_name: str, args: tuple, kwargs: dict) -> Any:
        """Call the worker's method; an `async def` one is awaited to completion on the group's loop."""
        out = getattr(self._worker, method_name)(*args, **kwargs)
        if inspect.iscoroutine(out):
            if self._loop is None or not self._loop.alive:
                self._loop = _LoopThread()
            out = self._loop.run(out)
        return out

    def _execute(self, method_name: str, ranks: list[int], per_rank: list[tuple[tuple, dict]]) -> list:
        return [self._run(method_name, a, k) for a, k in per_rank]

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
        return [self._run(method_name, args, kwargs)]

    def shutdown(self) -> None:
        """Drop the worker object (and stop the loop of its async methods)."""
        self._worker = None
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
