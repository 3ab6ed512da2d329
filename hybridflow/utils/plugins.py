"""User code by path: plugin modules (`trainer.plugins`) and `module:function` registry names.

A plugin is an importable module name ("my_pkg.losses") or a `.py` file path ("plugins/loss.py"); importing it
runs its `register(...)` calls. A registry name holding a colon ("my_pkg.losses:my_loss",
"/abs/loss.py:my_loss") names one object directly; `Registry.get` loads it on first lookup, in any process.

A file is imported under a name derived from its absolute path, once per process, so the same file reached
twice (plugin list and `file.py:fn` name) is one module, and its objects pickle by reference into workers
that imported it too. This module imports nothing from hybridflow, so every layer may use it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any


class PluginError(ImportError, ValueError):
    """A plugin or `module:function` path that cannot be loaded; the message is one line naming key and fix.

    A ValueError too, so config checks report it like any other bad value.
    """


def is_path(name: str) -> bool:
    """True when a registry name is a `module:function` / `file.py:function` path rather than a plain name."""
    return ":" in name


def resolve_spec(spec: str) -> str:
    """`spec` with a relative `.py` file path made absolute (against the working directory); modules unchanged."""
    return str(Path(spec).expanduser().resolve()) if spec.endswith(".py") else spec


def import_module(spec: str, key: str) -> ModuleType:
    """Import the module name or `.py` file `spec` (once per process); `key` names the config key in errors."""
    if spec.endswith(".py"):
        return _import_file(Path(spec).expanduser().resolve(), spec, key)
    try:
        return importlib.import_module(spec)
    except ImportError as err:
        raise PluginError(
            f"{key}: cannot import module {spec!r} ({_first_line(err)}); give an importable module name "
            "(on PYTHONPATH) or a path to a .py file"
        ) from None


def import_plugins(specs: Sequence[str], key: str = "trainer.plugins") -> list[str]:
    """Import every plugin in `specs` (module names or `.py` paths) in order and return the specs with file
    paths made absolute, so the list can travel to worker processes with another working directory."""
    for spec in specs:
        import_module(str(spec), key)
    return [resolve_spec(str(spec)) for spec in specs]


def load_object(path: str, key: str) -> Any:
    """The object named by `module:attr` or `file.py:attr` (split at the last colon), imported on demand."""
    module_spec, _, attr = path.rpartition(":")
    if not module_spec or not attr:
        raise PluginError(f"{key}={path!r} is not of the form module:function or path/to/file.py:function")
    module = import_module(module_spec, f"{key}={path!r}")
    if not hasattr(module, attr):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise PluginError(f"{key}={path!r}: {module_spec!r} has no attribute {attr!r}; callables there: {found}")
    return getattr(module, attr)


def _import_file(file: Path, spec: str, key: str) -> ModuleType:
    name = f"hybridflow_plugin_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    if not file.is_file():
        raise PluginError(f"{key}: plugin file {spec!r} does not exist ({file}); fix the path")
    module_spec = importlib.util.spec_from_file_location(name, file)
    assert module_spec is not None and module_spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise PluginError(f"{key}: importing plugin file {spec!r} failed: {type(err).__name__}: {err}") from err
    return module


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
