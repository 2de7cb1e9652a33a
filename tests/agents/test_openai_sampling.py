"""A request's `temperature` or `top_p` that differs from the recipe's is refused: the actor
computes the log-probs at rollout.sampling's settings (val_sampling's in validation), so a turn
sampled at others would be trained on as if sampled at those. Through the real aiohttp server and
the real `openai` client, over a scripted engine; equal values are served."""

import openai
import pytest
from scripted_chat import CALL, ScriptedChat, agent_prompts

from engines.rollout.config import AgentConfig, RolloutConfig, SamplingConfig
from hybridflow.agents.openai_loop import OpenAIAgentRollout, engine_requests
from hybridflow.utils.tiny_model import build_tokenizer

RECIPE = SamplingConfig(temperature=0.7, top_p=0.9)
GREEDY = SamplingConfig(do_sample=False, temperature=0.0)


def rollout(agent, engine, tokenizer) -> OpenAIAgentRollout:
    agent_cfg = AgentConfig(loop="openai", openai_agent="tests:unused")
    cfg = RolloutConfig(
        name="vllm", response_length=300, sampling=RECIPE, val_sampling=GREEDY, agent=agent_cfg
    )
    eos = [tokenizer.eos_token_id]
    return OpenAIAgentRollout(agent, engine_requests(engine), tokenizer, cfg, tokenizer.pad_token_id, eos)


async def refused(client, model, messages, **fields) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=model, messages=messages, **fields)
    return error.value


def training_agent(seen: list):
    async def run(client, model, messages, **row):
        for fields in ({"temperature": 1.2}, {"top_p": 0.5}, {"temperature": 0}):
            seen.append(await refused(client, model, messages, **fields))
        await client.chat.completions.create(model=model, messages=messages, temperature=0.7, top_p=0.9)
        await client.chat.completions.create(model=model, messages=messages)

    return run


def test_a_request_temperature_or_top_p_other_than_the_recipes_is_a_400_naming_it():
    tokenizer = build_tokenizer()
    engine = ScriptedChat(tokenizer, [CALL % "12*34", "#### 408"])
    seen = []
    prompts = agent_prompts(tokenizer, 1)
    prompts.meta_info = {}  # a training call: rollout.sampling
    rollout(training_agent(seen), engine, tokenizer).generate_sequences(prompts)
    params = [error.body["param"] for error in seen]
    assert params == ["temperature", "top_p", "temperature"]
    hot, narrow, greedy = (error.body["message"] for error in seen)
    assert "temperature=1.2" in hot and "rollout.sampling.temperature=0.7" in hot
    assert "leave temperature out" in hot
    assert "top_p=0.5" in narrow and "rollout.sampling.top_p=0.9" in narrow
    assert "temperature=0" in greedy
    assert all(error.status_code == 400 for error in seen)
    assert [r[1] for r in engine.requests] == [RECIPE, RECIPE]  # the two served


def test_in_validation_the_val_sampling_settings_are_the_ones_compared():
    tokenizer = build_tokenizer()
    engine = ScriptedChat(tokenizer, ["#### 408"])
    seen = []

    async def agent(client, model, messages, **row):
        seen.append(await refused(client, model, messages, temperature=0.7))
        await client.chat.completions.create(model=model, messages=messages, temperature=0, top_p=1)

    rollout(agent, engine, tokenizer).generate_sequences(agent_prompts(tokenizer, 1))
    assert "rollout.val_sampling.temperature=0" in seen[0].body["message"]
    assert [r[1] for r in engine.requests] == [GREEDY]
