"""The `Tool` interface and the `TOOLS` registry of tool classes by name.

A tool is a class with a class attribute `schema` (an OpenAI function schema:
`{"type": "function", "function": {"name", "description", "parameters"}}`) and a method
`call(arguments) -> ToolResult`. `call` must not raise for bad arguments or failed work: it
returns `ToolResult(text, ok=False)` whose text the model reads as the observation;
`run_tool` additionally turns an unexpected exception into such a result, so a broken tool
costs its call and never the rollout. The one exception that propagates is `ToolSetupError`:
the tool cannot work on this machine at all (e.g. the sandbox cannot isolate), which must stop
the run rather than feed the model error observations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hybridflow.utils.registry import Registry

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class ToolSetupError(RuntimeError):
    """The tool cannot work on this machine (not a bad call); `run_tool` lets it propagate."""


@dataclass
class ToolResult:
    """What one call returns: the observation text and whether the call succeeded."""

    text: str
    ok: bool = True


class Tool:
    """Base class of tools; subclasses set `schema` and implement `call`."""

    schema: ClassVar[dict[str, Any]]

    @property
    def name(self) -> str:
        """The function name of the schema (what a tool call names)."""
        return self.schema["function"]["name"]

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run the tool on validated `arguments`; failures are `ok=False` results, not exceptions."""
        raise NotImplementedError


TOOLS: Registry[type[Tool]] = Registry(
    "tool", "tool name", "register one with @hybridflow.agent.loop.tools.TOOLS.register(name)"
)
"""Tool classes by name; a row's tool list names entries here (the package registers the built-ins)."""


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """None when `arguments` has every required key with the declared JSON type, else the problem."""
    params = schema["function"].get("parameters", {})
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"missing argument(s) {missing}; expected {sorted(props)}"
    unknown = [k for k in arguments if k not in props]
    if unknown:
        return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        allowed = _JSON_TYPES.get(props[key].get("type", ""), (object,))
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            return f"argument {key!r} must be of type {props[key].get('type')}, got {type(value).__name__}"
    return None


def run_tool(tool: Tool, arguments: dict[str, Any]) -> ToolResult:
    """Validate `arguments` against the tool's schema, then call it; every failure is a result."""
    problem = check_arguments(tool.schema, arguments)
    if problem:
        return ToolResult(f"error: {tool.name}: {problem}", ok=False)
    try:
        return tool.call(arguments)
    except ToolSetupError:
        raise
    except Exception as exc:  # a tool bug costs this call only
        return ToolResult(f"error: {tool.name} failed: {type(exc).__name__}: {exc}", ok=False)
