"""reasoning-gym tasks as a recipe's data source (data.source.reasoning_gym, docs/reasoning-gym.md):
the generated sets are deterministic and disjoint, a response is scored through the rule reward
by its task's own score_answer, a bad source is refused before Ray starts naming the key, and the
small recipe runs two steps with per-task reward and held-out accuracy in its metrics."""

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (requirements.txt pins it)")

import reasoning_gym
from recipe_runs import run_recipe_in_process
from transformers import AutoTokenizer

from hybridflow.checks.recipe import RecipeError, validate_recipe
from hybridflow.config.loader import load_recipe
from hybridflow.config.schema import ReasoningGymConfig
from hybridflow.data.reasoning_gym import SOURCE_PREFIX, make_splits, source_problems
from hybridflow.protocol import DataProto
from hybridflow.reward.manager import sequence_scores
from hybridflow.reward.registry import rule_reward_fn
from hybridflow.trainer.metrics import batch_metrics
from hybridflow.utils.plotting import PLOTS, matching_keys
from hybridflow.utils.tiny_model import make_tiny_model
from hybridflow.utils.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/reasoning_gym_quickstart.yaml"
TWO_OPERANDS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TASKS = ("chain_sum", "basic_arithmetic")


def source(**changes) -> ReasoningGymConfig:
    settings = {
        "tasks": {"chain_sum": 1.0, "basic_arithmetic": 3.0},
        "task_config": {"chain_sum": {"max_terms": 3}},
        "size": 60,
        "val_size": 20,
        "seed": 7,
    }
    return ReasoningGymConfig(**{**settings, **changes})


def questions(rows: list[dict]) -> list[str]:
    return [row["prompt"][-1]["content"] for row in rows]


def test_the_same_settings_make_the_same_rows_and_another_seed_other_rows():
    (first, dropped), (again, _) = make_splits(source()), make_splits(source())
    assert first == again
    other, _ = make_splits(source(seed=8))
    assert questions(other["train"]) != questions(first["train"])
    assert len(first["train"]) + dropped == 60 and len(first["val"]) == 20
    # both tasks drawn, each row a task item with the default system prompt before its question
    assert {row["data_source"] for row in first["train"]} == {SOURCE_PREFIX + task for task in TASKS}
    assert all([m["role"] for m in row["prompt"]] == ["system", "user"] for row in first["train"])


def test_each_row_is_its_task_item_as_reasoning_gym_generates_it():
    """Row i is item i of its task's dataset (made with the split's seed and size), independently
    generated here with reasoning_gym.create_dataset."""
    splits, _ = make_splits(source(system_prompt=None))
    for row in splits["train"][:10]:
        index, task = row["extra_info"]["index"], row["extra_info"]["task"]
        settings = {"max_terms": 3} if task == "chain_sum" else {}
        item = reasoning_gym.create_dataset(task, seed=7, size=60, **settings)[index]
        assert row["prompt"] == [{"role": "user", "content": item["question"]}]
        assert row["extra_info"]["answer"] == f"<answer>{item['answer']}</answer>"


def test_held_out_questions_never_appear_in_training_even_when_few_problems_exist():
    """Two one-digit operands: ~200 distinct questions, so 200 training draws repeat held-out ones;
    those are dropped and counted."""
    settings = source(
        tasks={"chain_sum": 1.0}, task_config={"chain_sum": TWO_OPERANDS}, size=200, val_size=40
    )
    splits, dropped = make_splits(settings)
    held_out = set(questions(splits["val"]))
    assert dropped > 0 and len(splits["train"]) == 200 - dropped
    assert held_out.isdisjoint(questions(splits["train"]))


def tagged(answer: str) -> str:
    return f"working it out... <answer>{answer}</answer>"


def test_responses_are_scored_by_the_task_own_score_answer_through_the_reward_path(tmp_path):
    """Decoded from token ids by the reward manager, a right answer scores 1, a wrong one and an
    untagged one 0, each equal to the task's own score_answer on the item."""
    splits, _ = make_splits(source(size=8, val_size=0, system_prompt=None))
    rows = splits["train"][:4]
    answers = [json.loads(row["reward_model"]["ground_truth"])["answer"] for row in rows]
    texts = [tagged(answers[0]), tagged(str(int(answers[1]) + 1)), answers[2], tagged(f" {answers[3]} ")]
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "tiny"))
    scores = sequence_scores(response_batch(rows, texts, tokenizer), tokenizer, rule_reward_fn())
    assert scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    for row, text, score in zip(rows, texts[:2], scores, strict=False):
        task, index = row["extra_info"]["task"], row["extra_info"]["index"]
        settings = {"max_terms": 3} if task == "chain_sum" else {}
        dataset = reasoning_gym.create_dataset(task, seed=7, size=8, **settings)
        assert dataset.score_answer(text.split("<answer>")[1].split("</answer>")[0], dataset[index]) == score


