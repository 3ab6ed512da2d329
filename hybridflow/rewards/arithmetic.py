"""Scorer for the arithmetic task: 1.0 for the right integer, else 0.0.

The answer is the number after the last `####` when the response has one,
otherwise the last number in the response: a 135M model often ignores the
format instruction, and scoring the bare answer keeps the task learnable.
"""

from __future__ import annotations

from hybridflow.rewards.extract import after_hashes, last_number, same_number


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response's final answer equals `ground_truth` exactly."""
    answer = after_hashes(solution_str)
    if answer is None:
        answer = last_number(solution_str)
    return 1.0 if same_number(answer, ground_truth) else 0.0
