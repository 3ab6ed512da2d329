"""Backend-agnostic resource pools and delayed construction of worker classes."""

from __future__ import annotations

from typing import Any


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


class ClassWithInitArgs:
    """A worker class with its constructor arguments, built later where it runs."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        if not isinstance(cls, type):
            raise TypeError(
                f"ClassWithInitArgs needs a plain class, got {cls!r}; if it is decorated with "
                "@ray.remote, drop the decorator (the worker group makes it remote)"
            )
        self.cls = cls
        """The worker class."""
        self.args = args
        """Positional constructor arguments."""
        self.kwargs = kwargs
        """Keyword constructor arguments."""

    def __call__(self) -> Any:
        """Instantiate the class here, in this process."""
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cls.__name__})"