def response_batch(rows: list[dict], texts: list[str], tokenizer) -> DataProto:
    """A rollout-shaped batch of `texts` as the responses to `rows` (right-padded, EOS masked in)."""
    ids = [
        tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts
    ]
    width = max(map(len, ids))
    responses = torch.full((len(ids), width), tokenizer.pad_token_id)  # (B, R)
    mask = torch.zeros((len(ids), width), dtype=torch.long)  # (B, R)
    for row, row_ids in enumerate(ids):
        responses[row, : len(row_ids)] = torch.tensor(row_ids)
        mask[row, : len(row_ids)] = 1
    return DataProto.from_dict(
        {"responses": responses, "response_mask": mask},
        non_tensors={
            "data_source": [row["data_source"] for row in rows],
            "reward_model": [row["reward_model"] for row in rows],
            "extra_info": [row["extra_info"] for row in rows],
        },
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"tasks": {"chain_sums": 1.0}},
            "data.source.reasoning_gym.tasks has the unknown task 'chain_sums' (weight 1.0); did you mean "
            "'chain_sum'? the available tasks are: ",
        ),
        (
            {"tasks": {"chain_sum": 0.0}},
            "data.source.reasoning_gym.tasks.chain_sum=0.0: a task's weight must be",
        ),
        (
            {"tasks": {"chain_sum": -1.0}},
            "data.source.reasoning_gym.tasks.chain_sum=-1.0: a task's weight must be",
        ),
        ({"size": 0}, "data.source.reasoning_gym.size=0 must be > 0"),
        ({"val_size": -1}, "data.source.reasoning_gym.val_size=-1 must be >= 0"),
        ({"system_prompt": "terse"}, "data.source.reasoning_gym.system_prompt='terse' is not one of"),
        ({"task_config": {"leg_counting": {}}}, "task_config.leg_counting: 'leg_counting' is not in"),
        (
            {"task_config": {"chain_sum": {"max_term": 3}}},
            "task_config.chain_sum has ['max_term'], not settings",
        ),
        ({"task_config": {"chain_sum": {"seed": 3}}}, "task_config.chain_sum has ['seed'], not settings"),
        (
            {"task_config": {"chain_sum": {"min_terms": 0}}},
            "task_config.chain_sum={'min_terms': 0}: chain_sum refuses",
        ),
    ],
)
def test_a_bad_source_is_named_with_its_key_and_value(changes, expected):
    problems = source_problems(source(**changes))
    assert any(problem.startswith(expected) or expected in problem for problem in problems), problems


def test_the_unknown_task_error_lists_every_available_task():
    (problem,) = source_problems(source(tasks={"no_such_task": 1.0}, task_config={}))
    assert all(task in problem for task in reasoning_gym.factory.DATASETS)


@pytest.mark.usefixtures("in_quickstart_working_tree")
def test_the_recipe_check_refuses_a_bad_source_and_source_with_files():
    cfg = load_recipe(
        ROOT / RECIPE,
        ["data.source.reasoning_gym.tasks.chain_sums=1.0", "data.train_files=[x.parquet]"],
    )
    with pytest.raises(RecipeError) as refused:
        validate_recipe(cfg, cuda_available=False)
    message = str(refused.value)
    assert "unknown task 'chain_sums'" in message
    assert "data.train_files names files, but data.source.reasoning_gym generates the prompts" in message


@pytest.mark.usefixtures("in_quickstart_working_tree")
@pytest.mark.parametrize(
    "recipe", ["reasoning_gym_grpo", "reasoning_gym_quickstart", "reasoning_gym_quickstart_sft"]
)
def test_the_shipped_recipes_sources_are_valid_and_the_two_quickstart_stages_share_their_questions(recipe):
    source = load_recipe(ROOT / "recipes" / f"{recipe}.yaml").data.source.reasoning_gym
    assert source.enabled() and source_problems(source) == []
    quickstart = load_recipe(ROOT / RECIPE).data.source.reasoning_gym
    if recipe == "reasoning_gym_quickstart_sft":
        assert source == quickstart  # the warm start learns the format on the questions RL trains on


