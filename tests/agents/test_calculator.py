"""The calculator tool: exact results with Python's precedence, and ToolError for everything
outside its whitelist or limits."""

import asyncio

import pytest

from hybridflow.agents.tools import Calculator, ToolError
from hybridflow.agents.tools.calculator import MAX_EXPONENT, evaluate, format_number


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("10 - 4 - 3", "3"),  # left-associative
        ("2 ** 3 ** 2", "512"),  # right-associative
        ("-3 ** 2", "-9"),  # the power binds tighter than unary minus
        ("(-3) ** 2", "9"),
        ("-7 + -8", "-15"),
        ("--5", "5"),
        ("+5 - -5", "10"),
        ("123 * 456", "56088"),
        ("987 * 654 - 321", "645177"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),  # a whole float prints without '.0'
        ("-7 // 2", "-4"),  # floor division
        ("-7 % 3", "2"),
        ("2 ** -2", "0.25"),
        ("0.1 + 0.2", "0.3"),
        ("1e3 * 2", "2000"),
        ("2 / 3", "0.666666666666667"),
        ("2 ** 100", "1267650600228229401496703205376"),  # integers stay exact
        ("  ( 1 + 2 )  ", "3"),
    ],
)
def test_calculator_evaluates_with_python_precedence(expression, expected):
    assert asyncio.run(Calculator().call({"expression": expression})) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "'x' is not allowed"),
        ("abs(-1)", "'abs\\(-1\\)' is not allowed"),
        ("__import__('os').system('true')", "is not allowed"),
        ("(1).real", "is not allowed"),
        ("'a' * 3", "is not allowed"),
        ("[1] * 3", "is not allowed"),
        ("1 < 2", "is not allowed"),
        ("True + 1", "'True' is not allowed"),
        ("1j * 2", "is not allowed"),
        ("lambda: 1", "is not allowed"),
        ("2 ^ 3", "write \\*\\* instead"),
        ("2 ** 1000", f"at most {MAX_EXPONENT}"),
        ("9 ** 9 ** 9", f"at most {MAX_EXPONENT}"),  # refused before computing 9 ** 387420489
        ("10 ** 90 * 10 ** 90", "more than 100 digits"),
        ("99 ** 99", "more than 100 digits"),
        ("1e308 * 10", "more than 100 digits"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "cannot parse"),
        ("1" * 201, "at most 200"),
    ],
)
def test_calculator_refuses_with_a_tool_error(expression, message):
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


def test_format_number_keeps_large_floats_in_exponent_form():
    assert format_number(1e20) == "1e+20"
    assert format_number(-2.0) == "-2"
