"""What the async-RL recipe tests read back from a run's output directory."""

import json
from pathlib import Path

from hf_weights import load_hf_tensors

TIMING_PREFIXES = ("timing/", "throughput/", "perf/")  # wall-clock: differ between equal runs


def trained_steps(out: Path) -> list[dict]:
    """The training steps' metrics records (not validation-only ones), wall-clock keys left out."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [
        {key: value for key, value in r.items() if not key.startswith(TIMING_PREFIXES)}
        for r in records
        if "reward/mean" in r
    ]


def exported(out: Path) -> dict:
    """Every tensor of the run's Hugging Face export; fails when there is none (never compare nothing)."""
    return load_hf_tensors(out / "hf")
