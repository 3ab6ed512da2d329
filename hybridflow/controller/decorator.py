"""`@register`: how a worker method is dispatched, executed and collected.

A worker method decorated with `@register(dispatch_mode=..., execute_mode=...)`
becomes, on the controller, an attribute of its `WorkerGroup` that

1. *dispatches* the call's arguments into one argument list per rank
   (`dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)`, every
   positional and keyword value a list with one entry per rank),
2. *executes* the method on all ranks or on rank 0 only (`Execute`),
3. *collects* the per-rank outputs into one result
   (`collect_fn(worker_group, outputs: list) -> result`).

Dispatch modes live in a registry keyed by name; `Dispatch` names the built-in
ones and `register_dispatch_mode` adds yours. A mode can also be given inline
as `{"dispatch_fn": f, "collect_fn": g}` — that is how the mesh-aware modes of
`make_nd_compute_dataproto_dispatch_fn` are passed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hybridflow.controller import dispatch as _d
from hybridflow.protocol import DataProtoFuture
from hybridflow.utils.hooks import HookPoint
from hybridflow.utils.registry import Registry

DispatchFn = Callable[..., tuple[tuple, dict]]
CollectFn = Callable[[Any, list], Any]

# Attribute set on a decorated method; WorkerGroup looks for it.
REGISTER_ATTR = "_hybridflow_register"

METHOD_ENTERED = HookPoint(
    "worker.method_entered",
    "a `@register` method is entered, in the process that runs it, with its arguments materialized: "
    "(method: str, args: tuple, kwargs: dict); the answer is ignored (a test's hook may kill or hang the process)",
)


class Dispatch(str, Enum):
    """Built-in dispatch modes (a `str`, so `Dispatch.ONE_TO_ALL == "ONE_TO_ALL"`)."""

    ONE_TO_ALL = "ONE_TO_ALL"
    """Every rank gets the same arguments; collect returns the list of outputs."""
    ALL_TO_ALL = "ALL_TO_ALL"
    """Arguments are already lists with one entry per rank; outputs come back as a list."""
    RANK_ZERO = "RANK_ZERO"
    """Only rank 0 runs, with the arguments as given; its output is returned."""
    DP_COMPUTE = "DP_COMPUTE"
    """Like ALL_TO_ALL, named for data-parallel calls whose inputs the caller split."""
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"
    """DataProto arguments split over ranks (padded), outputs concatenated and unpadded."""
    DP_COMPUTE_PROTO_WITH_FUNC = "DP_COMPUTE_PROTO_WITH_FUNC"
    """First argument is a function sent to every rank; the rest as DP_COMPUTE_PROTO."""
    DP_COMPUTE_METRIC = "DP_COMPUTE_METRIC"
    """DataProto arguments split over ranks; collect returns the list of per-rank outputs."""


class Execute(str, Enum):
    """Which ranks run a registered method."""

    ALL = "ALL"
    """Every rank of the group."""
    RANK_ZERO = "RANK_ZERO"
    """Rank 0 only (dispatch must produce lists of length 1 or world size)."""


@dataclass(frozen=True)
class DispatchMode:
    """A dispatch/collect pair, as stored in the registry."""

    dispatch_fn: DispatchFn
    """Turns the controller's arguments into per-rank argument lists."""
    collect_fn: CollectFn
    """Turns the per-rank outputs into the controller's result."""
    collects_proto: bool = False
    """True when collect returns one DataProto (a non-blocking call then
    returns a DataProtoFuture; otherwise it returns the raw per-rank refs)."""


DISPATCH_MODES: Registry[DispatchMode] = Registry(
    "dispatch mode", "dispatch_mode", "add yours with register_dispatch_mode"
)
"""Dispatch modes by name (a `Dispatch` member's value for the built-in ones)."""
DISPATCH_MODES.register(Dispatch.ONE_TO_ALL.value, DispatchMode(_d.dispatch_one_to_all, _d.collect_all_to_all))
DISPATCH_MODES.register(Dispatch.ALL_TO_ALL.value, DispatchMode(_d.dispatch_all_to_all, _d.collect_all_to_all))
DISPATCH_MODES.register(Dispatch.RANK_ZERO.value, DispatchMode(_d.dispatch_rank_zero, _d.collect_rank_zero))
DISPATCH_MODES.register(Dispatch.DP_COMPUTE.value, DispatchMode(_d.dispatch_dp_compute, _d.collect_all_to_all))
DISPATCH_MODES.register(
    Dispatch.DP_COMPUTE_PROTO.value,
    DispatchMode(_d.dispatch_dp_compute_data_proto, _d.collect_dp_compute_data_proto, True),
)
DISPATCH_MODES.register(
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC.value,
    DispatchMode(_d.dispatch_dp_compute_data_proto_with_func, _d.collect_dp_compute_data_proto, True),
)
DISPATCH_MODES.register(
    Dispatch.DP_COMPUTE_METRIC.value, DispatchMode(_d.dispatch_dp_compute_data_proto, _d.collect_all_to_all)
)


