"""The VLM quickstart's two recipes end to end, run in process (tests/recipe_runs.py), shrunk to a few steps
on the tiny LLaVA-shaped model and the shape-counting images (2 CPU processes, actor TP 2):

- recipes/vlm_quickstart_sft.yaml: supervised steps on the image rows' reference answers lower the
  loss, and the warm start is exported;
- recipes/vlm_quickstart.yaml from that export, two steps on vLLM's CPU build (its Transformers
  backend, engines/rollout/vllm_images.py), then the checkpoint of step 2 resumed for a third on
  the recipe's hf engine: each engine generates from each prompt's pixels with the weights synced
  from the actor, so its log-probs of its samples equal the actor's (mismatch/kl_k3 ~ 0; when the
  driver handed the engine the prompt tensors only, kl_k3 was about 1), and validation runs; the
  final export loads in transformers as a LLaVA model whose projector moved and whose frozen tower
  did not. The model has 2 heads of 32 (vLLM's CPU attention has no kernel for the default's 16).
"""

import pytest
import torch
from hf_weights import load_hf_tensors
from recipe_runs import run_recipe_in_process

from hybridflow.data.shapes import ShapesConfig, write_shapes_parquet
from hybridflow.utils.tiny_vlm import make_tiny_vlm
from hybridflow.utils.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

# A few warm-start steps do not make the tiny model count, so the rule reward would give every
# sample 0 and GRPO no gradient: a reward that varies with the response's length gives the update
# something to follow.
VARYING_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str) % 2)
"""


def run(recipe: str, tmp_path, model, out, *overrides: str) -> str:
    data = write_shapes_parquet(tmp_path / "data", ShapesConfig(num_train=16, num_test=4))
    common = [
        f"model.path={model}", f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]",
        "data.train_batch_size=4", "actor.update.ppo_micro_batch_size=4", "trainer.logger=[console]",
        f"trainer.output_dir={out}",
    ]  # fmt: skip
    done = run_recipe_in_process(recipe, [*common, *overrides], pythonpath=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


VLLM = ("rollout.name=vllm", "rollout.vllm.model_impl=transformers")


def grpo(tmp_path, model, out, steps: int, *engine: str) -> str:
    return run(
        "recipes/vlm_quickstart.yaml", tmp_path, model, out,
        "rollout.sampling.n=2", "actor.update.ppo_mini_batch_size=8", "actor.log_prob_micro_batch_size=8",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=2", "trainer.save_freq=2",
        "reward.custom_fn=varying_reward.score", *engine,
    )  # fmt: skip


def test_vlm_warm_start_then_grpo_on_image_prompts_resumes_and_exports(tmp_path):
    (tmp_path / "varying_reward.py").write_text(VARYING_REWARD)
    sft, model = tmp_path / "sft", make_tiny_vlm(tmp_path / "vlm", text_heads=2, text_kv_heads=1)
    run(
        "recipes/vlm_quickstart_sft.yaml", tmp_path, model, sft,
        "trainer.total_training_steps=4", "trainer.test_freq=0", "actor.optim.lr_warmup_iters=0",
    )  # fmt: skip
    losses = [r["sft/loss"] for r in read_metrics(sft / "metrics.jsonl") if "sft/loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses

    out = tmp_path / "grpo"
    grpo(tmp_path, sft / "hf", out, 2, *VLLM)
    log = grpo(tmp_path, sft / "hf", out, 3)
    assert "resumed from" in log and "global_step_2" in log, log[-3000:]
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert max(records) == 3
    for step in (1, 2, 3):  # vllm, vllm, then hf
        assert records[step]["mismatch/kl_k3"] < 1e-4, records[step]
    assert "val/shapes/accuracy" in records[2]  # validation generated from the images too

    from transformers import LlavaForConditionalGeneration

    assert LlavaForConditionalGeneration.from_pretrained(out / "hf").config.vision_config is not None
    start, end = load_hf_tensors(sft / "hf"), load_hf_tensors(out / "hf")
    assert sorted(start) == sorted(end)
    projector, tower = (
        "multi_modal_projector.linear_1.weight",
        "vision_tower.embeddings.patch_embedding.weight",
    )
    assert not torch.equal(start[projector], end[projector]), "the projector did not train"
    assert torch.equal(start[tower], end[tower]), "the frozen vision tower moved"
    assert torch.equal(load_hf_tensors(tmp_path / "vlm")[tower], end[tower])
