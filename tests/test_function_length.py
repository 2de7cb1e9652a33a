"""Small functions, measured: in hybridflow/ and engines/ the median function (its `def` line to
its last line, docstring included) is at most 10 lines and the 90th percentile at most 25."""

import ast
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def function_lengths(*packages: str) -> list[int]:
    lengths = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lengths.append(node.end_lineno - node.lineno + 1)
    return sorted(lengths)


def test_median_and_90th_percentile_stay_small():
    lengths = function_lengths("hybridflow", "engines")
    median, p90 = statistics.median(lengths), lengths[int(0.9 * len(lengths))]
    assert len(lengths) > 500, "the walk found too few functions to measure"
    assert median <= 10 and p90 <= 25, f"median {median}, 90th percentile {p90} lines"
