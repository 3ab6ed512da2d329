"""bench/trl_side.py: its stand-alone scorer must agree with hybridflow's, its CLI must reject bad sizes.

The TRL run itself needs .venv-trl (bench/setup_trl_env.sh) and minutes of CPU, so it is not run here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.rewards.arithmetic import compute_score

_PATH = Path(__file__).resolve().parents[1] / "bench" / "trl_side.py"


def _load_trl_side():
    spec = importlib.util.spec_from_file_location("trl_side", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trl_side = _load_trl_side()

_PIECES = st.sampled_from(["####", " ", "\n", "-", ",", ".", "/", "$", "=", "+", "answer", "1", "9", "0", "42"])


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("#### 101", "101", 1.0),
        ("The answer is 101.", "101", 1.0),
        ("101 #### 100", "101", 0.0),
        ("12 + 7 = 19\n#### 19", "19", 1.0),
        ("#### -5", "-5", 1.0),
        ("no number at all", "3", 0.0),
    ],
)
def test_scorer_examples(response: str, truth: str, expected: float) -> None:
    assert trl_side.arithmetic_score(response, truth) == expected
    assert compute_score(response, truth) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=12).map("".join), st.sampled_from(["42", "-1", "0", "19", "1.5"]))
def test_scorer_mirrors_hybridflow(response: str, truth: str) -> None:
    assert trl_side.arithmetic_score(response, truth) == compute_score(response, truth)


@pytest.mark.parametrize("extra", [["--num-generations", "1"], ["--steps", "0"], ["--threads", "0"]])
def test_cli_rejects_bad_sizes(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model-dir", "m", "--train-parquet", "p.parquet", "--out", "o.json"]
    with pytest.raises(SystemExit):
        trl_side.parse_args(base + extra)
    assert "must" in capsys.readouterr().err


def test_cli_defaults_are_issue_6_settings() -> None:
    args = trl_side.parse_args(["--model-dir", "m", "--train-parquet", "p", "--out", "o"])
    assert (args.num_generations, args.max_prompt_length, args.max_completion_length, args.lr) == (4, 64, 32, 1e-6)
