"""What the recipe tests read back from a run's output directory."""

import json
from pathlib import Path

from hf_weights import load_hf_tensors

TIMING_PREFIXES = ("timing/", "throughput/", "perf/")  # wall-clock: differ between equal runs
# what an engine restart adds to a step's metrics: its count, seconds and check, and the restarted
# engine's load of the current weights, which counts as a transfer (its bytes too)
RESTART_KEYS = (
    "rollout/engine_restarts", "rollout/restart_seconds", "rollout/restart_log_prob_diff",
    "async/weight_syncs", "weight_sync/bytes_sent", "weight_sync/bytes_full",
)  # fmt: skip


def trained_steps(out: Path) -> list[dict]:
    """The training steps' metrics records (not validation-only ones), wall-clock keys left out."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [
        {key: value for key, value in r.items() if not key.startswith(TIMING_PREFIXES)}
        for r in records
        if "reward/mean" in r
    ]


def step_records(out: Path) -> list[dict]:
    """Every step's metrics record, as written."""
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r]


def without_restarts(records: list[dict]) -> list[dict]:
    """The records less what engine restarts add to them (RESTART_KEYS) and what depends on which
    process generated a sample (`placement_dependent`)."""
    kept = [{k: v for k, v in r.items() if k not in RESTART_KEYS} for r in records]
    return [{k: v for k, v in r.items() if not placement_dependent(k)} for r in kept]


def placement_dependent(key: str) -> bool:
    """Per-replica metrics depend on the pool's size, prefix-cache hit rates on what each engine's
    cache held: a restart's lost call, generated again, meets the survivors' caches holding it."""
    return key.startswith("rollout/replica_") or key.endswith("prefix_cache_hit_rate")


def exported(out: Path) -> dict:
    """Every tensor of the run's Hugging Face export; fails when there is none (never compare nothing)."""
    return load_hf_tensors(out / "hf")


def without_uids(step: list[dict]) -> list[dict]:
    """The step's samples but their group ids (drawn at random in each run), in the batch's order."""
    return [{key: value for key, value in record.items() if key != "uid"} for record in step]
