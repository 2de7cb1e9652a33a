"""Arithmetic data: answers are correct and in GSM8K form, splits are disjoint and seeded, the
parquet files hold the GSM8K row layout."""

import re

import pyarrow.parquet as pq
import pytest

from hybridflow.data.arith import ArithConfig, make_splits, solve, write_arith_parquet


def test_solve_writes_working_and_gsm8k_final_line():
    assert solve(23, "+", 48) == "23+48=71\n#### 71"
    assert solve(12, "-", 30) == "12-30=-18\n#### -18"
    assert solve(12, "*", 11) == "12*11=132\n#### 132"


def test_rows_are_correct_and_in_gsm8k_layout():
    splits = make_splits(ArithConfig(num_train=300, num_test=50, operators=["+", "-"], seed=1))
    for row in splits["train"] + splits["test"]:
        question = row["prompt"][0]["content"]
        a, op, b = re.fullmatch(r"What is (\d+)([+-])(\d+)\?", question).groups()
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(expected)}
        assert row["extra_info"]["answer"].endswith(f"#### {expected}")
        assert row["data_source"] == "arith"
        assert row["prompt"][0]["role"] == "user"


def test_test_split_is_disjoint_from_train_and_seeded():
    cfg = ArithConfig(num_train=2000, num_test=100, min_operand=10, max_operand=40, seed=7)
    splits = make_splits(cfg)
    questions = {s: {r["extra_info"]["question"] for r in rows} for s, rows in splits.items()}
    assert len(questions["test"]) == 100  # no duplicate test problems
    assert not questions["test"] & questions["train"]
    assert make_splits(cfg) == splits
    assert make_splits(ArithConfig(num_train=2000, num_test=100, max_operand=40, seed=8)) != splits


def test_parquet_round_trip(tmp_path):
    cfg = ArithConfig(num_train=64, num_test=16, seed=3)
    paths = write_arith_parquet(tmp_path, cfg)
    for split, path in paths.items():
        rows = pq.read_table(path).to_pylist()
        assert rows == make_splits(cfg)[split]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"operators": ["/"]}, "operators must be a non-empty subset"),
        ({"min_operand": 50, "max_operand": 10}, "min_operand <= max_operand"),
        ({"num_test": 100, "min_operand": 1, "max_operand": 3}, "num_test=100 leaves no problems"),
        ({"num_train": 0}, "must be positive"),
    ],
)
def test_bad_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_splits(ArithConfig(**kwargs))
