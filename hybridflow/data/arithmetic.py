"""Arithmetic task: `a + b - c * d` style questions with an integer answer.

The difficulty knobs (`ArithmeticDifficulty`) set the number of operands, the
digits per operand and the operators. The default — two operands of 1 to 2
digits, addition only — is calibrated for SmolLM2-135M-Instruct so that GRPO
groups see reward variance. Measured on the test split (32-48 new tokens):
sampling at temperature 1 it answered 9% and 17% right (two runs, 64 and 48
prompts), greedily 25%; with an instruction asking for `####` instead,
sampling fell to 6% (greedy 33%), hence "Answer with just the number.".
Single-digit operands are easier (23% sampled, 77% greedy, `####` instruction)
but allow only 100 distinct problems, too few for a held-out split.
Answers follow Python precedence (`*` before `+`/`-`) and may be negative.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridflow.data.tasks import Problem, register_task

INSTRUCTION = "Answer with just the number."
"""The one answer-format instruction; the scorer reads the last number (or the number after `####`)."""

_OPERATORS = ("+", "-", "*")


@dataclass
class ArithmeticDifficulty:
    """Difficulty knobs of the arithmetic task."""

    num_operands: int = 2
    """How many numbers appear in the expression (>= 2)."""
    min_digits: int = 1
    """Fewest decimal digits of an operand (1 allows 0-9)."""
    max_digits: int = 2
    """Most decimal digits of an operand."""
    operators: str = "+"
    """Operators to draw from, as one string, e.g. "+-" or "+-*"."""

    def __post_init__(self) -> None:
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 9, got {self.min_digits}, {self.max_digits}")
        bad = [op for op in self.operators if op not in _OPERATORS]
        if bad or not self.operators:
            raise ValueError(f"operators must be a non-empty mix of {_OPERATORS}, got {self.operators!r}")


def _operand(rng: np.random.Generator, level: ArithmeticDifficulty) -> int:
    digits = int(rng.integers(level.min_digits, level.max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10**digits))


@register_task("arithmetic", ArithmeticDifficulty)
def make_arithmetic(rng: np.random.Generator, level: ArithmeticDifficulty) -> Problem:
    """One arithmetic question; the ground truth is the integer result as a string."""
    numbers = [_operand(rng, level) for _ in range(level.num_operands)]
    ops = [level.operators[int(rng.integers(len(level.operators)))] for _ in range(level.num_operands - 1)]
    expression = str(numbers[0])
    for op, number in zip(ops, numbers[1:]):
        expression += f" {op} {number}"
    answer = _evaluate(numbers, ops)
    question = f"What is {expression}? {INSTRUCTION}"
    return Problem(question, str(answer), {"expression": expression})


def _evaluate(numbers: list[int], ops: list[str]) -> int:
    # Products first, then a left-to-right sum: Python precedence, no eval().
    terms, signs = [numbers[0]], [1]
    for op, number in zip(ops, numbers[1:]):
        if op == "*":
            terms[-1] *= number
        else:
            terms.append(number)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms))
