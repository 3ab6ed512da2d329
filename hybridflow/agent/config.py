"""The agent's configuration: the in-worker multi-turn loop (`rollout.multi_turn`, agent/loop/) and harness training
through the OpenAI-compatible endpoint (`rollout.agent`, endpoint/harness.py). Both sit under the rollout's
section, as verl names them; the rollout config (rollout/config.py) holds them."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.agent.loop.tools.sandbox import SandboxConfig
from hybridflow.agent.loop.tools.tool_config import check_tools, load_tool_config
from hybridflow.utils.config_loader import Section
from hybridflow.utils.plugins import is_path, load_object, resolve_spec


@dataclass
class MultiTurnConfig(Section):
    """Multi-turn agent rollouts (verl's `rollout.multi_turn` names): each prompt row runs as an episode of
    its environment (hybridflow/agent/loop/env.py) in the token-exact loop of hybridflow/agent/loop/runner.py."""

    enable: bool = False
    """Generate with the agent loop instead of single-turn completions (native, tensor-parallel native, hf and vllm
    rollouts; every trainer.mode, with trainer.partial_rollout in the off-policy ones)."""
    max_assistant_turns: int = 4
    """Most model turns per trajectory."""
    max_user_turns: int = 4
    """Most environment replies (tool results, user turns) per trajectory."""
    max_tool_response_length: int = 256
    """Characters kept of each tool result (the rest is replaced by a truncation note), as verl's."""
    max_turn_tokens: int | None = None
    """Most new tokens of one model turn; None: the whole response budget (rollout.response_length)."""
    env: str = "tool"
    """The environment: a name registered in ENVIRONMENTS ("tool": the row's tools, scored by its data_source)
    or a `module:Class` / `path/to/file.py:Class` path. Its constructor gets `tool_kwargs`, `allowed_tools` and
    `max_tool_response_length` when it takes parameters of those names, nothing else."""
    allowed_tools: list[str] = field(default_factory=lambda: ["calculator"])
    """The tools a dataset row may switch on in its extra_info.tools (registered TOOLS names); a row asking for
    another fails naming it. Add "python" to let rows run model-written code in the sandbox."""
    tool_config_path: str | None = None
    """Optional YAML/JSON file mapping tool name -> constructor kwargs (e.g. `python: {timeout_s: 5}`: the python
    tool takes any rollout.multi_turn.sandbox field, overriding that section)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """The python tool's sandbox: limits of each call (docs/guides/agents.md "The python sandbox")."""

    def __post_init__(self) -> None:
        for key in ("max_assistant_turns", "max_user_turns", "max_tool_response_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"rollout.multi_turn.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"rollout.multi_turn.max_turn_tokens must be >= 1 or null, got {self.max_turn_tokens}")
        if self.tool_config_path is not None and not Path(self.tool_config_path).is_file():
            raise ValueError(f"rollout.multi_turn.tool_config_path={self.tool_config_path!r} is not a file")
        if isinstance(self.sandbox, dict):
            self.sandbox = SandboxConfig(**self.sandbox)
        check_tools(self.allowed_tools, load_tool_config(self.tool_config_path), self.sandbox)
        if self.enable and is_path(self.env):  # workers may run in another directory
            module, _, name = self.env.rpartition(":")
            self.env = f"{resolve_spec(module)}:{name}"


HARNESS_MISMATCH = ("split", "refuse")
"""rollout.agent.on_mismatch values (hybridflow/endpoint/sessions.py)."""


@dataclass
class AgentConfig(Section):
    """Training an agent harness written as plain `openai`-client code (issue 30; verl groups its agent-loop
    settings under `rollout.agent` too). Each rollout worker serves its own rollout on an OpenAI-compatible
    endpoint on 127.0.0.1 and calls `function` once per prompt row x rollout.n (hybridflow/endpoint/harness.py)."""

    function: str | None = None
    """The harness, `module:name` or `path/to/file.py:name`: `run(client: openai.OpenAI, row: dict) -> float | None`
    (the reward, or None to score the last assistant message with the row's rule scorer). None: off."""
    timeout_s: float = 300.0
    """Seconds one harness call may run; past it the trajectory is dropped and counted (agent/harness_timeouts)."""
    max_concurrency: int = 32
    """Harness calls running at once on one rollout worker; their concurrent requests are batched."""
    on_mismatch: str = "split"
    """A request whose messages extend none of its trajectory's recorded history: "split" (a new trajectory in
    the session; the last one is trained) or "refuse" (HTTP 400 to the harness)."""

    @property
    def enable(self) -> bool:
        """True when a harness is configured."""
        return self.function is not None

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"rollout.agent.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_concurrency < 1:
            raise ValueError(f"rollout.agent.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.on_mismatch not in HARNESS_MISMATCH:
            raise ValueError(f"rollout.agent.on_mismatch must be one of {HARNESS_MISMATCH}, got {self.on_mismatch!r}")
        if self.function is not None:
            self._check_function()

    def _check_function(self) -> None:
        try:
            import openai  # noqa: F401, PLC0415  (only a harness run needs the client)
        except ImportError:
            raise ValueError(
                "rollout.agent.function needs the openai package for the harness's client; pip install 'openai>=2.25'"
            ) from None
        module, _, name = self.function.rpartition(":")
        self.function = f"{resolve_spec(module)}:{name}"  # workers may run in another directory
        fn = load_object(self.function, "rollout.agent.function")
        try:
            inspect.signature(fn).bind(None, None)
        except (TypeError, ValueError):
            raise ValueError(
                f"rollout.agent.function={self.function!r} must be callable as run(client, row); "
                "see hybridflow/endpoint/harness.py"
            ) from None
