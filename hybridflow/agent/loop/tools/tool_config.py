"""Tools configured from the run's config (rollout.multi_turn): constructor arguments per tool, and the allowlist.

- `load_tool_config(path)`: the optional `tool_config_path` file, tool name -> constructor kwargs (YAML/JSON).
- `tool_kwargs(file_kwargs, sandbox)`: what each tool is built with: the python tool gets the
  `rollout.multi_turn.sandbox` section as its `config`, with the file's `python:` entries overriding fields.
- `check_tools(allowed, file_kwargs, sandbox)`: run at config load, so a bad name or argument fails there,
  naming the key, and not in a worker at the first row: every allowed and configured name is a registered
  tool, and every configured tool builds with its arguments.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hybridflow.agent.loop.tools.base import TOOLS
from hybridflow.agent.loop.tools.sandbox import SandboxConfig
from hybridflow.utils.registry import UnknownNameError


def load_tool_config(path: str | None) -> dict[str, dict[str, Any]]:
    """Tool name -> constructor kwargs from a YAML or JSON file (None: {})."""
    if path is None:
        return {}
    text = Path(path).read_text()
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"rollout.multi_turn.tool_config_path={path!r}: expected a mapping tool name -> kwargs")
    return data


def tool_kwargs(file_kwargs: dict[str, dict[str, Any]], sandbox: SandboxConfig) -> dict[str, dict[str, Any]]:
    """Constructor kwargs per tool name (module docstring)."""
    merged = {name: dict(kwargs) for name, kwargs in file_kwargs.items()}
    merged.setdefault("python", {}).setdefault("config", sandbox)
    return merged


def check_tools(allowed: Sequence[str], file_kwargs: dict[str, dict[str, Any]], sandbox: SandboxConfig) -> None:
    """Raise ValueError naming the key when a tool name or a tool's arguments are wrong (module docstring)."""
    for name in allowed:
        try:
            TOOLS.get(name)
        except UnknownNameError as exc:
            raise ValueError(f"rollout.multi_turn.allowed_tools: {exc}") from None
    for name, kwargs in tool_kwargs(file_kwargs, sandbox).items():
        if name not in file_kwargs and name not in allowed:
            continue
        try:
            TOOLS.get(name)(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"rollout.multi_turn.tool_config_path: tool {name!r} cannot be built with {sorted(kwargs)}: {exc}"
            ) from None