def register_dispatch_mode(
    name: str,
    dispatch_fn: DispatchFn,
    collect_fn: CollectFn,
    collects_proto: bool = False,
) -> str:
    """Add a dispatch mode under `name`; use `@register(dispatch_mode=name)` afterwards.

    `dispatch_fn(worker_group, *args, **kwargs)` must return `(args, kwargs)`
    whose values are lists with one entry per rank; `collect_fn(worker_group,
    outputs)` gets the per-rank outputs in rank order. `collects_proto`:
    see `DispatchMode`. Returns `name`. A taken name is refused (replace a
    mode with `update_dispatch_mode`).
    """
    key = name.value if isinstance(name, Enum) else name
    DISPATCH_MODES.register(key, DispatchMode(dispatch_fn, collect_fn, collects_proto))
    return key


def update_dispatch_mode(
    name: str,
    dispatch_fn: DispatchFn,
    collect_fn: CollectFn,
    collects_proto: bool = False,
) -> None:
    """Replace the functions of an already registered dispatch mode."""
    key = name.value if isinstance(name, Enum) else name
    DISPATCH_MODES.get(key)
    DISPATCH_MODES.register(key, DispatchMode(dispatch_fn, collect_fn, collects_proto), override=True)


def get_dispatch_mode(mode: str | Dispatch | dict | DispatchMode) -> DispatchMode:
    """Resolve a mode name, a `{"dispatch_fn", "collect_fn"}` dict or a DispatchMode."""
    if isinstance(mode, DispatchMode):
        return mode
    if isinstance(mode, dict):
        missing = {"dispatch_fn", "collect_fn"} - set(mode)
        if missing:
            raise ValueError(f"an inline dispatch mode needs keys {sorted(missing)}")
        extra = set(mode) - {"dispatch_fn", "collect_fn", "collects_proto"}
        if extra:
            raise ValueError(f"an inline dispatch mode has unknown keys {sorted(extra)}")
        return DispatchMode(**mode)
    return DISPATCH_MODES.get(mode.value if isinstance(mode, Enum) else mode)


@dataclass(frozen=True)
class MethodSpec:
    """The metadata `@register` attaches to a worker method."""

    dispatch_mode: Any
    """A Dispatch member, a registered name, or an inline dispatch/collect dict."""
    execute_mode: Execute
    """Which ranks run the method."""
    blocking: bool
    """False: the WorkerGroup call returns futures instead of waiting."""
    materialize_futures: bool
    """Resolve DataProtoFuture / ObjectRef arguments on the worker before the call."""


def register(
    dispatch_mode: Any = Dispatch.ALL_TO_ALL,
    execute_mode: Execute | None = None,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[Callable], Callable]:
    """Mark a worker method as callable from a WorkerGroup (see module docstring).

    `execute_mode` defaults to Execute.RANK_ZERO for Dispatch.RANK_ZERO and to
    Execute.ALL otherwise. An `async def` method stays a coroutine function: the
    worker awaits it (on Ray the worker becomes an async actor, see Ray's
    `max_concurrency` for async actors) and its result is collected as usual.
    """
    get_dispatch_mode(dispatch_mode)  # fail at class definition on an unknown mode
    if execute_mode is None:
        execute_mode = Execute.RANK_ZERO if dispatch_mode == Dispatch.RANK_ZERO else Execute.ALL
    execute_mode = Execute(execute_mode)
    spec = MethodSpec(dispatch_mode, execute_mode, blocking, materialize_futures)

    def decorator(func: Callable) -> Callable:
        def prepare(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if materialize_futures:
                args, kwargs = materialize(args, kwargs)
            METHOD_ENTERED(method=func.__name__, args=args, kwargs=kwargs)
            return args, kwargs

        if inspect.iscoroutinefunction(func):
            # Stays a coroutine function: Ray then runs the actor as an async actor and awaits it;
            # the local backend runs it to completion (local.py).
            @functools.wraps(func)
            async def inner(self, *args, **kwargs):
                args, kwargs = prepare(args, kwargs)
                return await func(self, *args, **kwargs)
        else:

            @functools.wraps(func)
            def inner(self, *args, **kwargs):
                args, kwargs = prepare(args, kwargs)
                return func(self, *args, **kwargs)

        setattr(inner, REGISTER_ATTR, spec)
        return inner

    return decorator


def get_method_spec(method: Any) -> MethodSpec | None:
    """The `@register` metadata of a method, or None when it has none."""
    return getattr(method, REGISTER_ATTR, None)


def materialize(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Resolve DataProtoFuture arguments (worker side, before the method runs)."""

    if not any(isinstance(a, DataProtoFuture) for a in (*args, *kwargs.values())):
        return args, kwargs
    args = tuple(a.get() if isinstance(a, DataProtoFuture) else a for a in args)
    kwargs = {k: v.get() if isinstance(v, DataProtoFuture) else v for k, v in kwargs.items()}
    return args, kwargs
