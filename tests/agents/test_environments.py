"""The environment protocol against a real OpenEnv server (OpenEnv's `create_app` served by uvicorn
in a process of its own: openenv_server.py; the environment is _openenv_letters.py): an episode's
reset, steps, rewards and end; the loop's ids, masks and reward placement against the chat
template's rendering; the recipe check of the server; and the reward stage reading the rewards."""

import asyncio
import socket

import pytest
import torch
import yaml
from letters_game import STEPS, TASK, letter_share
from openenv_server import openenv_server

from engines.rollout.config import EnvironmentConfig
from engines.rollout.requests import Completion
from hybridflow.agents.environments import (
    ENV_SCORES,
    EnvironmentLoop,
    Episode,
    StepResult,
    place_episode_rewards,
    user_turn,
)
from hybridflow.agents.openenv_env import OpenEnvEnvironment, check_server
from hybridflow.agents.template import end_of_turn_ids, message_delta_renderer, tokenize_chat
from hybridflow.checks.agents import _check_environment
from hybridflow.config.loader import load_recipe
from hybridflow.protocol import DataProto
from hybridflow.reward.manager import compute_rewards, sequence_scores
from hybridflow.utils.tiny_model import build_tokenizer

ACTIONS = ["ab1", "xyz!", "never sent"]


@pytest.fixture(scope="module")
def server():
    with openenv_server("_openenv_letters:app") as url:
        yield url


def settings(url: str, **overrides) -> EnvironmentConfig:
    return EnvironmentConfig(**{"url": url, "observation_field": "text", **overrides})


def test_an_openenv_episode_resets_steps_and_ends_when_the_server_says_done(server):
    async def play() -> list:
        environment = OpenEnvEnvironment(settings(server))
        try:
            return [await environment.reset(7), *[await environment.step(a) for a in ACTIONS[:STEPS]]]
        finally:
            await environment.close()

    first, *steps = asyncio.run(play())
    assert first == f"{TASK} (task 7)"
    assert steps == [
        StepResult("Step 1: 0.67 of your reply was letters.", 2 / 3, False),
        StepResult("Step 2: 0.75 of your reply was letters.", 0.75, True),
    ]


def test_an_observation_without_observation_field_is_all_of_its_fields_as_json(server):
    async def first() -> str:
        environment = OpenEnvEnvironment(settings(server, observation_field=""))
        try:
            return await environment.reset(3)
        finally:
            await environment.close()

    assert asyncio.run(first()) == '{"text": "Reply with letters only. (task 3)"}'


class ScriptedEngine:
    """Answers turn k with the ids of ACTIONS[k] and the end of turn."""

    def __init__(self, tokenizer, end: int):
        self.tokenizer, self.end, self.requests = tokenizer, end, []

    async def generate(self, ids: list[int], seed: int, max_new_tokens: int) -> Completion:
        self.requests.append(list(ids))
        tokens = self.tokenizer(ACTIONS[len(self.requests) - 1], add_special_tokens=False)["input_ids"] + [
            self.end
        ]
        return Completion(tokens, [-0.5] * len(tokens), [3] * len(tokens), "stop")


def play_episode(url: str, max_turns: int = 4, budget: int = 200) -> tuple[Episode, list[dict], object]:
    tokenizer = build_tokenizer()
    ends = end_of_turn_ids(tokenizer)
    engine = ScriptedEngine(tokenizer, min(ends))
    render_delta = message_delta_renderer(tokenizer)
    loop = EnvironmentLoop(
        engine.generate,
        lambda: OpenEnvEnvironment(settings(url)),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        lambda messages: tokenize_chat(tokenizer, messages),
        lambda text, closed: render_delta([user_turn(text)], closed=closed),
        budget,
        max_turns,
        ends,
    )
    messages = [{"role": "system", "content": "Be brief."}]
    episode = asyncio.run(loop.run(tokenize_chat(tokenizer, messages), 11, messages, reset_seed=5))
    return episode, messages, tokenizer


