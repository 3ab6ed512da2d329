"""Rule scorers, the custom reward loader and the RewardManager on real token ids."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.protocol import DataProto, keys
from hybridflow.rewards import RewardManager, countdown, default_compute_score, gsm8k, load_custom_reward_fn, math_boxed
from hybridflow.utils.config_loader import ConfigError
from tests.data_helpers import smol_tokenizer

CD_TRUTH = json.dumps({"target": 24, "numbers": [4, 6, 1, 5]})


@pytest.mark.parametrize(
    "response, score",
    [
        ("#### 19", 1.0),
        ("12 + 7 = 19", 1.0),
        ("The answer is 19.", 1.0),
        ("#### 19\nor maybe 20", 1.0),
        ("12 + 7 = 8", 0.0),
        ("#### 18", 0.0),
        ("nineteen", 0.0),
        ("", 0.0),
        ("19 or 20", 0.0),
    ],
)
def test_arithmetic(response, score):
    assert default_compute_score("arithmetic", response, "19") == score


def test_arithmetic_negative_answers():
    assert default_compute_score("arithmetic", "3 - 10 = -7", "-7") == 1.0
    assert default_compute_score("arithmetic", "3 - 10 = 7", "-7") == 0.0


@pytest.mark.parametrize(
    "response, strict, flexible",
    [
        ("so 3 * 4 = 12\n#### 12", 1.0, 1.0),
        ("#### 1,200", 0.0, 0.0),
        ("The answer is 12.", 0.0, 1.0),
        ("#### 12.0", 1.0, 1.0),
        ("#### 13\nthen 12", 0.0, 1.0),
        ("#### twelve", 0.0, 0.0),
    ],
)
def test_gsm8k_strict_and_flexible(response, strict, flexible):
    assert gsm8k.compute_score(response, "12", method="strict") == strict
    assert gsm8k.compute_score(response, "12", method="flexible") == flexible
    assert default_compute_score("openai/gsm8k", response, "12") == strict


def test_gsm8k_thousands_separator():
    assert default_compute_score("gsm8k", "#### 1,200", "1200") == 1.0
    with pytest.raises(ValueError, match="strict"):
        gsm8k.compute_score("#### 1", "1", method="loose")


@pytest.mark.parametrize(
    "response",
    [
        "#### 4 * 6",
        "#### (5 + 1) * 4",
        "#### 6 * (5 - 1)",
        "#### 6 * 4 = 24",
        "#### 4 / 1 * 6",
        "(1 + 5) * 4 = 24",  # no ####: the last equation-like line counts
        "#### 4 / (1 - 5 / 6)",  # all four numbers; needs exact fractions
    ],
)
def test_countdown_accepts_correct(response):
    assert default_compute_score("countdown", response, CD_TRUTH) == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "#### 4 * 6 + 0",  # 0 is not a given number
        "#### 24",  # 24 is not a given number
        "#### 6 * 4 * 1 * 1",  # 1 used twice, given once
        "#### 5 * 5 - 1",  # 5 used twice
        "#### 4 * 6 + 1",  # wrong value
        "#### 6 / (5 - 5)",  # division by zero (and 5 twice)
        "#### __import__('os').system('echo hacked') or 24",
        "#### (4).__class__",  # attribute access
        "#### x * 6",  # names
        "#### 4 ** 6 ** 5 ** 1",  # power refused before anything is computed
        "#### 9 ** 9 ** 9 ** 9",
        "#### -4 * -6",  # unary minus is not an allowed operator
        "#### 4.0 * 6",  # floats are not given numbers
        "#### 4 * 6 if 1 else 5",
        "#### [4 * 6][0]",
        "#### " + "(" * 300 + "4" + ")" * 300,
        "no equation here",
    ],
)
def test_countdown_refuses(response):
    assert default_compute_score("countdown", response, CD_TRUTH) == 0.0


def test_countdown_evaluator_is_exact_and_safe():
    value, literals = countdown.evaluate("(7 / 2) * 2")
    assert value == 7 and literals == [7, 2, 2]
    for unsafe in ("__import__('os')", "a.b", "2 ** 3", "lambda: 1", "'s' * 3", "f(1)"):
        with pytest.raises(countdown.UnsafeExpression):
            countdown.evaluate(unsafe)
    truth = json.dumps({"target": 10, "numbers": [2, 5, 3]})
    assert countdown.compute_score("#### 2 * 5", truth) == 1.0
    assert countdown.compute_score("#### 2 * 5", truth, require_all=True) == 0.0


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1/2}", "\\dfrac{1}{2}", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\boxed{\\sqrt{2}}", 1.0),
        ("\\boxed{3} then \\boxed{4}", "4", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("the answer is 4", "4", 0.0),
        ("\\boxed{4", "4", 0.0),
    ],
)
def test_math_boxed(response, truth, score):
    assert default_compute_score("math", response, truth) == score
    assert default_compute_score("lighteval/MATH", response, truth) == score


def test_math_last_boxed_nested_braces():
    assert math_boxed.last_boxed("a \\boxed{\\frac{a}{b}} b") == "\\frac{a}{b}"


def test_unknown_data_source_lists_known():
    with pytest.raises(
        KeyError, match="data_source='nope' is not a registered rule scorer; known: .*arithmetic.*countdown"
    ):
        default_compute_score("nope", "1", "1")


def test_custom_reward_fn(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text(
        "def length_bonus(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return len(solution_str) / 10\n"
    )
    fn = load_custom_reward_fn(str(file), "length_bonus")
    assert fn("any", "abcde", "x") == 0.5
    with pytest.raises(ConfigError, match="no function 'compute_score'.*length_bonus"):
        load_custom_reward_fn(str(file), "compute_score")
    with pytest.raises(FileNotFoundError, match="missing.py.*custom_reward_function.path"):
        load_custom_reward_fn(str(tmp_path / "missing.py"), "f")


def _batch(tokenizer, texts, sources, truths, resp_len=16):
    rows = [tokenizer(t + "<|im_end|>", add_special_tokens=False)["input_ids"] for t in texts]
    responses = torch.full((len(rows), resp_len), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(responses)
    for i, ids in enumerate(rows):
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return DataProto.from_dict(
        {keys.RESPONSES: responses, keys.RESPONSE_MASK: mask},
        {keys.DATA_SOURCE: sources, keys.GROUND_TRUTH: truths, keys.EXTRA_INFO: [{} for _ in rows]},
    )


def test_reward_manager_places_scores_at_last_token():
    tok = smol_tokenizer()
    texts = ["3 + 4 = 7", "3 + 4 = 8", "#### (5 + 1) * 4", "#### 12"]
    data = _batch(tok, texts, ["arithmetic", "arithmetic", "countdown", "gsm8k"], ["7", "7", CD_TRUTH, "12"])
    result = RewardManager(tok)(data)
    lengths = data.batch[keys.RESPONSE_MASK].sum(-1)
    assert result.scores == [1.0, 0.0, 1.0, 1.0]
    assert result.token_level_scores.shape == (4, 16) and result.token_level_scores.dtype == torch.float32
    for i, n in enumerate(lengths.tolist()):
        assert result.token_level_scores[i, n - 1] == result.scores[i]
        assert result.token_level_scores[i].abs().sum() == result.scores[i]
    assert result.metrics == {
        "reward/arithmetic/mean": 0.5,
        "reward/countdown/mean": 1.0,
        "reward/gsm8k/mean": 1.0,
        "reward/mean": 0.75,
    }


def test_reward_manager_adds_rm_scores_and_pool_matches_serial(tmp_path):
    tok = smol_tokenizer()
    texts = [f"{a} + 1 = {a + (a % 2)}" for a in range(8)]
    data = _batch(tok, texts, ["arithmetic"] * 8, [str(a + 1) for a in range(8)])
    serial = RewardManager(tok)(data)
    assert serial.scores == [float(a % 2) for a in range(8)]
    pooled = RewardManager(tok, num_workers=2)(data)
    assert pooled.scores == serial.scores
    rm = torch.zeros(8, 16)
    rm[:, 0] = 0.25
    data.batch[keys.RM_SCORES] = rm
    with_rm = RewardManager(tok)(data)
    assert torch.allclose(with_rm.token_level_scores, serial.token_level_scores + rm)
    file = tmp_path / "r.py"
    file.write_text("def f(data_source, solution_str, ground_truth, extra_info=None):\n    return 2.0\n")
    custom = RewardManager(tok, compute_score=load_custom_reward_fn(str(file), "f"), num_workers=2)(data)
    assert custom.scores == [2.0] * 8
