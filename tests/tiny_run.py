"""A short GRPO run of recipes/quickstart.yaml on a 2-layer tiny model and arithmetic prompts (2 CPU
workers, 4 prompts x 2 responses of 8 tokens a step): `overrides` for a run in process
(tests/recipe_runs.py) where the test is about the run, `command` and `environment` for the tests
that watch how a run's process ends (tests/test_run_lifecycle.py, tests/test_disk_full.py)."""

import os
from pathlib import Path

from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def tiny_run_inputs(root: Path) -> dict:
    """The model and data under `root`; `root` is also on the run's PYTHONPATH (reward modules)."""
    data = write_arith_parquet(root / "data", ArithConfig(num_train=32, num_test=8, seed=3))
    return {"root": root, "model": make_tiny_model(root / "tiny", num_layers=2), "data": data}


RECIPE = "recipes/quickstart.yaml"


def command(local: dict, output_dir: Path, *extra: str) -> list[str]:
    """scripts/run_recipe.sh with the run's recipe and `overrides`."""
    script, recipe = str(ROOT / "scripts/run_recipe.sh"), str(ROOT / RECIPE)
    return ["bash", script, recipe, *overrides(local, output_dir, *extra)]


def overrides(local: dict, output_dir: Path, *extra: str) -> list[str]:
    """The run's settings on the command line, then `extra`."""
    return [
        f"model.path={local['model']}",
        f"data.train_files=[{local['data']['train']}]",
        f"data.val_files=[{local['data']['test']}]",
        "data.train_batch_size=4", "rollout.sampling.n=2", "rollout.response_length=8",
        "actor.update.ppo_mini_batch_size=8", "actor.update.ppo_micro_batch_size=4",
        "actor.log_prob_micro_batch_size=8",
        "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.logger=[console]",
        f"trainer.output_dir={output_dir}", *extra,
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
