"""Load a user's reward function from a Python file named in the config.

The function must accept `(data_source, solution_str, ground_truth,
extra_info=None)` and return a float, like `default_compute_score`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from hybridflow.utils.config_loader import ConfigError


def load_custom_reward_fn(path: str, name: str = "compute_score") -> Callable[..., float]:
    """Import the file at `path` and return its function `name`.

    The module is registered in `sys.modules` under a name derived from the
    path, so the function pickles by reference into forked worker processes.
    A missing file raises FileNotFoundError; a file that is no module, or a name
    that is missing or not callable there, raises ConfigError.
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(
            f"custom reward function file {path!r} does not exist; fix reward.custom_reward_function.path"
        )
    module_name = "hybridflow_custom_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {path!r} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(
            f"{path!r} has no function {name!r}; functions defined there: {found}. "
            "Fix reward.custom_reward_function.name"
        )
    if not callable(fn):
        raise ConfigError(f"{name!r} in {path!r} is a {type(fn).__name__}, not a function")
    return fn
