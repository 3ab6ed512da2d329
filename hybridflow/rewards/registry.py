"""Rule scorers selected by a row's `data_source`.

`default_compute_score` is the reward function used when the config names no
custom one. Sources written by verl's data preprocessing scripts
("openai/gsm8k", "lighteval/MATH", ...) map to the same scorers, so verl
parquet files score without changes.
"""

from __future__ import annotations

from typing import Any, Callable

from hybridflow.rewards import arithmetic, countdown, gsm8k, math_boxed

Scorer = Callable[[str, str], float]

SCORERS: dict[str, Scorer] = {
    "arithmetic": arithmetic.compute_score,
    "gsm8k": gsm8k.compute_score,
    "openai/gsm8k": gsm8k.compute_score,
    "countdown": countdown.compute_score,
    "math": math_boxed.compute_score,
    "lighteval/MATH": math_boxed.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_boxed.compute_score,
}
"""data_source -> scorer(solution_str, ground_truth) -> float."""


def register_scorer(data_source: str, scorer: Scorer) -> None:
    """Make `default_compute_score` score rows of `data_source` with `scorer`."""
    SCORERS[data_source] = scorer


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict[str, Any] | None = None) -> float:
    """Score one decoded response with the rule scorer registered for `data_source`."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise KeyError(
            f"no rule scorer for data_source {data_source!r}; known data sources: {sorted(SCORERS)}. "
            "Register one with hybridflow.rewards.register_scorer or set "
            "reward.custom_reward_function.path/name in the config.")
    return float(scorer(solution_str, ground_truth))
