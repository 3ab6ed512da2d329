"""`WorkerGroup`: the controller's handle on the processes of one worker class.

Every `@register` method of the worker class becomes an attribute of the
group that dispatches the arguments, executes the method on the ranks and
collects the outputs (see `decorator.py`). Backends (Ray, in-process)
subclass it and supply how to execute, wait and make futures.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.controller.decorator import (
    DispatchMode,
    Execute,
    MethodSpec,
    get_dispatch_mode,
    get_method_spec,
)
from hybridflow.controller.dispatch import PAD_SIZE_KEY
from hybridflow.protocol import DataProto, unpad_dataproto


class WorkerError(RuntimeError):
    """A worker process died or could not be reached during a call.

    `group`, `ranks` (those that died or are stuck) and `method` say where, when the backend knows.
    """

    def __init__(
        self, message: str, group: str | None = None, ranks: tuple[int, ...] = (), method: str | None = None
    ) -> None:
        super().__init__(message)
        self.group, self.ranks, self.method = group, tuple(ranks), method

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.group, self.ranks, self.method)


class WorkerTimeoutError(WorkerError):
    """Some ranks of a call did not return within the group's call timeout (the backend kills them)."""


@dataclass(frozen=True)
class Timeouts:
    """How long a worker group waits, so that a stuck rank becomes an error instead of a hang."""

    call_s: float | None = 3600.0
    """Longest wait for the ranks of one call, counted from when it is issued (so it includes time
    queued behind earlier non-blocking calls on the same workers); None waits forever."""
    collective_s: float = 300.0
    """The workers' torch.distributed timeout: a rank waiting longer in a collective for a peer raises
    (gloo) or is aborted (NCCL). Keep it below call_s, so that error reaches the controller first."""
    call_setting: str = "Timeouts.call_s"
    """Where call_s comes from, named in the timeout error (a trainer passes its config key)."""

    def __post_init__(self) -> None:
        for key, value in (("call_s", self.call_s), ("collective_s", self.collective_s)):
            if value is not None and value <= 0:
                raise ValueError(f"Timeouts.{key} must be > 0, got {value}")


