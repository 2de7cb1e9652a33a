"""A short GRPO run of recipes/quickstart.yaml through scripts/run_recipe.sh on a 2-layer tiny
model and arithmetic prompts (2 CPU workers, 4 prompts x 2 responses of 8 tokens a step), for the
tests that watch how a run ends (tests/test_run_lifecycle.py, tests/test_disk_full.py)."""

import os
from pathlib import Path

from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def tiny_run_inputs(root: Path) -> dict:
    """The model and data under `root`; `root` is also on the run's PYTHONPATH (reward modules)."""
    data = write_arith_parquet(root / "data", ArithConfig(num_train=32, num_test=8, seed=3))
    return {"root": root, "model": make_tiny_model(root / "tiny", num_layers=2), "data": data}


def command(local: dict, output_dir: Path, *overrides: str) -> list[str]:
    return [
        "bash", str(ROOT / "scripts/run_recipe.sh"), str(ROOT / "recipes/quickstart.yaml"),
        f"model.path={local['model']}",
        f"data.train_files=[{local['data']['train']}]",
        f"data.val_files=[{local['data']['test']}]",
        "data.train_batch_size=4", "rollout.sampling.n=2", "rollout.response_length=8",
        "actor.update.ppo_mini_batch_size=8", "actor.update.ppo_micro_batch_size=4",
        "actor.log_prob_micro_batch_size=8",
        "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.logger=[console]",
        f"trainer.output_dir={output_dir}", *overrides,
    ]  # fmt: skip


def environment(local: dict, marker: str, **extra: str) -> dict:
    """A fresh local Ray cluster; every process of the run carries `marker` in its environment."""
    return {
        **os.environ,
        "RAY_ADDRESS": "local",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": str(local["root"]),
        "HYBRIDFLOW_TEST_RUN": marker,
        **extra,
    }
