"""The GSM8K recipes made tiny for CPU runs: a random tiny model, real GSM8K rows prepared by
scripts/prepare_gsm8k.py, and a reward module that gives a random model a signal.

A random tiny model never answers GSM8K, so every rule reward would be 0 and no update would move
the policy; the runs use a custom reward (the share of digits in the response, loaded by dotted
path) so that advantages, gradients and the policy-reference KL after the first update are nonzero.
tests/conftest.py's `gsm8k_local` fixture builds the inputs once per pytest run."""

import os
import subprocess
import sys
from pathlib import Path

from shared_data import gsm8k_dir

from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]

DIGIT_REWARD = """
def digit_share(data_source, solution_str, ground_truth, extra_info):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


def seven(data_source, solution_str, ground_truth, extra_info):
    return 7.0
"""


def make_gsm8k_inputs(root: Path) -> None:
    """Writes under `root` what gsm8k_inputs names."""
    prepare = [ROOT / "scripts/prepare_gsm8k.py", "--local_dir", gsm8k_dir(), "--out", root / "gsm8k"]
    subprocess.run([sys.executable, *prepare], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    (root / "digit_reward.py").write_text(DIGIT_REWARD)
    make_tiny_model(root / "tiny")


def gsm8k_inputs(root: Path) -> dict:
    """Under `root`: GSM8K parquet files (`data`), the tiny model (`model`) and digit_reward.py
    (`root`, the runs' pythonpath)."""
    return {"model": str(root / "tiny"), "data": root / "gsm8k", "root": root}


# the actor on one process and a rollout pool of one process beside it (trainer.placement)
ACTOR_AND_POOL_OF_ONE = [
    "trainer.n_gpus_per_node=1",
    "trainer.placement=disaggregated",
    "trainer.rollout_pool.n_gpus_per_node=1",
]


def cpu_overrides(local: dict, output_dir: Path, tp: int) -> list[str]:
    """The GPU recipe made tiny: 2 CPU processes, batch 4, 16-token responses, 2 steps."""
    return [
        f"model.path={local['model']}",
        f"data.train_files=[{local['data'] / 'train.parquet'}]",
        f"data.val_files=[{local['data'] / 'test.parquet'}]",
        "data.max_prompt_length=400",
        "data.train_batch_size=4",
        "data.train_max_samples=64",
        "data.val_max_samples=6",
        "reward.custom_fn=digit_reward.digit_share",
        "actor.optim.lr=1e-3",
        f"actor.megatron.tensor_model_parallel_size={tp}",
        "actor.megatron.params_dtype=float32",
        "actor.update.ppo_micro_batch_size=2",
        "actor.log_prob_micro_batch_size=2",
        "ref.log_prob_micro_batch_size=2",
        "rollout.name=hf",
        "rollout.tensor_model_parallel_size=1",
        "rollout.dtype=float32",
        "rollout.response_length=16",
        "trainer.use_gpu=false",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        "trainer.logger=[console]",
        f"trainer.output_dir={output_dir}",
    ]
