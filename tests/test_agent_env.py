"""Environments (registry, ToolEnvironment) and the tool_arithmetic task with its SFT transcripts."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from hybridflow.agent.loop.env import ENVIRONMENTS, Environment, ResetResult, StepResult, make_env, row_tool_names
from hybridflow.agent.loop.tool_calls import format_tool_call, parse_tool_calls
from hybridflow.cli.main import main as cli_main
from hybridflow.data import build_task
from hybridflow.data.sft import SFTDataset, build_sft_task
from hybridflow.rewards import default_compute_score
from hybridflow.utils.registry import UnknownNameError


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    train, test = build_task("tool_arithmetic", tmp_path_factory.mktemp("data"), 16, 8, seed=0)
    return pd.read_parquet(train).to_dict("records"), pd.read_parquet(test).to_dict("records")


def test_rows_are_verl_format_with_the_tool_list(rows):
    train, test = rows
    row = train[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "tool_arithmetic" and row["extra_info"]["tools"] == '["calculator"]'
    a, b = (int(x) for x in row["extra_info"]["expression"].split(" * "))
    assert 100 <= a < 1000 and 100 <= b < 1000 and row["reward_model"]["ground_truth"] == str(a * b)
    assert f"What is {a} * {b}?" in row["prompt"][0]["content"]
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score("tool_arithmetic", f"It is {truth}.", truth) == 1.0
    assert default_compute_score("tool_arithmetic", f"It is {int(truth) + 1}.", truth) == 0.0


def test_tool_environment_episode(rows):
    row = rows[0][0]
    env = make_env("tool")
    start = env.reset(row)
    assert start.messages == [dict(m) for m in row["prompt"]]
    assert [t["function"]["name"] for t in start.tools] == ["calculator"]
    call = env.step(
        "I'll compute it. " + format_tool_call("calculator", {"expression": row["extra_info"]["expression"]})
    )
    truth = row["reward_model"]["ground_truth"]
    assert call == StepResult([{"role": "tool", "content": truth}], 0.0, False, {"tool_calls": 1, "tool_errors": 0})
    answer = env.step(f"The answer is {truth}.")
    assert answer.done and answer.reward == 1.0 and answer.observations == []
    assert make_env("tool").reset(row) and env.step("The answer is 3.").reward == 0.0


def test_tool_environment_bad_calls_are_observations_with_a_penalty(rows):
    row = rows[0][0]
    env = make_env("tool", invalid_call_reward=-0.5, max_tool_response_length=40)
    env.reset(row)
    text = (
        "<tool_call>{broken</tool_call>"
        + format_tool_call("python", {"code": "print(1)"})  # a real tool the row does not offer
        + format_tool_call("calculator", {"expression": "1 / 0"})
        + format_tool_call("calculator", {"expression": "9 ** 60"})
    )
    result = env.step(text)
    contents = [m["content"] for m in result.observations]
    assert not result.done and result.reward == -1.0 and result.info == {"tool_calls": 4, "tool_errors": 3}
    assert contents[0].startswith("error: division by zero") and "truncated" in contents[1]
    assert "invalid JSON" in contents[2] and "unknown tool 'python'" in contents[3]


def test_rows_name_tools_as_json_or_list_and_bad_lists_fail():
    assert row_tool_names({"extra_info": {"tools": '["calculator", "python"]'}}) == ["calculator", "python"]
    assert row_tool_names({"extra_info": {"tools": ["python"]}}) == ["python"]
    assert row_tool_names({"extra_info": {}}) == []
    with pytest.raises(ValueError, match="list of tool names"):
        row_tool_names({"extra_info": {"tools": '{"calculator": 1}'}})
    with pytest.raises(UnknownNameError, match="not a registered tool"):
        make_env("tool").reset({"prompt": [], "extra_info": {"tools": ["nope"]}})


def test_environment_registry_takes_user_environments():
    class Echo(Environment):
        def reset(self, row):
            return ResetResult([{"role": "user", "content": row["q"]}])

        def step(self, assistant_text):
            return StepResult(reward=float(assistant_text == "hi"), done=True)

    ENVIRONMENTS.register("echo_test", Echo)
    try:
        env = make_env("echo_test")
        assert env.reset({"q": "say hi"}).messages[0]["content"] == "say hi" and env.step("hi").reward == 1.0
    finally:
        ENVIRONMENTS.unregister("echo_test")
    with pytest.raises(UnknownNameError, match="rollout.multi_turn.env='echo_test'"):
        make_env("echo_test")


def test_sft_transcripts_through_the_cli(tmp_path, capsys):
    assert (
        cli_main(["data", "tool_arithmetic", "--out", str(tmp_path), "--sft", "--train-size", "3", "--test-size", "2"])
        == 0
    )
    frame = pd.read_parquet(tmp_path / "tool_arithmetic_sft_train.parquet")
    assert len(frame) == 6 and set(frame.columns) == {"data_source", "messages", "extra_info"}
    call_row, full_row = frame.iloc[0]["messages"], frame.iloc[1]["messages"]
    assert [m["role"] for m in full_row] == ["system", "user", "assistant", "tool", "assistant"]
    assert list(call_row) == list(full_row[:3])
    calls = parse_tool_calls(full_row[2]["content"]).calls
    expression = frame.iloc[0]["extra_info"]["expression"]
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": expression})]
    a, b = (int(x) for x in expression.split(" * "))
    assert full_row[3]["content"] == full_row[4]["content"] == str(a * b)
    assert '"calculator"' in full_row[0]["content"] and json.loads(frame.iloc[0]["extra_info"]["tools"]) == [
        "calculator"
    ]
    assert default_compute_score("tool_arithmetic", full_row[4]["content"], str(a * b)) == 1.0


def test_sft_dataset_trains_each_assistant_turn_once(tmp_path):
    from hybridflow.models import load_tokenizer, tiny_model_dir

    train, _ = build_sft_task("tool_arithmetic", tmp_path, 2, 1, seed=0)
    tok = load_tokenizer(tiny_model_dir("llama"))
    examples = SFTDataset(train, tok, 512, messages_key="messages").examples
    responses = [tok.decode(response[:-1]) for _, response in examples]
    assert responses[0].startswith("<tool_call>") and responses[1].isdigit() and len(examples) == 4
    with pytest.raises(ValueError, match="messages_key"):
        SFTDataset(train, tok, 512)


def test_sft_config_asks_for_the_messages_column_of_a_multi_turn_task():
    from hybridflow.config.sft import SFTDataConfig

    with pytest.raises(ValueError, match="data.messages_key=messages"):
        SFTDataConfig(task="tool_arithmetic")
    assert SFTDataConfig(task="tool_arithmetic", messages_key="messages").task == "tool_arithmetic"