def test_the_loop_trains_on_the_sampled_ids_and_appends_observations_as_the_template_renders_them(server):
    episode, messages, tokenizer = play_episode(server)
    conversation = [
        *messages,
        user_turn(f"{TASK} (task 5)"),
        {"role": "assistant", "content": ACTIONS[0]},
        user_turn("Step 1: 0.67 of your reply was letters."),
        {"role": "assistant", "content": ACTIONS[1]},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(episode.prompt_ids + episode.response_ids) == rendered
    assert episode.turns == STEPS and episode.done
    first, second = (len(tokenizer(a, add_special_tokens=False)["input_ids"]) + 1 for a in ACTIONS[:2])
    observation = len(episode.response_ids) - first - second
    assert episode.response_mask == [1] * first + [0] * observation + [1] * second
    assert episode.step_rewards == [letter_share(ACTIONS[0]), letter_share(ACTIONS[1])]
    assert episode.reward_positions == [first - 1, len(episode.response_ids) - 1]


def test_max_turns_ends_an_episode_the_environment_has_not_ended(server):
    episode, _, _ = play_episode(server, max_turns=1)
    assert episode.turns == 1 and not episode.done and episode.step_rewards == [2 / 3]
    assert episode.response_mask == [1] * len(episode.response_ids)


def test_episode_rewards_are_placed_as_the_recipe_says():
    episodes = [
        Episode(step_rewards=[0.5, 2.0], reward_positions=[1, 4]),
        Episode(step_rewards=[1.0], reward_positions=[2]),
    ]
    expected = {
        "sum": [[0, 0, 0, 0, 2.5, 0], [0, 0, 1.0, 0, 0, 0]],
        "final": [[0, 0, 0, 0, 2.0, 0], [0, 0, 1.0, 0, 0, 0]],
        "per_turn": [[0, 0.5, 0, 0, 2.0, 0], [0, 0, 1.0, 0, 0, 0]],
    }
    for how, rows in expected.items():
        assert place_episode_rewards(episodes, 6, how).tolist() == rows, how


def test_the_reward_stage_scores_with_the_environments_rewards_not_a_rule():
    scores = torch.tensor([[0.0, 0.5, 0.0, 2.0], [0.0, 0.0, 1.0, 0.0]])  # (B, R): per-turn rewards
    batch = DataProto.from_dict(
        {
            "responses": torch.zeros(2, 4, dtype=torch.long),
            "response_mask": torch.ones(2, 4),
            ENV_SCORES: scores,
        },
        non_tensors={"data_source": ["letters", "letters"], "reward_model": [{}, {}]},
    )
    assert torch.equal(
        compute_rewards(batch, tokenizer=None, reward_fn=None).batch["token_level_scores"], scores
    )
    assert sequence_scores(batch, tokenizer=None, reward_fn=None).tolist() == [2.5, 1.0]


def test_the_recipe_check_names_the_url_of_a_server_that_does_not_answer():
    with socket.socket() as bound:  # bound and never listening: a connection there is refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(
            ValueError, match=r"rollout.agent.environment.url=.*no OpenEnv server answers there"
        ):
            check_server(settings(url, connect_timeout_s=5))


def test_the_recipe_check_names_fields_the_server_does_not_have(server):
    check_server(settings(server))
    with pytest.raises(
        ValueError, match=r"action_field='text': the server's action has no such field .*'message'"
    ):
        check_server(settings(server, action_field="text"))
    with pytest.raises(
        ValueError, match=r"observation_field='message': the server's observation has no such"
    ):
        check_server(settings(server, observation_field="message"))
    with pytest.raises(ValueError, match=r"url='127.0.0.1:8000' must be an http:// or https:// URL"):
        check_server(settings("127.0.0.1:8000"))


def test_a_reward_function_or_model_beside_the_environments_rewards_is_refused(tmp_path):
    recipe = {
        "model": {"path": "m"},
        "rollout": {"name": "vllm", "agent": {"loop": "environment", "environment": {"url": "http://h:1"}}},
        "reward": {"custom_fn": "my_rewards.score"},
        "reward_model": {"enable": True, "path": "rm"},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    because = "has no effect with rollout.agent.loop=environment: the environment's rewards are the scores"
    assert _check_environment(load_recipe(tmp_path / "recipe.yaml")) == [
        f"reward.custom_fn=my_rewards.score {because}; remove it",
        f"reward_model.enable=true {because}; set it to false",
    ]
