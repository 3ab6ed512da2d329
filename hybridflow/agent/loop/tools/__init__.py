"""Tools the model calls: the `Tool` interface, the `TOOLS` registry, and the built-ins.

Built-ins: `calculator` (safe arithmetic), `python` (code in the process sandbox).
"""

from hybridflow.agent.loop.tools.base import TOOLS, Tool, ToolResult, ToolSetupError, check_arguments, run_tool

__all__ = ["TOOLS", "Tool", "ToolResult", "ToolSetupError", "check_arguments", "run_tool"]
