"""Tool arithmetic: products of multi-digit numbers, to be solved with the calculator tool.

`tool_arithmetic` rows are arithmetic rows (verl's format, see `tasks.py`) plus the tools the
model may call, in `extra_info.tools`: a JSON list of `hybridflow.agent.loop.tools.TOOLS` names,
here `["calculator"]` (a JSON string because every extra_info value is stored as one). The
question asks for `a * b` with `min_digits`..`max_digits`-digit operands (default 3 x 3:
products SmolLM2-135M-Instruct cannot do in its head); the answer is scored like arithmetic
(the last number, or the number after `####`), under data_source `tool_arithmetic`.

`tool_sum_products` rows ask for a sum of products (`a * b + c * d`; `terms` products) the same way: one
calculator call on the whole expression solves one, as do calls composed (each product, then the sum), while
a call on one product answered with its result (what a warm-up on `tool_arithmetic` alone teaches) scores 0.

`transcript(row)` is the ideal multi-turn episode for an SFT warm-up: the tool system prompt,
the question, an assistant turn calling the calculator, the tool's result, and the answer.
The system prompt is written out (`tools_system_prompt`), so templates that
ignore `tools=` (SmolLM2's) see the same prompt in SFT as the agent loop renders in RL.

Departure from verl: verl rows name their agent loop (`agent_name: tool_agent`) and carry
per-row tool arguments (`extra_info.tools_kwargs`); here the row lists tool names only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridflow.agent.loop.tool_calls import format_tool_call, tools_system_prompt
from hybridflow.agent.loop.tools import TOOLS, run_tool
from hybridflow.data.arithmetic import INSTRUCTION
from hybridflow.data.tasks import Problem, register_task

TOOL_NAMES = ["calculator"]
"""The tools every row offers."""


@dataclass
class ToolArithmeticDifficulty:
    """Difficulty knobs of the tool arithmetic task."""

    min_digits: int = 3
    """Fewest decimal digits of each factor."""
    max_digits: int = 3
    """Most decimal digits of each factor."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 12:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 12, got {self.min_digits}, {self.max_digits}")


def _factor(rng: np.random.Generator, level: ToolArithmeticDifficulty) -> int:
    digits = int(rng.integers(level.min_digits, level.max_digits + 1))
    return int(rng.integers(10 ** (digits - 1), 10**digits))


@register_task("tool_arithmetic", ToolArithmeticDifficulty)
def make_tool_arithmetic(rng: np.random.Generator, level: ToolArithmeticDifficulty) -> Problem:
    """One product question; the ground truth is the product as a string; the row offers the calculator."""
    a, b = _factor(rng, level), _factor(rng, level)
    expression = f"{a} * {b}"
    return Problem(f"What is {expression}? {INSTRUCTION}", str(a * b), {"expression": expression, "tools": TOOL_NAMES})


def transcript(row: dict[str, Any]) -> list[dict[str, str]]:
    """The ideal episode of a tool_arithmetic row as chat messages (module docstring)."""

    extra = row["extra_info"]
    names = json.loads(extra["tools"]) if isinstance(extra["tools"], str) else list(extra["tools"])
    calculator = TOOLS.get("calculator")()
    arguments = {"expression": extra["expression"]}
    result = run_tool(calculator, arguments).text
    return [
        {"role": "system", "content": tools_system_prompt([TOOLS.get(n).schema for n in names])},
        {"role": "user", "content": row["prompt"][-1]["content"]},
        {"role": "assistant", "content": format_tool_call("calculator", arguments)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


@dataclass
class ToolSumProductsDifficulty(ToolArithmeticDifficulty):
    """Difficulty knobs of the sum-of-products task: the factors' digits, and how many products are summed."""

    terms: int = 2
    """Products in the sum (2: `a * b + c * d`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.terms <= 6:
            raise ValueError(f"need 2 <= terms <= 6, got {self.terms}")


@register_task("tool_sum_products", ToolSumProductsDifficulty)
def make_tool_sum_products(rng: np.random.Generator, level: ToolSumProductsDifficulty) -> Problem:
    """One sum-of-products question (`a * b + c * d`); the ground truth is its value; the row offers the calculator.

    A product's transcript (`transcript`) teaches one call on one product; this task needs the whole
    expression in the call, or calls composed, so a warm-up on products alone leaves it part-learned.
    """
    pairs = [(_factor(rng, level), _factor(rng, level)) for _ in range(level.terms)]
    expression = " + ".join(f"{a} * {b}" for a, b in pairs)
    value = sum(a * b for a, b in pairs)
    return Problem(f"What is {expression}? {INSTRUCTION}", str(value), {"expression": expression, "tools": TOOL_NAMES})
