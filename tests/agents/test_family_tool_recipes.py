"""recipes/gsm8k_tool_grpo.yaml trains two GRPO steps of a two-turn tool episode on each tool-call
family's chat template (template_families.py, tool_call_templates.py: one family per format), in
process on this pytest worker's Ray cluster (tests/recipe_runs.py), over the rollout workers' vLLM
engines. The model (family_models.py) is fitted to write the family's own call of the calculator
and then its answer; sampled at a low temperature it does, so every trajectory is known: the
loop reads the call in the format detected from the template, runs the real calculator, and the
batch the trainer scores holds the sampled ids, then the tool response as the template renders it
(masked 0), then the answer: prompt, call and tool response decode to the template's rendering of
that conversation."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from family_models import ANSWERS, CALL_TURN, QUESTION, RUN_FAMILIES, SCHEMAS, episode, make_family_models
from made_once import made_once, run_shared_dir
from recipe_runs import run_recipe_in_process
from transformers import AutoTokenizer

STEPS, N = 2, 2


def write_rows(path) -> str:
    row = {"prompt": QUESTION, "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "408"}}
    pq.write_table(pa.Table.from_pylist([row] * 2), path)
    return str(path)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory, worker_id):
    """Fitted once per pytest run (made_once): under pytest-xdist the first worker to ask fits them."""
    root = run_shared_dir(tmp_path_factory, worker_id) / "family_models"
    made_once(root, write_family_models)
    return json.loads((root / "fitted.json").read_text())


def write_family_models(root: Path) -> None:
    """The family models under `root`, and fitted.json: {family name: model directory}."""
    dirs = make_family_models(root)
    (root / "fitted.json").write_text(json.dumps({name: str(path) for name, path in dirs.items()}))


@pytest.fixture
def scored_batches(monkeypatch):
    """The prompts, responses and response_mask of every batch the trainer scores."""
    from hybridflow.trainer import ppo_trainer

    batches, score = [], ppo_trainer.compute_rewards

    def recording(batch, tokenizer, reward_fn):
        batches.append({k: batch.batch[k].clone() for k in ("prompts", "responses", "response_mask")})
        return score(batch, tokenizer, reward_fn)

    monkeypatch.setattr(ppo_trainer, "compute_rewards", recording)
    return batches


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("family", RUN_FAMILIES, ids=[f.name for f in RUN_FAMILIES])
def test_a_two_turn_tool_episode_trains_two_grpo_steps_on_the_familys_template(
    family, family_models, scored_batches, tmp_path
):
    model = family_models[family.name]
    rows = write_rows(tmp_path / "train.parquet")
    overrides = [
        f"model.path={model}",
        f"data.train_files=[{rows}]",
        f"data.val_files=[{rows}]",
        "data.max_prompt_length=768",
        "data.train_batch_size=1",
        "actor.megatron.tensor_model_parallel_size=1",
        "actor.megatron.params_dtype=float32",
        "actor.update.use_dynamic_bsz=false",
        f"actor.update.ppo_mini_batch_size={N}",
        "actor.update.ppo_micro_batch_size=2",
        "actor.log_prob_micro_batch_size=2",
        "ref.log_prob_micro_batch_size=2",
        "rollout.dtype=float32",
        "rollout.response_length=256",
        f"rollout.sampling.n={N}",
        "rollout.sampling.temperature=0.05",  # the fitted turns, by a margin of 20 nats at least
        "trainer.use_gpu=false",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={STEPS}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.logger=[console]",
        f"trainer.output_dir={tmp_path / 'out'}",
    ]
    done = run_recipe_in_process("recipes/gsm8k_tool_grpo.yaml", overrides)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    tokenizer = AutoTokenizer.from_pretrained(model)
    expected = episode(tokenizer)
    sampled = expected["call"] + expected["appended"] + expected["final"]
    mask = [1] * len(expected["call"]) + [0] * len(expected["appended"]) + [1] * len(expected["final"])
    assert len(scored_batches) == STEPS
    for batch in scored_batches:
        assert batch["responses"].size(0) == N
        for prompt, response, response_mask in zip(*batch.values(), strict=True):
            assert prompt.tolist()[-len(expected["prompt"]) :] == expected["prompt"]
            assert response.tolist()[: len(sampled)] == sampled
            assert response_mask.tolist()[: len(sampled) + 1] == [*mask, 0]
    # the appended ids are the template's own rendering of the tool response, in context
    conversation = tokenizer.apply_chat_template(
        [*QUESTION, CALL_TURN, *ANSWERS], tools=SCHEMAS, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(expected["prompt"] + expected["call"] + expected["appended"]) == conversation

    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step") in (1, 2) and "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["agent/turns/mean"] == 2 and record["agent/tool_calls/mean"] == 1, record
        assert record["agent/tool_errors/mean"] == 0 and record["reward/mean"] == 1.0, record
        assert record["agent/tool_tokens/mean"] == len(expected["appended"]), record