def batch_of(scores: list[float], sources: list[str]) -> DataProto:
    mask = torch.ones(len(scores), 2)  # (B, R)
    token_scores = torch.zeros(len(scores), 2)  # (B, R)
    token_scores[:, -1] = torch.tensor(scores)
    return DataProto.from_dict(
        {
            "response_mask": mask,
            "attention_mask": torch.ones(len(scores), 5),
            "token_level_scores": token_scores,
            "advantages": torch.zeros(len(scores), 2),
        },
        non_tensors={"data_source": sources},
    )


def test_a_batch_of_several_tasks_reports_each_task_mean_reward_and_plots_it():
    sources = ["reasoning_gym/chain_sum", "reasoning_gym/basic_arithmetic"] * 2 + ["reasoning_gym/chain_sum"]
    metrics = batch_metrics(batch_of([1.0, 0.0, 0.0, 1.0, 0.5], sources))
    assert metrics["reward/reasoning_gym/chain_sum/mean"] == pytest.approx(1.5 / 3)
    assert metrics["reward/reasoning_gym/basic_arithmetic/mean"] == pytest.approx(0.5)
    assert metrics["reward/mean"] == pytest.approx(2.5 / 5)
    reward_plot = next(spec for spec in PLOTS if spec.name == "reward")
    assert matching_keys([{"step": 1, **metrics}], reward_plot.pattern) == [
        "reward/mean",
        "reward/reasoning_gym/chain_sum/mean",
        "reward/reasoning_gym/basic_arithmetic/mean",
    ]
    # one source: its mean is reward/mean, nothing more
    single = batch_metrics(batch_of([1.0, 0.0], ["openai/gsm8k"] * 2))
    assert not [key for key in single if key.startswith("reward/") and key.count("/") > 1]


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, ray_cluster, module_in_quickstart_working_tree):
    """The small recipe for 2 steps from a random tiny model, validating before and after."""
    root = tmp_path_factory.mktemp("reasoning_gym_run")
    overrides = [
        f"model.path={make_tiny_model(root / 'tiny')}",
        "data.source.reasoning_gym.size=64",
        "data.source.reasoning_gym.val_size=8",
        "data.train_batch_size=4",
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=8",
        "actor.update.ppo_micro_batch_size=4",
        "actor.log_prob_micro_batch_size=4",
        "rollout.response_length=8",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=0",
        "trainer.export_hf=false",
        "trainer.logger=[console]",
        f"trainer.output_dir={root / 'out'}",
    ]
    result = run_recipe_in_process(RECIPE, overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return root / "out", result


def test_the_small_recipe_reports_per_task_reward_and_held_out_accuracy(two_step_run):
    out, _ = two_step_run
    records = read_metrics(out / "metrics.jsonl")
    validations = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in validations] == [0, 2]
    for record in validations:
        for task in TASKS:
            assert 0.0 <= record[f"val/reasoning_gym/{task}/accuracy"] <= 1.0
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert any(f"reward/reasoning_gym/{task}/mean" in r for r in steps for task in TASKS)


def test_the_run_generated_its_files_and_the_resolved_recipe_names_them(two_step_run):
    out, result = two_step_run
    data = yaml.safe_load((out / "config.yaml").read_text())["data"]
    train, val = Path(data["train_files"][0]), Path(data["val_files"][0])
    assert train.parent == val.parent and train.parent.parent == out / "data"
    assert train.is_file() and val.is_file()
    assert f"reasoning-gym prompts (chain_sum, basic_arithmetic): {train}" in result.stdout


def test_each_row_draws_its_task_by_weight_from_the_seed():
    """The task draw is reproducible from the seed alone: Random(seed).choices, as the module says."""
    settings = source(system_prompt=None, val_size=0)
    splits, _ = make_splits(settings)
    drawn = random.Random(7).choices(["chain_sum", "basic_arithmetic"], weights=[1.0, 3.0], k=60)
    assert [row["extra_info"]["task"] for row in splits["train"]] == drawn


def test_the_runs_resolved_recipe_checks_as_a_recipe_again(two_step_run):
    """config.yaml names the source and the files it generated: fed back, it is a valid recipe (the
    source's own files, regenerated the same), while other files beside the source stay refused."""
    out, _ = two_step_run
    validate_recipe(load_recipe(out / "config.yaml"), cuda_available=False)
    with pytest.raises(RecipeError, match=r"data\.train_files names files, but data\.source\.reasoning_gym"):
        validate_recipe(
            load_recipe(out / "config.yaml", ["data.train_files=[other.parquet]"]), cuda_available=False
        )
