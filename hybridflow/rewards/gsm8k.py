"""Scorer for GSM8K-style answers.

- `strict` (the default, GSM8K's own format): only the number after the last
  `####` counts; a response without `####` scores 0.
- `flexible`: the last number anywhere in the response counts.

Numbers compare exactly after removing thousands separators, so "1,200",
"1200" and "1200.0" are the same answer.
"""

from __future__ import annotations

from hybridflow.rewards.extract import after_hashes, last_number, same_number

METHODS = ("strict", "flexible")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer the scorer reads from `solution_str` under `method`."""
    if method == "strict":
        return after_hashes(solution_str)
    if method == "flexible":
        return last_number(solution_str)
    raise ValueError(f"unknown gsm8k scoring method {method!r}; use one of {METHODS}")


def compute_score(solution_str: str, ground_truth: str, method: str = "strict") -> float:
    """1.0 when the extracted answer equals `ground_truth`, else 0.0."""
    return 1.0 if same_number(extract_answer(solution_str, method), ground_truth) else 0.0
