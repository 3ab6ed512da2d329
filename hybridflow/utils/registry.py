"""Named registries: every "pick it by name in the config" choice goes through one small `Registry`.

    ESTIMATORS: Registry[EstimatorFn] = Registry("advantage estimator", "algorithm.adv_estimator")

    @ESTIMATORS.register("grpo")          # as a decorator
    def grpo(...): ...

    ESTIMATORS.register("alias", grpo)    # or as a plain call
    ESTIMATORS.get("grpo")                # unknown names fail naming the key and the known names
    ESTIMATORS.get("my_pkg.adv:my_est")   # a `module:attr` (or `file.py:attr`) path is imported on first lookup

This module imports nothing from hybridflow but utils.plugins, so any layer (algos, controller) may use it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

from hybridflow.utils.plugins import is_path, load_object

T = TypeVar("T")
_NO_ENTRY: Any = object()


class UnknownNameError(KeyError, ValueError):
    """A name that is not registered.

    Both a KeyError and a ValueError: registries used to raise one or the
    other, and callers' `except` clauses keep working with either.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # KeyError would quote the whole message


class Registry(Generic[T]):
    """Entries of one kind (functions, classes, specs) by name, selected by one config key."""

    def __init__(
        self,
        kind: str,
        key: str,
        hint: str = "",
        load: Callable[[], None] | None = None,
        wrap: Callable[[Any], T] | None = None,
    ) -> None:
        self.kind = kind
        """What an entry is, for messages ("advantage estimator")."""
        self.key = key
        """The config key (or argument) whose value is looked up here ("algorithm.adv_estimator")."""
        self.hint = hint
        """How to add an entry, appended to the unknown-name message."""
        self._load = load
        self._lock = threading.RLock()
        self._loaded = load is None
        self._wrap = wrap
        self._entries: dict[str, T] = {}

    @overload
    def register(self, name: str, *, override: bool = False) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, entry: T, *, override: bool = False) -> T: ...

    def register(self, name: str, entry: T = _NO_ENTRY, *, override: bool = False) -> Any:
        """Add `entry` under `name` and return it; without `entry`, return a decorator that does so.

        A name already taken by another entry is refused unless `override`
        (registering the very same object again is a no-op).
        """
        if entry is _NO_ENTRY:
            return lambda e: self.register(name, e, override=override)
        current = self._entries.get(name, _NO_ENTRY)
        if current is not _NO_ENTRY and current is not entry and not override:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass override=True to replace it")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> T:
        """Remove `name` and return its entry (unknown names raise like `get`)."""
        self.get(name)
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        """The entry registered under `name`; an unknown name raises `UnknownNameError`.

        A name with a colon is a `module:attr` or `path/to/file.py:attr` path: on its first lookup in this
        process the module is imported and the attribute (passed through `wrap`, e.g. a function made into a
        spec) is registered under that name. An unloadable path raises `PluginError` naming the key.
        """
        self._ensure_loaded()
        if name not in self._entries and is_path(name):
            obj = load_object(name, self.key)
            self._entries[name] = self._wrap(obj) if self._wrap is not None else obj
        if name not in self._entries:
            hint = f" ({self.hint})" if self.hint else ""
            raise UnknownNameError(
                f"{self.key}={name!r} is not a registered {self.kind}; known: {', '.join(self.names())}{hint}"
            )
        return self._entries[name]

    def names(self) -> list[str]:
        """Sorted registered names."""
        self._ensure_loaded()
        return sorted(self._entries)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._ensure_loaded()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, key={self.key!r}, names={self.names()})"

    def _ensure_loaded(self) -> None:
        # Built-ins that live in modules importing this registry register on first lookup. The RLock makes a
        # lookup from another thread wait for that import (agent harness threads look tools up concurrently);
        # a lookup from inside load() in the same thread re-enters and finds _load already None.
        if self._loaded:
            return
        with self._lock:
            if self._load is None:
                return
            load, self._load = self._load, None
            try:
                load()
            except BaseException:
                self._load = load
                raise
            self._loaded = True
