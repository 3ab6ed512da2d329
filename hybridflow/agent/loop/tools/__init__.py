"""Tools the model calls: the `Tool` interface, the `TOOLS` registry, and the built-ins.

Built-ins: `calculator` (safe arithmetic), `python` (code in the process sandbox).
"""

import hybridflow.agent.loop.tools.calculator  # noqa: F401  (registers "calculator")
import hybridflow.agent.loop.tools.python  # noqa: F401  (registers "python")
from hybridflow.agent.loop.tools.base import TOOLS, Tool, ToolResult, ToolSetupError, check_arguments, run_tool

__all__ = ["TOOLS", "Tool", "ToolResult", "ToolSetupError", "check_arguments", "run_tool"]
