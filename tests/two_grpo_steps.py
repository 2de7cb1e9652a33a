"""Two GRPO steps of the tiny model on one CPU process (recipes/gsm8k_grpo.yaml on tests/gsm8k_tiny.py's
inputs), as the runs that check a policy loss or an advantage estimator end to end take them:
`small_run` the overrides, `trained_steps` the check that both steps trained."""

import json
import math
from pathlib import Path

from gsm8k_tiny import cpu_overrides


def small_run(local: dict, out: Path) -> list[str]:
    """The GRPO recipe on one CPU process: 2 steps of 4 prompts x 2 responses, one update each, no
    reference, validation or checkpoint."""
    return [
        *cpu_overrides(local, out, tp=1),
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=8",
        "actor.update.ppo_micro_batch_size=4",
        "actor.update.use_kl_loss=false",
        "actor.update.use_dynamic_bsz=false",
    ]


def trained_steps(out: Path) -> list[dict]:
    """The two steps' metrics, each with a finite policy loss and a nonzero gradient."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2], records
    for record in steps:
        assert math.isfinite(record["actor/pg_loss"]), record
        assert record["actor/grad_norm"] > 0, record
    return steps
