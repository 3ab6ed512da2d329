"""The tool_sum_products task (issue 55): its rows, its episodes in the tool environment, its reward and SFT set."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from hybridflow.agent.loop.env import make_env
from hybridflow.agent.loop.tool_calls import format_tool_call, parse_tool_calls
from hybridflow.data import build_task
from hybridflow.data.sft import build_sft_task
from hybridflow.data.tasks import make_difficulty, make_rows
from hybridflow.rewards import default_compute_score


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    train, test = build_task("tool_sum_products", tmp_path_factory.mktemp("data"), 16, 8, seed=0)
    return pd.read_parquet(train).to_dict("records"), pd.read_parquet(test).to_dict("records")


def factors(row) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in term.split(" * ")) for term in row["extra_info"]["expression"].split(" + ")]


def test_rows_are_sums_of_two_products_offering_the_calculator(rows):
    train, test = rows
    for row in train + test:
        (a, b), (c, d) = factors(row)
        assert all(100 <= x < 1000 for x in (a, b, c, d))
        assert row["data_source"] == "tool_sum_products" and row["extra_info"]["tools"] == '["calculator"]'
        assert row["reward_model"]["ground_truth"] == str(a * b + c * d)
        assert f"What is {a} * {b} + {c} * {d}?" in row["prompt"][0]["content"]
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    three = make_rows("tool_sum_products", 4, "train", 0, make_difficulty("tool_sum_products", terms=3))
    assert all(len(factors(r)) == 3 and eval(r["extra_info"]["expression"]) == int(r["reward_model"]["ground_truth"])
               for r in three)  # fmt: skip
    with pytest.raises(ValueError, match="2 <= terms <= 6"):
        make_difficulty("tool_sum_products", terms=1)


def episode(row, turns: list[str]) -> tuple[float, list[str]]:
    """Play scripted assistant TURNS in a fresh tool environment: the final reward and the tool results."""
    env = make_env("tool")
    assert [t["function"]["name"] for t in env.reset(row).tools] == ["calculator"]
    results = []
    for text in turns:
        step = env.step(text)
        if step.done:
            return step.reward, results
        results += [m["content"] for m in step.observations]
    raise AssertionError("the scripted episode did not end")


def call(expression: str) -> str:
    return format_tool_call("calculator", {"expression": expression})


def test_episodes_reward_the_whole_sum_not_one_product(rows):
    row = rows[1][0]
    (a, b), (c, d) = factors(row)
    truth = row["reward_model"]["ground_truth"]
    # one call on the whole expression (what the SFT transcript of this task shows)
    assert episode(row, [call(row["extra_info"]["expression"]), truth]) == (1.0, [truth])
    # the calls composed: each product, then their sum, the last result as the answer
    composed = [call(f"{a} * {b}"), call(f"{c} * {d}"), call(f"{a * b} + {c * d}"), f"It is {a * b + c * d}."]
    assert episode(row, composed) == (1.0, [str(a * b), str(c * d), truth])
    # the product-only habit of a warm-up on tool_arithmetic: the first product as the answer
    assert episode(row, [call(f"{a} * {b}"), str(a * b)]) == (0.0, [str(a * b)])
    assert episode(row, [str(int(truth) + 1)]) == (0.0, [])  # no call, a wrong number
    assert default_compute_score("tool_sum_products", f"#### {truth}", truth) == 1.0


def test_sft_transcripts_call_the_calculator_on_the_whole_expression(tmp_path):
    train, _ = build_sft_task("tool_sum_products", tmp_path, 3, 1, seed=0)
    frame = pd.read_parquet(train)
    assert len(frame) == 6  # two assistant turns per transcript
    messages = frame.iloc[1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    (expression,) = [c.arguments["expression"] for c in parse_tool_calls(messages[2]["content"]).calls]
    assert re.fullmatch(r"\d+ \* \d+ \+ \d+ \* \d+", expression) and expression in messages[1]["content"]
    assert messages[3]["content"] == messages[4]["content"] == str(eval(expression))
