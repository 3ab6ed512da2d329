"""The calculator tool: integer and decimal arithmetic parsed with `ast`, never `eval`.

Allowed: numbers, `+ - * / // % **` and parentheses, unary signs. Limits keep one call cheap:
the expression is at most `MAX_CHARS` long, an exponent at most `MAX_EXPONENT`, and an
intermediate integer at most `MAX_DIGITS` digits.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from hybridflow.agent.loop.tools.base import TOOLS, Tool, ToolResult

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 100

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic `expression` (module docstring); anything else raises CalculatorError."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} exceeds {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as exc:
            raise CalculatorError(str(exc)) from None
        if isinstance(value, int) and abs(value) >= 10**MAX_DIGITS:
            raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
        return value
    raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:60]}")


def format_number(value: int | float | complex) -> str:
    """`value` as the calculator prints it: integers exactly, integral floats without `.0`."""
    if isinstance(value, complex):
        raise CalculatorError("complex result")
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


@TOOLS.register("calculator")
class Calculator(Tool):
    """Evaluates one arithmetic expression."""

    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 123 * 456"}},
                "required": ["expression"],
            },
        },
    }

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """The expression's value as text, or `error: ...` with ok=False."""
        try:
            return ToolResult(format_number(evaluate(arguments["expression"])))
        except CalculatorError as exc:
            return ToolResult(f"error: {exc}", ok=False)
