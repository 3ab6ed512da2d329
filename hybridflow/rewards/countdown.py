"""Scorer for the countdown task, evaluating the model's equation safely.

The expression is read after the last `####` (up to the end of that line);
if it contains `=`, only the left side counts ("(3 + 5) * 2 = 16"). Responses
without `####` fall back to the last line that looks like an equation.

The expression is parsed with `ast` and evaluated by a walker that allows
only integer literals, parentheses and the binary operators + - * /; any
other syntax (names, calls, attribute access, `**`, unary minus, floats,
strings) scores 0. Model text is never passed to `eval`. Arithmetic uses
exact fractions, so 7 / 2 * 2 reaches 7; division by zero scores 0.

Number rule (documented choice): the literals must be drawn from the given
numbers, each used at most as many times as it is given. Using all of them is
not required unless `require_all=True` (the generator's targets are always
reachable with all of them).
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
"""Longer expressions score 0 without parsing (deeply nested input can exhaust the parser)."""

_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_EQUATION_LINE = re.compile(r"^[\d\s()+\-*/=.]+$")


class UnsafeExpression(ValueError):
    """The expression uses syntax outside integers, parentheses and + - * /."""


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Value and integer literals of `expression`; raises UnsafeExpression on other syntax."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError, ValueError) as err:
        raise UnsafeExpression(f"cannot parse {expression!r}: {err}") from None
    literals: list[int] = []
    return _walk(tree.body, literals), literals


def _walk(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _walk(node.left, literals), _walk(node.right, literals)
        return _OPS[type(node.op)](left, right)
    raise UnsafeExpression(f"not allowed in a countdown equation: {ast.dump(node)[:80]}")


def extract_expression(solution_str: str) -> str | None:
    """The equation the model proposes, left of any `=`; None if there is none."""
    if "####" in solution_str:
        expression = solution_str.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    else:
        lines = [ln.strip() for ln in solution_str.splitlines() if _EQUATION_LINE.match(ln.strip())]
        if not lines:
            return None
        expression = lines[-1]
    expression = expression.split("=", 1)[0].strip().rstrip(".")
    return expression or None


def uses_allowed_numbers(literals: list[int], numbers: list[int], require_all: bool = False) -> bool:
    """True when each literal is a given number, used no more often than it is given."""
    used, given = Counter(literals), Counter(numbers)
    if any(count > given[value] for value, count in used.items()):
        return False
    return not require_all or used == given


def compute_score(solution_str: str, ground_truth: str, require_all: bool = False) -> float:
    """1.0 when the equation reaches the target with allowed numbers, else 0.0.

    `ground_truth` is the JSON string `{"target": int, "numbers": [int, ...]}`.
    """
    truth = json.loads(ground_truth)
    expression = extract_expression(solution_str)
    if expression is None:
        return 0.0
    try:
        value, literals = evaluate(expression)
    except (UnsafeExpression, ZeroDivisionError):
        return 0.0
    if not uses_allowed_numbers(literals, truth["numbers"], require_all):
        return 0.0
    return 1.0 if value == truth["target"] else 0.0
