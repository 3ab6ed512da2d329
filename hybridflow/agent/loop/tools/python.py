"""The `python` tool: runs model-written code in the process sandbox (`sandbox.py`).

`PythonTool(config, **limits)`: the sandbox's limits are `config` (rollout.multi_turn.sandbox) with any
`SandboxConfig` field given by name overriding it, so a tool config file's `python: {timeout_s: 5}` works;
an unknown name fails naming the known ones.

The observation is the code's stdout, then its stderr, then a status line when the run did
not end cleanly (exit code, killed at the time limit, output truncated). A machine where the
sandbox cannot isolate raises `SandboxUnavailableError` at the first call instead of running
code unsandboxed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridflow.agent.loop.tools.base import TOOLS, Tool, ToolResult
from hybridflow.agent.loop.tools.sandbox import SandboxConfig, SandboxResult, run_python


def describe(result: SandboxResult, config: SandboxConfig) -> str:
    """The observation text of one sandboxed run (module docstring)."""
    parts = [p for p in (result.stdout, result.stderr) if p]
    if result.timed_out:
        parts.append(f"[killed: wall-clock limit of {config.timeout_s:g} s]")
    elif result.exit_code != 0:
        parts.append(f"[exit code {result.exit_code}]")
    if result.truncated:
        parts.append(f"[output truncated to {config.max_output_chars} characters per stream]")
    return "\n".join(parts) if parts else "[no output]"


@TOOLS.register("python")
class PythonTool(Tool):
    """Runs a Python program in the sandbox and returns what it printed."""

    schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python 3 program (no network, no files outside its directory); returns its output.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program; print the results"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: SandboxConfig | None = None, **limits: Any) -> None:
        known = [f.name for f in dataclasses.fields(SandboxConfig)]
        unknown = sorted(set(limits) - set(known))
        if unknown:
            raise ValueError(f"python tool: unknown sandbox setting(s) {unknown}; known: {known}")
        self.config = dataclasses.replace(config or SandboxConfig(), **limits)

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run `arguments["code"]`; ok only for a clean zero exit within the limits."""
        result = run_python(arguments["code"], self.config)
        return ToolResult(describe(result, self.config), ok=result.ok)
