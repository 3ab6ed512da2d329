"""Countdown task: reach a target number from given numbers with + - * /.

The generator draws `num_numbers` integers, combines all of them left to
right with random operators (keeping every intermediate result a positive
integer) and uses the result as the target, so every problem is solvable.
The ground truth is a JSON string `{"target": int, "numbers": [int, ...]}`;
`extra_info["solution"]` holds one solution. The scorer
(`hybridflow.rewards.countdown`) accepts any expression that reaches the
target using only the given numbers, each at most as often as it is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from hybridflow.data.tasks import Problem, register_task

INSTRUCTION = (
    "Use each number at most once with + - * / and parentheses. "
    'Write the final equation after "####", for example: #### (1 + 2) * 3'
)
"""Answer-format instruction appended to every question."""


@dataclass
class CountdownDifficulty:
    """Difficulty knobs of the countdown task."""

    num_numbers: int = 3
    """How many numbers are given (2 to 6)."""
    max_number: int = 20
    """Largest given number (>= 2); numbers are drawn from 1..max_number."""

    def __post_init__(self) -> None:
        if not 2 <= self.num_numbers <= 6:
            raise ValueError(f"num_numbers must be in 2..6, got {self.num_numbers}")
        if self.max_number < 2:
            raise ValueError(f"max_number must be >= 2, got {self.max_number}")


def _combine(rng: np.random.Generator, left: int, right: int) -> tuple[str, int]:
    op = "+-*/"[int(rng.integers(4))]
    if op == "-" and left <= right:
        op = "+"
    if op == "/" and (right <= 1 or left % right):
        op = "*"
    value = {"+": left + right, "-": left - right, "*": left * right}.get(op, left // right)
    return op, value


@register_task("countdown", CountdownDifficulty)
def make_countdown(rng: np.random.Generator, level: CountdownDifficulty) -> Problem:
    """One countdown puzzle with a target reachable from all the given numbers."""
    numbers = [int(x) for x in rng.integers(1, level.max_number + 1, size=level.num_numbers)]
    order = [numbers[i] for i in rng.permutation(len(numbers))]
    solution, value = str(order[0]), order[0]
    for number in order[1:]:
        op, value = _combine(rng, value, number)
        solution = f"({solution} {op} {number})"
    if solution.startswith("("):
        solution = solution[1:-1]
    question = f"Using the numbers {numbers}, create an equation that equals {value}. {INSTRUCTION}"
    truth = json.dumps({"target": value, "numbers": numbers})
    return Problem(question, truth, {"solution": solution})