@dataclass
class GroupInfo:
    """A picklable snapshot of what collect functions may ask of a group."""

    name: str
    """The group's name (for messages)."""
    world_size: int
    """Number of ranks."""
    dispatch_info: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)
    """Per mesh name, each rank's (dp_rank, is_collect), as the workers declared."""

    def get_dispatch_info(self, mesh_name: str) -> list[tuple[int, bool]]:
        """Each rank's (dp_rank, is_collect) in `mesh_name`."""
        if mesh_name not in self.dispatch_info:
            raise KeyError(f"group {self.name}: no dispatch info for mesh {mesh_name!r}")
        return self.dispatch_info[mesh_name]


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Name → `@register` metadata of every registered method of `cls`."""
    specs = {}
    for name in dir(cls):
        spec = get_method_spec(getattr(cls, name, None))
        if spec is not None:
            specs[name] = spec
    return specs


def _collect(collect_fn: Callable, group: Any, pad_size: int, outputs: list) -> Any:
    result = collect_fn(group, outputs)
    if pad_size:
        if isinstance(result, DataProto):
            result = unpad_dataproto(result, pad_size)
    return result


def _rank_args(values: list, position: int, rank: int, n_exec: int, world_size: int, name: str) -> Any:
    if not isinstance(values, (list, tuple)) or len(values) not in (n_exec, world_size):
        raise ValueError(
            f"dispatch of {name} must give each argument as a list of {world_size} per-rank values "
            f"(or {n_exec} for the executed ranks), got {type(values).__name__}"
            + (f" of length {len(values)}" if hasattr(values, "__len__") else "")
        )
    return values[position] if len(values) == n_exec else values[rank]


class WorkerGroup:
    """Base class: binds the worker class's registered methods as group calls."""

    def __init__(self, name: str, world_size: int) -> None:
        self._name = name
        self._world_size = world_size
        self._dispatch_info: dict[str, list[tuple[int, bool]]] = {}
        self._bound: list[str] = []
        self._specs: dict[str, tuple[str, MethodSpec]] = {}
        self._worker_cls: type | None = None

    @property
    def name(self) -> str:
        """The group's name, used in process names and error messages."""
        return self._name

    @property
    def world_size(self) -> int:
        """Number of ranks (worker processes) in the group."""
        return self._world_size

    # --- backend hooks ----------------------------------------------------
    def _execute(self, method_name: str, ranks: list[int], per_rank: list[tuple[tuple, dict]]) -> list:
        """Start `method_name` on `ranks`; return per-rank outputs or handles to them."""
        raise NotImplementedError

    def _wait(self, method_name: str, ranks: list[int], outputs: list) -> list:
        """Turn `_execute`'s handles into values, raising WorkerError on a dead worker (WorkerTimeoutError
        on ranks still running past the backend's call timeout)."""
        raise NotImplementedError

    def _make_future(
        self, method_name: str, ranks: list[int], outputs: list, collect: Callable, collects_proto: bool
    ) -> Any:
        """What a non-blocking call returns."""
        raise NotImplementedError

    def _prepare_args(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Backend hook to rewrite arguments before dispatch."""
        return args, kwargs

    # --- binding ----------------------------------------------------------
    def _bind_worker_methods(self, cls: type, prefix: str = "") -> None:
        """Expose `cls`'s registered methods (those starting with `prefix`, prefix removed)."""
        self._worker_cls = cls
        for full_name, spec in registered_methods(cls).items():
            if not full_name.startswith(prefix):
                continue
            short = full_name[len(prefix) :]
            if hasattr(type(self), short):
                raise ValueError(
                    f"worker method {cls.__name__}.{full_name} shadows WorkerGroup.{short}; rename the method"
                )
            setattr(self, short, self._make_caller(full_name, spec))
            self._bound.append(short)
            self._specs[short] = (full_name, spec)

    def call_nonblocking(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Issue the registered `method` without waiting for it, whatever its `blocking` says; returns what a
        non-blocking call returns (a future of the DataProto for DataProto-collecting modes)."""
        if method not in self._specs:
            raise AttributeError(
                f"group {self._name} has no registered method {method!r}; it has {sorted(self._specs)}"
            )
        full_name, spec = self._specs[method]
        mode = get_dispatch_mode(spec.dispatch_mode)
        return self._call(full_name, dataclasses.replace(spec, blocking=False), mode, args, kwargs)

    def _make_caller(self, method_name: str, spec: MethodSpec) -> Callable:
        mode = get_dispatch_mode(spec.dispatch_mode)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(method_name, spec, mode, args, kwargs)

        call.__name__ = method_name
        call.__doc__ = getattr(getattr(self._worker_cls, method_name), "__doc__", None)
        return call

    # --- the call path ----------------------------------------------------
    def _call(self, method_name: str, spec: MethodSpec, mode: DispatchMode, args: tuple, kwargs: dict) -> Any:
        args, kwargs = self._prepare_args(args, kwargs)
        d_args, d_kwargs = mode.dispatch_fn(self, *args, **kwargs)
        pad = d_kwargs.pop(PAD_SIZE_KEY, 0)
        ranks = list(range(self._world_size)) if spec.execute_mode == Execute.ALL else [0]
        per_rank = self._per_rank(method_name, d_args, d_kwargs, ranks)
        outputs = self._execute(method_name, ranks, per_rank)
        if spec.blocking:
            return _collect(mode.collect_fn, self, pad, self._wait(method_name, ranks, outputs))
        collect = functools.partial(_collect, mode.collect_fn, self._snapshot(), pad)
        return self._make_future(method_name, ranks, outputs, collect, mode.collects_proto)

    def _per_rank(self, name: str, d_args: tuple, d_kwargs: dict, ranks: list[int]) -> list[tuple[tuple, dict]]:
        n, ws = len(ranks), self._world_size
        return [
            (
                tuple(_rank_args(a, i, r, n, ws, name) for a in d_args),
                {k: _rank_args(v, i, r, n, ws, name) for k, v in d_kwargs.items()},
            )
            for i, r in enumerate(ranks)
        ]

    def _snapshot(self) -> GroupInfo:
        return GroupInfo(self._name, self._world_size, dict(self._dispatch_info))

    def get_dispatch_info(self, mesh_name: str) -> list[tuple[int, bool]]:
        """Each rank's (dp_rank, is_collect) in the named mesh, asked of the workers once."""
        if mesh_name not in self._dispatch_info:
            info = [tuple(x) for x in self._query_dispatch_info(mesh_name)]
            self._dispatch_info[mesh_name] = info
        return self._dispatch_info[mesh_name]

    # --- colocation -------------------------------------------------------
    def spawn(self, prefix_set: Iterable[str]) -> dict[str, WorkerGroup]:
        """One group per role of a colocated worker class, sharing these processes.

        Each returned group exposes the role's methods under their own names
        (`actor_generate` of the fused class becomes `generate` of group "actor").
        """
        if self._worker_cls is None:
            raise RuntimeError("spawn needs a worker group whose methods are bound")
        groups = {}
        for prefix in prefix_set:
            view = self._view(f"{self._name}_{prefix}")
            view._bind_worker_methods(self._worker_cls, prefix=f"{prefix}_")
            if not view._bound:
                raise ValueError(f"no registered methods with prefix {prefix!r}_ on {self._worker_cls.__name__}")
            groups[prefix] = view
        return groups

    def fuse(self, prefix_set: Iterable[str]) -> None:
        """verl's: `spawn(prefix_set)` and set each role's group as an attribute (`group.actor`)."""
        for prefix, group in self.spawn(prefix_set).items():
            if hasattr(self, prefix):
                raise ValueError(f"fuse: role {prefix!r} would shadow the attribute {type(self).__name__}.{prefix}")
            setattr(self, prefix, group)

    def _view(self, name: str) -> WorkerGroup:
        view = object.__new__(type(self))
        view.__dict__.update({k: v for k, v in self.__dict__.items() if k not in self._bound})
        view._name = name
        view._dispatch_info = {}
        view._bound = []
        view._specs = {}
        return view
