"""Rule scorers selected by a row's `data_source`.

`default_compute_score` is the reward function used when the config names no
custom one. Sources written by verl's data preprocessing scripts
("openai/gsm8k", "lighteval/MATH", ...) map to the same scorers, so verl
parquet files score without changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hybridflow.rewards.arithmetic as arithmetic
import hybridflow.rewards.countdown as countdown
import hybridflow.rewards.gsm8k as gsm8k
import hybridflow.rewards.math_boxed as math_boxed
from hybridflow.utils.registry import Registry

Scorer = Callable[[str, str], float]

SCORERS: Registry[Scorer] = Registry(
    "rule scorer",
    "data_source",
    "register one with hybridflow.rewards.register_scorer or set reward.custom_reward_function.path/name in the config",
)
"""data_source -> scorer(solution_str, ground_truth) -> float."""
SCORERS.register("arithmetic", arithmetic.compute_score)
SCORERS.register("tool_arithmetic", arithmetic.compute_score)  # data/tool_arithmetic.py: products, with a calculator
SCORERS.register("tool_sum_products", arithmetic.compute_score)  # data/tool_arithmetic.py: a * b + c * d, calculator
SCORERS.register("gsm8k", gsm8k.compute_score)
SCORERS.register("openai/gsm8k", gsm8k.compute_score)
SCORERS.register("countdown", countdown.compute_score)
SCORERS.register("math", math_boxed.compute_score)
SCORERS.register("lighteval/MATH", math_boxed.compute_score)
SCORERS.register("DigitalLearningGmbH/MATH-lighteval", math_boxed.compute_score)


def register_scorer(data_source: str, scorer: Scorer, *, override: bool = False) -> Scorer:
    """Make `default_compute_score` score rows of `data_source` with `scorer` (override: replace one)."""
    return SCORERS.register(data_source, scorer, override=override)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """Score one decoded response with the rule scorer registered for `data_source`."""
    return float(SCORERS.get(data_source)(solution_str, ground_truth))
