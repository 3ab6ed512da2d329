"""Tools configured from the run's config: the sandbox section, the tool config file (its documented
`python: {timeout_s: 5}` example), and the allowlist of tools a dataset row may switch on."""

from __future__ import annotations

import pytest

from hybridflow.agent.loop.env import make_env
from hybridflow.agent.loop.tool_calls import format_tool_call
from hybridflow.config.run import RunConfig
from hybridflow.rollout.multi_turn import env_factory
from hybridflow.utils.config_loader import ConfigError, load_config
from tests.sandbox_required import machine_problem

needs_sandbox = pytest.mark.skipif(machine_problem() is not None, reason=f"no sandbox here: {machine_problem()}")


def _row(tools: list[str]) -> dict:
    return {
        "prompt": [{"role": "user", "content": "What is 6 * 7?"}],
        "data_source": "tool_arithmetic",
        "reward_model": {"ground_truth": "42"},
        "extra_info": {"tools": tools},
    }


def _env(*overrides: str):
    config = load_config(RunConfig, None, list(overrides))
    return env_factory(config.rollout.multi_turn)()


def _python_call(env, code: str) -> str:
    env.reset(_row(["python"]))
    return env.step(format_tool_call("python", {"code": code})).observations[0]["content"]


@needs_sandbox
def test_the_documented_tool_config_example_works(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("python: {timeout_s: 5}\n")  # as in rollout.multi_turn.tool_config_path's docstring
    env = _env(f"rollout.multi_turn.tool_config_path={path}", "rollout.multi_turn.allowed_tools=[calculator,python]")
    env.reset(_row(["python"]))
    assert env.tools["python"].config.timeout_s == 5
    assert _python_call(env, "print(6 * 7)") == "42\n"
    path.write_text("python: {timeout_s: 1}\n")
    env = _env(f"rollout.multi_turn.tool_config_path={path}", "rollout.multi_turn.allowed_tools=[python]")
    assert _python_call(env, "while True:\n    pass") == "[killed: wall-clock limit of 1 s]"


@needs_sandbox
def test_sandbox_limits_come_from_the_config():
    env = _env("rollout.multi_turn.allowed_tools=[python]", "rollout.multi_turn.sandbox.max_output_chars=5")
    text = _python_call(env, "print('x' * 100)")
    assert text.startswith("xxxxx\n[output truncated to 5 characters") and "xxxxxx" not in text
    env = _env(
        "rollout.multi_turn.allowed_tools=[python]",
        "rollout.multi_turn.sandbox.max_processes=2",
        "rollout.multi_turn.max_tool_response_length=1000",
    )
    code = "import os\nfor _ in range(3):\n    if os.fork() == 0:\n        os._exit(0)\nprint('forked')"
    assert "BlockingIOError" in _python_call(env, code)


def test_a_row_may_switch_on_only_allowed_tools():
    env = _env()  # the default allows the calculator only
    with pytest.raises(ValueError, match=r"asks for \['python'\].*rollout\.multi_turn\.allowed_tools"):
        env.reset(_row(["calculator", "python"]))
    assert [t["function"]["name"] for t in env.reset(_row(["calculator"])).tools] == ["calculator"]
    with pytest.raises(ValueError, match="rollout.multi_turn.allowed_tools"):
        make_env("tool").reset(_row(["python"]))  # the environment's own default is the same
    assert [
        t["function"]["name"] for t in make_env("tool", allowed_tools=["python"]).reset(_row(["python"])).tools
    ] == ["python"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.multi_turn.allowed_tools=[shell]"], "allowed_tools: tool name='shell' is not a registered tool"),
        (["rollout.multi_turn.sandbox.tree_limits=none"], "sandbox.tree_limits must be one of"),
        (["rollout.multi_turn.sandbox.max_processes=0"], "sandbox.max_processes must be > 0"),
    ],
)
def test_bad_tool_settings_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, overrides)


def test_a_bad_tool_config_file_fails_at_load(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("python: {timeout: 5}\n")
    with pytest.raises(ConfigError, match=r"tool 'python' cannot be built.*unknown sandbox setting\(s\) \['timeout'\]"):
        load_config(RunConfig, None, [f"rollout.multi_turn.tool_config_path={path}"])
    path.write_text("shell: {}\n")
    with pytest.raises(ConfigError, match="tool 'shell' cannot be built"):
        load_config(RunConfig, None, [f"rollout.multi_turn.tool_config_path={path}"])
