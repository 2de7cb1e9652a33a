"""`Calculator`: a tool that evaluates arithmetic, parsed with `ast` and evaluated node by node
over a whitelist (numbers, + - * / // % **, unary minus and plus, parentheses). No eval, no
names, no calls, no attributes. Python's semantics: `/` is true division, `//` and `%` floor.
Limits keep every evaluation cheap: the expression's length, the exponent, and the size of every
intermediate result.
"""

import ast
import math
import operator
from typing import Any, ClassVar

from hybridflow.agents.tools.base import ToolError

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 128
MAX_RESULT_DIGITS = 100
MAX_MAGNITUDE = 10**MAX_RESULT_DIGITS
# Floats are shown with 15 significant digits, the most a double holds exactly: 0.1 + 0.2 is 0.3.
FLOAT_DIGITS = 15
EXACT_FLOAT_INTEGERS = 2**53

BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
ALLOWED = "numbers, + - * / // % ** and parentheses"


class Calculator:
    """Evaluates the `expression` argument; returns the number as text."""

    name = "calculator"
    description = (
        f"Evaluate an arithmetic expression exactly: {ALLOWED}, e.g. (127 * 48 - 5) / 3. "
        "Use ** for powers. Returns the result."
    )
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 23 * (4 + 5) ** 2"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict[str, Any]) -> str:
        return format_number(evaluate(arguments["expression"]))


def evaluate(expression: str) -> int | float:
    """The value of `expression`; ToolError for anything outside the whitelist or the limits."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(
            f"the expression is {len(expression)} characters long; at most {MAX_EXPRESSION_CHARS}"
        )
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse {expression!r}: {err.msg}") from err
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        return _bounded(_apply(node.op, _evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError(f"'{ast.unparse(node)}': ^ is not a power here, write ** instead")
    raise ToolError(f"'{ast.unparse(node)}' is not allowed: use only {ALLOWED}")


def _apply(op: ast.operator, left: int | float, right: int | float) -> int | float:
    if isinstance(op, ast.Pow):
        _check_power(left, right)
    try:
        return BINARY[type(op)](left, right)
    except ZeroDivisionError as err:
        raise ToolError("division by zero") from err
    except OverflowError as err:
        raise ToolError(f"the result has more than {MAX_RESULT_DIGITS} digits") from err


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuses a power before computing it: an exact integer power could take seconds to compute."""
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"the exponent {exponent} is too large: at most {MAX_EXPONENT} in absolute value")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_RESULT_DIGITS:
        raise ToolError(f"the result has more than {MAX_RESULT_DIGITS} digits")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise ToolError("the result is not a real number")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"the result has more than {MAX_RESULT_DIGITS} digits")
    return value


def format_number(value: int | float) -> str:
    """Integers exactly; floats to FLOAT_DIGITS significant digits, without '.0' when integral."""
    if isinstance(value, int):
        return str(value)
    rounded = float(f"{value:.{FLOAT_DIGITS}g}")
    if rounded.is_integer() and abs(rounded) < EXACT_FLOAT_INTEGERS:
        return str(int(rounded))
    return repr(rounded)
