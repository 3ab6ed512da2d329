"""A calculator agent for the tool_arithmetic task, written as a user would write it for any OpenAI-compatible API.

Train it with `rollout.agent.function=hybridflow.endpoint.examples.calculator:run` (README, "Training an agent
harness"). It sends the row's messages with the calculator's function schema in `tools`, runs every tool call
the reply makes with `hybridflow.agent.loop.tools`' calculator, sends the results back as `tool` messages, and stops
at the first reply without tool calls (or after `MAX_TURNS` replies). It returns None: the row's rule scorer
scores that last reply.
"""

from __future__ import annotations

import json
from typing import Any

import openai

from hybridflow.agent.loop.tools import TOOLS, Tool, run_tool

MAX_TURNS = 4
"""Most model replies per episode."""


def run(client: openai.OpenAI, row: dict[str, Any]) -> float | None:
    """One episode of `row` against `client` (module docstring)."""
    calculator = TOOLS.get("calculator")()
    messages: list[dict[str, Any]] = [dict(m) for m in row["prompt"]]
    for _ in range(MAX_TURNS):
        response = client.chat.completions.create(model="policy", messages=messages, tools=[calculator.schema])
        reply = response.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": call_result(calculator, call)})
    return None


def call_result(calculator: Tool, call: Any) -> str:
    """The text of one tool call's result (an error message for a call the calculator cannot take)."""
    if call.function.name != "calculator":
        return f"error: unknown tool {call.function.name!r}; available: ['calculator']"
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as err:
        return f"error: the arguments are not JSON: {err}"
    return run_tool(calculator, arguments).text
