"""Environments: the unit a user writes for multi-turn RL, their registry, and the tool-use one.

An environment is an object with two methods, called by the agent loop for one trajectory:

    reset(row) -> ResetResult(messages, tools)
        `row` is one dataset row (verl's format: data_source, prompt, reward_model, extra_info).
        Returns the first chat messages and the OpenAI function schemas of the tools offered.
    step(assistant_text) -> StepResult(observations, reward, done)
        `assistant_text` is the model's decoded turn (without the end-of-turn token).
        Returns the messages to append before the model's next turn (tool results: role
        `tool`), the reward of this turn, and whether the episode ended.

The trajectory's reward is the sum of its turns' rewards. A fresh environment object is made
per trajectory (`make_env`), so an environment may keep per-episode state on `self`.

`ToolEnvironment` ("tool"): offers the tools the row names (`extra_info.tools`, a JSON list of
`TOOLS` names, or a list), each of which must be in its `allowed_tools` (rollout.multi_turn.allowed_tools;
the calculator only by default), so a third-party dataset cannot switch on code execution; a turn
with tool calls gets one `tool` message per call (results in call order, then one per malformed
or unknown-tool call) and `invalid_call_reward` per malformed or unknown-tool call (a tool that
runs and fails is not penalised); a turn without calls is the answer: the episode ends with the
row's scorer (`hybridflow.rewards.default_compute_score` for its data_source) as the final reward.

Departures from verl: verl's `ToolAgentLoop` drives tools itself (`BaseTool.create/execute/
calc_reward/release`, schemas from `tool_config_path`, `interaction` for user turns); here one
`Environment` object owns both tools and user turns, and the row names its tools.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agent.loop.tool_calls import parse_tool_calls
from hybridflow.agent.loop.tools import TOOLS, Tool, run_tool
from hybridflow.rewards import default_compute_score
from hybridflow.utils.registry import Registry

Message = dict[str, Any]


@dataclass
class ResetResult:
    """The start of an episode."""

    messages: list[Message]
    """The prompt as chat messages."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI function schemas of the tools the model may call."""


@dataclass
class StepResult:
    """The environment's answer to one assistant turn."""

    observations: list[Message] = field(default_factory=list)
    """Messages appended before the next assistant turn (empty when done)."""
    reward: float = 0.0
    """Reward of this turn (the final reward on the turn that ends the episode)."""
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Per-turn counters for metrics (ToolEnvironment: tool_calls, tool_errors)."""


class Environment(ABC):
    """One episode of a multi-turn task (module docstring)."""

    @abstractmethod
    def reset(self, row: dict[str, Any]) -> ResetResult:
        """Start an episode for dataset `row`."""

    @abstractmethod
    def step(self, assistant_text: str) -> StepResult:
        """React to the model's turn `assistant_text`."""


ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry(
    "environment", "rollout.multi_turn.env", "register one with @hybridflow.agent.loop.env.ENVIRONMENTS.register(name)"
)
"""Environment factories (classes) by name."""


def make_env(name: str, **kwargs: Any) -> Environment:
    """A fresh environment `name` built with `kwargs`; unknown names fail listing the known ones."""
    return ENVIRONMENTS.get(name)(**kwargs)


def row_tool_names(row: dict[str, Any]) -> list[str]:
    """The tool names a row offers: `extra_info.tools` as a JSON list string or a list (none: [])."""
    names = (row.get("extra_info") or {}).get("tools") or []
    if isinstance(names, str):
        names = json.loads(names)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"extra_info.tools must be a list of tool names (or its JSON), got {names!r}")
    return names


def truncate(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with a marker saying how much was dropped."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...(truncated {len(text) - limit} characters)"


@ENVIRONMENTS.register("tool")
class ToolEnvironment(Environment):
    """Tool use over the row's tool list, scored by the row's rule scorer (module docstring)."""

    def __init__(
        self,
        tool_kwargs: dict[str, dict[str, Any]] | None = None,
        scorer: Callable[..., float] | None = None,
        max_tool_response_length: int = 256,
        invalid_call_reward: float = 0.0,
        allowed_tools: Sequence[str] = ("calculator",),
    ) -> None:
        """`tool_kwargs`: constructor arguments per tool name; `scorer(data_source, text, ground_truth,
        extra_info)` defaults to the registered rule scorers; tool results are cut to
        `max_tool_response_length` characters; a row may switch on only the tools of `allowed_tools`."""

        self.tool_kwargs = tool_kwargs or {}
        self.scorer = scorer or default_compute_score
        self.max_tool_response_length = max_tool_response_length
        self.invalid_call_reward = invalid_call_reward
        self.allowed_tools = list(allowed_tools)
        self.tools: dict[str, Tool] = {}
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> ResetResult:
        """The row's prompt messages and the schemas of its tools."""
        self.row = row
        names = row_tool_names(row)
        classes = {name: TOOLS.get(name) for name in names}  # unknown names fail listing the registered ones
        refused = [name for name in names if name not in self.allowed_tools]
        if refused:
            raise ValueError(
                f"the row's extra_info.tools asks for {refused}, which rollout.multi_turn.allowed_tools does not "
                f"allow (allowed: {self.allowed_tools}); add them to rollout.multi_turn.allowed_tools to let rows "
                "switch them on"
            )
        self.tools = {name: cls(**self.tool_kwargs.get(name, {})) for name, cls in classes.items()}
        return ResetResult([dict(m) for m in row["prompt"]], [t.schema for t in self.tools.values()])

    def step(self, assistant_text: str) -> StepResult:
        """Run the turn's tool calls, or score the turn as the final answer when it has none."""
        turn = parse_tool_calls(assistant_text)
        if not turn.has_calls:
            return StepResult(reward=self._score(assistant_text), done=True, info={"tool_calls": 0, "tool_errors": 0})
        texts, invalid, failed = [], [f"error: {e}" for e in turn.errors], 0
        for call in turn.calls:
            tool = self.tools.get(call.name)
            if tool is None:
                invalid.append(f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}")
                continue
            result = run_tool(tool, call.arguments)
            texts.append(result.text)
            failed += not result.ok
        observations = [
            {"role": "tool", "content": truncate(t, self.max_tool_response_length)} for t in texts + invalid
        ]
        info = {"tool_calls": len(turn.calls) + len(turn.errors), "tool_errors": failed + len(invalid)}
        return StepResult(observations, self.invalid_call_reward * len(invalid), False, info)

    def _score(self, text: str) -> float:
        row = self.row
        truth = row["reward_model"]["ground_truth"]
        return float(self.scorer(row["data_source"], text, truth, row.get("extra_info")))
