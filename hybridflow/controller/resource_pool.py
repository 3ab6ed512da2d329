"""Backend-agnostic resource pools and delayed construction of worker classes."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class ResourcePool:
    """A set of process slots spread over nodes; one worker process per slot.

    Several worker groups may share a pool's slots (each slot then hosts up to
    `max_colocate_count` processes, one per group).
    """

    def __init__(
        self, process_on_nodes: list[int] | None = None, max_colocate_count: int = 1, use_gpu: bool = False
    ) -> None:
        process_on_nodes = list(process_on_nodes or [])
        if any(int(n) < 0 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must hold non-negative counts, got {process_on_nodes}")
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        self._store = [int(n) for n in process_on_nodes]
        self.max_colocate_count = max_colocate_count
        """How many worker processes may share one slot."""
        self.use_gpu = use_gpu
        """Whether each slot holds one GPU."""

    def add_node(self, process_count: int) -> None:
        """Append a node with `process_count` slots."""
        self._store.append(int(process_count))

    @property
    def store(self) -> list[int]:
        """Slots per node, in node order."""
        return list(self._store)

    @property
    def world_size(self) -> int:
        """Total number of slots (= ranks of a worker group on this pool)."""
        return sum(self._store)

    def local_world_size_list(self) -> list[int]:
        """For each rank, the number of slots on its node."""
        return [n for n in self._store for _ in range(n)]

    def local_rank_list(self) -> list[int]:
        """For each rank, its index among the slots of its node."""
        return [i for n in self._store for i in range(n)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(process_on_nodes={self._store}, use_gpu={self.use_gpu})"


POOL_OWNED_OPTIONS = frozenset(
    {
        "num_cpus",
        "num_gpus",
        "resources",
        "memory",
        "object_store_memory",
        "accelerator_type",
        "label_selector",
        "fallback_strategy",
        "scheduling_strategy",
        "placement_group",
        "placement_group_bundle_index",
        "placement_group_capture_child_tasks",
    }
)
"""Ray actor options that say where and on what a worker runs: the resource pool decides those."""


def unwrap_remote_class(cls: Any) -> tuple[Any, dict[str, Any]]:
    """(the user's class, its Ray actor options) for a `ray.remote(...)` class; (cls, {}) for anything else.

    Options in `POOL_OWNED_OPTIONS` are dropped (with a warning): every worker
    gets its slot's share of the pool's bundle, whatever the decorator asked for.
    Ray is not imported: an actor class is recognised by its `__ray_metadata__`.
    """
    meta = getattr(cls, "__ray_metadata__", None)
    if meta is None:
        return cls, {}
    plain = getattr(meta.modified_class, "__ray_actor_class__", meta.modified_class)
    # The decorator's options (max_concurrency, ...) are kept only in this private
    # attribute, not in __ray_metadata__; Ray's own client reads them the same way.
    options = dict(getattr(cls, "_default_options", None) or {})
    dropped = sorted(POOL_OWNED_OPTIONS & set(options))
    if dropped:
        log.warning(
            "%s: ray.remote options %s are ignored; the resource pool places and sizes the workers",
            plain.__name__,
            dropped,
        )
    return plain, {k: v for k, v in options.items() if k not in POOL_OWNED_OPTIONS}


class ClassWithInitArgs:
    """A worker class with its constructor arguments, built later where it runs.

    `cls` may also be a `ray.remote(WorkerCls)` class (as verl users write):
    the plain class is kept in `cls` and the decorator's actor options in
    `ray_options` (see `unwrap_remote_class`).
    """

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        cls, options = unwrap_remote_class(cls)
        if not isinstance(cls, type):
            raise TypeError(f"ClassWithInitArgs needs a worker class (or a ray.remote class), got {cls!r}")
        self.cls = cls
        """The worker class."""
        self.args = args
        """Positional constructor arguments."""
        self.kwargs = kwargs
        """Keyword constructor arguments."""
        self.ray_options: dict[str, Any] = options
        """Extra Ray actor options (e.g. `{"max_concurrency": 2}`) for backends that start Ray actors;
        the local backend ignores them. Resources and placement are set by the worker group."""

    def __call__(self) -> Any:
        """Instantiate the class here, in this process."""
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cls.__name__})"
