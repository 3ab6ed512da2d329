"""Hook points: named places in the code where a test may run its own code; no-ops unless a test fills them.

This is the one seam for fault injection. Production code declares a point once, at module level, and calls it
where the event happens, with keyword arguments only:

    LOADED = HookPoint("weight_sync.loaded", "after a sync's load, before its check: (rollout, step, path)")
    ...
    LOADED(rollout=rollout, step=step, path=path)

A call returns what the installed hook returns, or None when none is installed (one dictionary lookup), so a point
that asks a question reads None as "no": `if not SKIP_LOAD(...): load()`. Tests fill points with `install`
(or the `installed` context manager) by the point's name; what to break, when and how lives in tests/faults/.

Why this design, and not the alternatives:
- Production code reads no environment variable to break itself and holds no fault code: a point says only
  where something happens; the fault is the test's hook.
- Hooks must reach the worker processes (Ray actors, the workers a recovery restarts, the local backend's
  in-process worker). The plugin mechanism already reaches every one of them: each worker imports the run's
  `trainer.plugins` before any of its methods runs, and the controller imports them when it loads the config. So
  a test hands the run a small plugin that installs its hooks (tests/faults `plugin_file`), and nothing new travels
  to the workers. Patching from the test (monkeypatch) would reach only the test's own process.
- The table is per process and keyed by name, so a test can fill a point of a module it does not import (the vllm
  rollout's), and `POINTS` lists every point declared so far with its contract.

This module imports nothing from hybridflow, so every layer may declare points.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

POINTS: dict[str, HookPoint] = {}
"""Every point declared in this process, by name."""
_HOOKS: dict[str, Callable[..., Any]] = {}
"""Point name -> the hook installed there."""


class HookPoint:
    """One named place where a test may run code; call it with the event's context as keyword arguments."""

    __slots__ = ("name", "doc")

    def __init__(self, name: str, doc: str) -> None:
        """`doc`: when the point is called, with which arguments, and what its hook's answer means."""
        if name in POINTS:
            raise ValueError(f"hook point {name!r} is declared twice; give the new one another name")
        self.name, self.doc = name, doc
        POINTS[name] = self

    def __call__(self, **context: Any) -> Any:
        """The installed hook's answer for this event, or None when no hook is installed."""
        hook = _HOOKS.get(self.name)
        return None if hook is None else hook(**context)

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r})"


def _name(point: HookPoint | str) -> str:
    return point.name if isinstance(point, HookPoint) else point


def install(point: HookPoint | str, hook: Callable[..., Any]) -> None:
    """Fill `point` (the point or its name) with `hook`, in this process; replaces any hook already there."""
    _HOOKS[_name(point)] = hook


def uninstall(point: HookPoint | str) -> None:
    """Empty `point` in this process (nothing happens when it is empty)."""
    _HOOKS.pop(_name(point), None)


def installed_points() -> list[str]:
    """The names of the points holding a hook in this process."""
    return sorted(_HOOKS)


@contextmanager
def installed(hooks: Mapping[HookPoint | str, Callable[..., Any]]) -> Iterator[None]:
    """Fill `hooks` for the block, then restore what each point held before."""
    before = {_name(p): _HOOKS.get(_name(p)) for p in hooks}
    for point, hook in hooks.items():
        install(point, hook)
    try:
        yield
    finally:
        for name, hook in before.items():
            if hook is None:
                _HOOKS.pop(name, None)
            else:
                _HOOKS[name] = hook
