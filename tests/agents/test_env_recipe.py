"""recipes/env_grpo.yaml trains two GRPO steps on CPU (in process, on this pytest worker's Ray
cluster: tests/recipe_runs.py) against a real OpenEnv server started here (openenv_server.py, the
environment of _openenv_letters.py), the rollout workers' vLLM engines playing the episodes. The
server logs every step it served; each step's `reward/mean` and the validation's `val/accuracy`
must be the mean episode reward (the sum of its steps' rewards, the recipe's `reward: sum`)
computed from that log, so the rewards trained on are the environment's."""

import json
from collections import defaultdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openenv_server import openenv_server
from recipe_runs import run_recipe_in_process

from hybridflow.utils.tiny_model import make_tiny_model

TRAIN_SEEDS, VAL_SEEDS, N = [10, 11], [100, 101], 2


def write_rows(path, seeds: list[int]) -> str:
    rows = [
        {
            "prompt": [{"role": "system", "content": "You play a game."}],
            "data_source": "letters",
            "reward_model": {"ground_truth": ""},  # unread: the environment scores
            "extra_info": {"seed": seed},
        }
        for seed in seeds
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def episode_rewards(log) -> list[tuple[int, float]]:
    """(reset seed, summed reward) of each episode the server played, in the order they started."""
    episodes = defaultdict(list)
    for line in log.read_text().splitlines():
        step = json.loads(line)
        episodes[(step["episode"], step["seed"])].append(step["reward"])
    return [(seed, sum(rewards)) for (_, seed), rewards in episodes.items()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_env_grpo_recipe_trains_two_steps_on_the_environments_rewards(tmp_path):
    train, val = (
        write_rows(tmp_path / "train.parquet", TRAIN_SEEDS),
        write_rows(tmp_path / "val.parquet", VAL_SEEDS),
    )
    log = tmp_path / "steps.jsonl"
    with openenv_server("_openenv_letters:app", {"LETTERS_LOG": str(log)}) as url:
        overrides = [
            f"model.path={make_tiny_model(tmp_path / 'model', num_layers=2)}",
            f"data.train_files=[{train}]",
            f"data.val_files=[{val}]",
            "data.max_prompt_length=64",
            "data.train_batch_size=2",
            "actor.megatron.tensor_model_parallel_size=1",
            "actor.megatron.params_dtype=float32",
            "actor.update.use_dynamic_bsz=false",
            "actor.update.ppo_mini_batch_size=4",
            "actor.update.ppo_micro_batch_size=2",
            "actor.log_prob_micro_batch_size=2",
            "ref.log_prob_micro_batch_size=2",
            "rollout.dtype=float32",
            "rollout.response_length=96",
            "rollout.sampling.max_new_tokens=12",  # per turn: room for two turns and an observation
            f"rollout.sampling.n={N}",
            "rollout.val_sampling.max_new_tokens=12",
            "rollout.val_sampling.do_sample=true",  # greedy, the random model writes no letter at all
            "rollout.val_sampling.temperature=1.0",
            f"rollout.agent.environment.url={url}",
            "rollout.agent.environment.observation_field=text",
            "trainer.use_gpu=false",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "trainer.test_freq=2",
            "trainer.save_freq=0",
            "trainer.logger=[console]",
            f"trainer.output_dir={tmp_path / 'out'}",
        ]
        done = run_recipe_in_process("recipes/env_grpo.yaml", overrides)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step") in (1, 2) and "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    episodes = episode_rewards(log)
    per_step = len(TRAIN_SEEDS) * N
    train_episodes, val_episodes = episodes[: 2 * per_step], episodes[2 * per_step :]
    assert sorted(seed for seed, _ in train_episodes) == sorted(TRAIN_SEEDS * N * 2)
    assert sorted(seed for seed, _ in val_episodes) == VAL_SEEDS
    for index, record in enumerate(steps):
        rewards = [reward for _, reward in train_episodes[index * per_step : (index + 1) * per_step]]
        assert record["reward/mean"] == pytest.approx(mean(rewards), abs=1e-5), (index, rewards, record)
        assert record["agent/env_steps/mean"] >= 1, record
    val_rewards = [reward for _, reward in val_episodes]
    assert any(val_rewards) and steps[-1]["val/accuracy"] == pytest.approx(mean(val_rewards), abs=1e-5)
