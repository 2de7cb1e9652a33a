"""Shared by the launch tests (test_slurm_*.py, test_multinode_run.py): the tiny GRPO recipe they
run (tiny random model, arithmetic prompts, transformers rollout on CPU, two steps) and the check
that a job left no process behind.
"""

import time
from pathlib import Path

import yaml

from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.utils.tiny_model import make_tiny_model

TOTAL_STEPS = 2


def write_tiny_recipe(work_dir: Path, output_dir: Path) -> Path:
    """Writes the tiny model, arithmetic parquet files and a recipe using them; returns the recipe.
    trainer.nnodes / n_gpus_per_node / use_gpu are left to the launcher."""
    model_dir = make_tiny_model(work_dir / "tiny_model", num_layers=2, hidden_size=64, intermediate_size=128)
    data = write_arith_parquet(work_dir / "arith", ArithConfig(num_train=32, num_test=4))
    recipe = {
        "model": {"path": str(model_dir)},
        "data": {
            "train_files": [str(data["train"])],
            "val_files": [str(data["test"])],
            "max_prompt_length": 32,
            "train_batch_size": 2,
        },
        "actor": {
            "optim": {"lr": 1.0e-4},
            "update": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size": 2},
            "log_prob_micro_batch_size": 2,
        },
        "rollout": {"name": "hf", "response_length": 8, "sampling": {"n": 2}},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "output_dir": str(output_dir),
            "total_training_steps": TOTAL_STEPS,
            "logger": ["console"],
            "resume_mode": "disable",
        },
    }
    path = work_dir / "tiny_grpo.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def processes_with_env(marker: str) -> list[str]:
    """Command lines of live processes whose environment contains `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return found


def assert_nothing_left(token: str, timeout_s: float = 300) -> None:
    """Every process of the job carries its Ray token in its environment: none may outlive it.
    Waits up to `timeout_s` (generous: a loaded machine) for the last ones to exit; 0 checks once."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_with_env(f"RAY_AUTH_TOKEN={token}")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left behind by the job: {left}"
