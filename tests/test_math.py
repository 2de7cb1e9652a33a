"""MATH-style data and reward: scripts/prepare_math.py on local records made here (jsonl, and the
same records as a cached Hub dataset with HF_HUB_OFFLINE=1), and the math-verify reward comparing
answers symbolically."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hub_cache import fill_hub_cache

from hybridflow.reward.math_reward import compute_score, last_boxed
from hybridflow.reward.registry import rule_reward_fn

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "prepare_math.py"
RECORDS = {
    "train": [
        {
            "problem": "Simplify $\\frac{2}{4}$.",
            "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$.",
            "level": "Level 1",
            "type": "Prealgebra",
        },
        {"problem": "Expand $(x+1)^2$.", "solution": "We get $\\boxed{x^{2}+2x+1}$."},
        {"problem": "Is there an answer?", "solution": "No box in this solution."},
    ],
    "test": [{"problem": "What is $\\sqrt{8}$?", "answer": "2\\sqrt{2}", "solution": "ignored"}],
}


def test_last_boxed_keeps_nested_braces_and_rejects_a_cut_box():
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{a}{b^{2}}} done") == "\\frac{a}{b^{2}}"
    assert last_boxed("\\boxed{\\frac{1}{2") is None
    assert last_boxed("no answer") is None


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),  # a decimal equals the fraction
        ("$\\boxed{\\dfrac12}$", "\\frac{1}{2}", 1.0),
        ("$\\boxed{(x+1)^2}$", "x^{2}+2x+1", 1.0),  # equal expressions, different strings
        ("$\\boxed{\\sqrt{8}}$", "2\\sqrt{2}", 1.0),
        ("$\\boxed{2}$", "\\frac{1}{2}", 0.1),  # boxed but wrong: the format score
        ("the answer is 1/2", "\\frac{1}{2}", 0.0),  # no boxed answer
    ],
)
def test_math_reward_compares_answers_symbolically(response, truth, expected):
    assert compute_score(response, truth, format_score=0.1) == expected


def run_prepare(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_prepare_math_from_local_jsonl_and_from_the_hub_cache(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    hub_files = {}
    for split, records in RECORDS.items():
        (local / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        pq.write_table(pa.Table.from_pylist(records), tmp_path / f"{split}.parquet")
        hub_files[f"data/{split}-00000-of-00001.parquet"] = tmp_path / f"{split}.parquet"
    result = run_prepare("--local_dir", local, "--out", tmp_path / "from_local")
    assert result.returncode == 0, result.stderr
    assert "wrote 2 rows" in result.stdout and "(1 without an answer skipped)" in result.stdout
    train = pq.read_table(tmp_path / "from_local" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in train] == ["\\frac{1}{2}", "x^{2}+2x+1"]
    assert train[0]["data_source"] == "math" and train[0]["extra_info"]["level"] == "Level 1"
    assert train[0]["prompt"][0]["content"].startswith("Simplify $\\frac{2}{4}$. Reason step by step")
    test = pq.read_table(tmp_path / "from_local" / "test.parquet").to_pylist()
    assert test[0]["reward_model"]["ground_truth"] == "2\\sqrt{2}"  # the answer field wins

    # the rows' data_source picks the math-verify rule in the built-in reward
    score = rule_reward_fn()("math", "thus $\\boxed{0.5}$", train[0]["reward_model"]["ground_truth"], {})
    assert score == 1.0

    hf_home = tmp_path / "hf_home"
    fill_hub_cache(hf_home, "DigitalLearningGmbH/MATH-lighteval", hub_files, repo_type="dataset")
    offline = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    result = run_prepare("--out", tmp_path / "from_hub", env=offline)
    assert result.returncode == 0, result.stderr
    for split in RECORDS:
        from_hub = pq.read_table(tmp_path / "from_hub" / f"{split}.parquet").to_pylist()
        assert from_hub == pq.read_table(tmp_path / "from_local" / f"{split}.parquet").to_pylist()


def test_prepare_math_names_what_is_missing(tmp_path):
    result = run_prepare("--local_dir", tmp_path, "--out", tmp_path / "out")
    assert result.returncode != 0 and "has neither train.jsonl nor train.parquet" in result.stderr
    assert not (tmp_path / "out").exists()
