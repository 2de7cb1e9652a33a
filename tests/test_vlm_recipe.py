"""recipes/vlm_quickstart.yaml end to end through scripts/run_recipe.sh, shrunk to 2 steps on the
tiny LLaVA-shaped model and the shape-counting images (2 CPU processes, actor TP 2):

- the engine generates from each prompt's pixels: its log-probs of its samples equal the actor's
  (mismatch/kl_k3 ~ 0; without the images the engine generated from other prompts and kl_k3 was
  about 1), and validation runs;
- the checkpoint of step 2 resumes for a third step, and the final export loads in transformers as
  a LLaVA model whose weights moved from the start's.
"""

import pytest
import torch
from hf_weights import load_hf_tensors
from process_group import run_recipe_script

from hybridflow.data.shapes import ShapesConfig, write_shapes_parquet
from hybridflow.utils.tiny_vlm import make_tiny_vlm
from hybridflow.utils.tracking import read_metrics

pytestmark = pytest.mark.slow


# The random model never answers, so the rule reward would give every sample 0 and GRPO no gradient:
# a reward that varies with the response's length gives the update something to follow.
VARYING_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str) % 2)
"""


def run(tmp_path, out, steps: int):
    data = write_shapes_parquet(tmp_path / "data", ShapesConfig(num_train=16, num_test=4))
    (tmp_path / "varying_reward.py").write_text(VARYING_REWARD)
    overrides = [
        f"model.path={tmp_path / 'vlm'}",
        f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]",
        "data.train_batch_size=4", "rollout.sampling.n=2", "rollout.response_length=8",
        "actor.update.ppo_mini_batch_size=8", "actor.update.ppo_micro_batch_size=4",
        "actor.log_prob_micro_batch_size=8", f"trainer.total_training_steps={steps}",
        "trainer.test_freq=2", "trainer.save_freq=2", "trainer.logger=[console]", f"trainer.output_dir={out}",
        "reward.custom_fn=varying_reward.score",
    ]  # fmt: skip
    env = {"PYTHONPATH": str(tmp_path)}
    done = run_recipe_script("recipes/vlm_quickstart.yaml", overrides, timeout=900, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_vlm_recipe_trains_on_image_prompts_resumes_and_exports(tmp_path):
    make_tiny_vlm(tmp_path / "vlm")
    out = tmp_path / "out"
    run(tmp_path, out, steps=2)
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    for step in (1, 2):
        assert records[step]["mismatch/kl_k3"] < 1e-4, records[step]
    assert "val/shapes/accuracy" in records[2]  # validation generated from the images too
    log = run(tmp_path, out, steps=3)
    assert "resumed from" in log and "global_step_2" in log, log[-3000:]
    assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == 3

    from transformers import LlavaForConditionalGeneration

    exported = LlavaForConditionalGeneration.from_pretrained(out / "hf")
    assert exported.config.vision_config is not None
    start, end = load_hf_tensors(tmp_path / "vlm"), load_hf_tensors(out / "hf")
    assert sorted(start) == sorted(end)
    projector = "multi_modal_projector.linear_1.weight"
    assert not torch.equal(start[projector], end[projector]), "the projector did not train"
    tower = "vision_tower.embeddings.patch_embedding.weight"
    assert torch.equal(start[tower], end[tower]), "the frozen vision tower moved"
