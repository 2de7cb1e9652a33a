"""The OpenAI-compatible endpoint without vLLM: request validation, response shaping, sessions that
continue a conversation in token ids (or start a new segment when the agent edits its history),
and the whole path (the real aiohttp server, the real `openai` client, the example agent) over a
scripted engine, in this process."""

import asyncio
import json

import numpy as np
import openai
import pytest
import torch
from scripted_chat import CALL, QUESTION, ScriptedChat, agent_prompts, openai_rollout

from engines.rollout.config import AgentConfig, RolloutConfig, ServerConfig
from hybridflow.agents.chat_session import ChatSession
from hybridflow.agents.loop import TOOL_VERSION
from hybridflow.agents.openai_api import ApiError, ChatRequest, assistant_message, parse_chat_request
from hybridflow.agents.openai_loop import load_openai_agent
from hybridflow.agents.template import call_id, message_delta_renderer
from hybridflow.data.prompt_dataset import tokenize_chat
from hybridflow.protocol import DataProto
from hybridflow.utils.tiny_model import build_tokenizer

MODEL = "policy"


def body(**fields):
    return {"model": MODEL, "messages": QUESTION, **fields}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"stream": "true"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"n": True}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
        ({"messages": []}, "messages"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_an_unsupported_parameter_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as refused:
        parse_chat_request(body(**fields), MODEL)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert refused.value.body()["error"]["param"] == param


def test_served_parameters_and_defaults_are_read():
    request = parse_chat_request(
        body(n=1, stream=False, tool_choice="auto", max_completion_tokens=7, temperature=0, seed=3, user="u"),
        MODEL,
    )
    assert (request.max_tokens, request.temperature, request.top_p, request.seed) == (7, 0.0, None, 3)
    with pytest.raises(ApiError) as unknown:
        parse_chat_request({**body(), "model": "gpt-4o"}, MODEL)
    assert (unknown.value.status, unknown.value.param, unknown.value.code) == (
        404,
        "model",
        "model_not_found",
    )


def test_a_sampled_turn_becomes_an_openai_assistant_message():
    text = "Let me compute.\n" + CALL % "12*34" + "\n" + CALL % "1+1"
    turn = assistant_message(text, "stop", 0)
    assert turn.message["content"] == "Let me compute."
    assert turn.message["tool_calls"] == [
        {
            "id": call_id(0, i),
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": e})},
        }
        for i, e in enumerate(("12*34", "1+1"))
    ]
    assert (turn.finish_reason, turn.tool_calls, turn.malformed_calls) == ("tool_calls", 2, 0)
    only_call = assistant_message(CALL % "2", "stop", 0)
    assert only_call.message["content"] is None and only_call.finish_reason == "tool_calls"
    malformed = assistant_message(CALL % "2" + "<tool_call>{oops</tool_call>", "stop", 0)
    assert malformed.message["tool_calls"] is None and malformed.message["content"].endswith(
        "{oops</tool_call>"
    )
    assert (malformed.finish_reason, malformed.malformed_calls) == ("stop", 1)
    cut = assistant_message(CALL % "2", "length", 0)
    assert (cut.message["content"], cut.finish_reason, cut.tool_calls) == (CALL % "2", "length", 0)


def chat_session(tokenizer, budget: int = 300) -> ChatSession:
    return ChatSession(
        "s",
        lambda messages, tools: tokenize_chat(tokenizer, messages, tools),
        message_delta_renderer(tokenizer),
        tokenizer.decode,
        frozenset([tokenizer.eos_token_id]),
        budget,
        seed=5,
    )


def request(messages, **fields) -> ChatRequest:
    return parse_chat_request(body(messages=messages, **fields), MODEL)


def test_a_continued_conversation_is_the_previous_ids_plus_the_sampled_ids_plus_the_appended_messages():
    tokenizer = build_tokenizer()
    engine = ScriptedChat(tokenizer, [CALL % "12*34", "#### 409"])
    session = chat_session(tokenizer)
    first = asyncio.run(session.complete(request(QUESTION), engine.generate))
    reply = {**first.turn.message, "refusal": None}  # extra null fields, as the client echoes them
    history = [*QUESTION, reply, {"role": "tool", "tool_call_id": "call_s_0_0", "content": "408"}]
    asyncio.run(session.complete(request(history), engine.generate))
    prompt = tokenize_chat(tokenizer, QUESTION, None)
    sampled = [*engine.ids(CALL % "12*34"), tokenizer.eos_token_id]
    tool_ids = message_delta_renderer(tokenizer)([{"role": "tool", "content": "408"}])
    assert tokenizer.decode(tool_ids) == "<|tool|>408<|assistant|>"
    assert [r[0] for r in engine.requests] == [prompt, prompt + sampled + tool_ids]
    trajectory = session.trajectory()
    answer = [*engine.ids("#### 409"), tokenizer.eos_token_id]
    assert trajectory.prompt_ids == prompt and trajectory.response_ids == sampled + tool_ids + answer
    assert trajectory.response_mask == [1] * len(sampled) + [0] * len(tool_ids) + [1] * len(answer)
    assert trajectory.versions == [3] * len(sampled) + [TOOL_VERSION] * len(tool_ids) + [3] * len(answer)
    assert trajectory.log_probs == [-0.25] * len(sampled) + [0.0] * len(tool_ids) + [-0.25] * len(answer)
    assert (trajectory.turns, trajectory.tool_calls, session.divergences) == (2, 1, 0)
    assert [r[3] for r in engine.requests] == [300, 300 - len(sampled) - len(tool_ids)]


def test_an_edited_history_starts_a_new_segment_rendered_from_scratch():
    tokenizer = build_tokenizer()
    engine = ScriptedChat(tokenizer, [CALL % "12*34", CALL % "408+1", "#### 409", "409"])
    session = chat_session(tokenizer)
    first = asyncio.run(session.complete(request(QUESTION), engine.generate)).turn.message
    edited = [
        {"role": "system", "content": "Be brief."},
        *QUESTION,
        first,
        {"role": "tool", "content": "408"},
    ]
    second = asyncio.run(session.complete(request(edited), engine.generate)).turn.message
    asyncio.run(
        session.complete(request([*edited, second, {"role": "tool", "content": "409"}]), engine.generate)
    )
    assert (len(session.segments), session.divergences) == (2, 1)
    scratch = [
        *edited[:2],
        {"role": "assistant", "content": ""},
        edited[3],
    ]  # tool calls: not in this template
    assert engine.requests[1][0] == tokenize_chat(tokenizer, scratch, None)
    trajectory = session.trajectory()  # the last segment: 2 sampled turns after the fresh prompt
    assert trajectory.prompt_ids == engine.requests[1][0] and trajectory.turns == 2
    assert (
        engine.requests[2][0]
        == trajectory.prompt_ids + trajectory.response_ids[: -len(engine.ids("#### 409")) - 1]
    )
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    asyncio.run(session.complete(request(edited, tools=tools), engine.generate))  # other tools: diverged
    assert session.divergences == 2


def test_a_turn_cut_at_the_length_limit_is_closed_by_the_template_and_budgets_end_a_trajectory():
    tokenizer = build_tokenizer()
    engine = ScriptedChat(tokenizer, ["abc", "de"], cut=(0,))
    session = chat_session(tokenizer, budget=16)
    first = asyncio.run(session.complete(request(QUESTION), engine.generate)).turn.message
    user = {"role": "user", "content": "go on"}
    asyncio.run(session.complete(request([*QUESTION, first, user]), engine.generate))
    appended = engine.requests[1][0][len(tokenize_chat(tokenizer, QUESTION, None)) + 3 :]
    assert tokenizer.decode(appended) == "</s><|user|>go on<|assistant|>"  # the EOS no policy sampled
    assert session.trajectory().response_mask == [1] * 3 + [0] * len(appended) + [1] * 3
    second = {"role": "assistant", "content": "de"}
    full = asyncio.run(session.complete(request([*QUESTION, first, user, second, user]), engine.generate))
    assert (full.turn.finish_reason, full.completion_tokens, len(engine.requests)) == ("length", 0, 2)
    assert len(session.trajectory().response_ids) == 14  # the messages that did not fit are not recorded


async def echo_agent(client, model, messages, **row):
    """Checks the model list, sends one refused parameter, then runs the example agent."""
    assert [m.id for m in (await client.models.list()).data] == [model]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=model, messages=messages, n=2)
    assert refused.value.body["param"] == "n"
    from hybridflow.agents.openai_example import calculator_agent

    await calculator_agent(client, model, messages, **row)


async def failing_agent(client, model, messages, **row):
    raise KeyError("the agent's own bug")


def test_an_openai_client_agent_runs_through_the_endpoint_into_the_rollout_batch():
    tokenizer = build_tokenizer()
    engine = ScriptedChat(tokenizer, [CALL % "12*34", CALL % "408+1", "#### 409"])
    out = openai_rollout(echo_agent, engine, tokenizer).generate_sequences(agent_prompts(tokenizer, 1))
    render = message_delta_renderer(tokenizer)
    eos = [tokenizer.eos_token_id]
    turns = [engine.ids(CALL % "12*34") + eos, engine.ids(CALL % "408+1") + eos, engine.ids("#### 409") + eos]
    tools = [render([{"role": "tool", "content": text}]) for text in ("408", "409")]
    expected = turns[0] + tools[0] + turns[1] + tools[1] + turns[2]
    length = len(expected)
    assert out.batch["responses"][0, :length].tolist() == expected
    pieces = [(turns[0], 1), (tools[0], 0), (turns[1], 1), (tools[1], 0), (turns[2], 1)]
    assert out.batch["response_mask"][0, :length].tolist() == [flag for ids, flag in pieces for _ in ids]
    assert out.batch["prompts"][0].tolist() == tokenize_chat(tokenizer, QUESTION, None)
    assert out.non_tensor_batch["agent_tool_calls"].tolist() == [2]
    assert out.non_tensor_batch["agent_divergences"].tolist() == [0]
    sampling = engine.requests[0][1]
    assert not sampling.do_sample  # a validation call: val_sampling, the request set no temperature


def test_an_agent_failure_names_the_agent_and_a_batch_without_messages_is_refused():
    tokenizer = build_tokenizer()
    rollout = openai_rollout(failing_agent, ScriptedChat(tokenizer, []), tokenizer)
    with pytest.raises(RuntimeError, match=r"rollout.agent.openai_agent failed in session .*KeyError"):
        rollout.generate_sequences(agent_prompts(tokenizer, 2))
    prompts = agent_prompts(tokenizer, 1)
    prompts.non_tensor_batch.pop("raw_prompt")
    with pytest.raises(ValueError, match="no 'raw_prompt'"):
        rollout.generate_sequences(prompts)
    assert isinstance(prompts.non_tensor_batch["data_source"], np.ndarray)


def test_the_recipe_settings_are_checked():
    with pytest.raises(ValueError, match=r"rollout\.agent\.openai_agent='package\.module:function'"):
        AgentConfig(loop="openai")
    with pytest.raises(ValueError, match="use openai"):
        AgentConfig(openai_agent="a.b:c")
    with pytest.raises(ValueError, match=r"rollout.server.port must be in \[0, 65535\]"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="cannot be imported"):
        load_openai_agent("hybridflow.agents.openai_example:nothing")
    with pytest.raises(TypeError, match="must be `async def tool_schemas"):
        load_openai_agent("hybridflow.agents.openai_example:tool_schemas")
    assert load_openai_agent("hybridflow.agents.openai_example:calculator_agent")


def test_a_trajectory_with_its_own_prompt_replaces_its_row_and_widens_the_prompts():
    from hybridflow.agents.batch import trajectories_to_batch
    from hybridflow.agents.loop import Trajectory

    prompts = DataProto.from_dict(
        {
            "input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
            "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]]),
        }
    )
    own = Trajectory(
        response_ids=[20], response_mask=[1], log_probs=[-1.0], versions=[0], prompt_ids=[1, 2, 3, 4]
    )
    same = Trajectory(response_ids=[30], response_mask=[1], log_probs=[-1.0], versions=[0])
    batch = trajectories_to_batch(prompts, [own, same], response_length=2, pad_token_id=0)
    assert batch.batch["prompts"].tolist() == [[1, 2, 3, 4], [0, 7, 8, 9]]
    assert batch.batch["input_ids"].tolist() == [[1, 2, 3, 4, 20, 0], [0, 7, 8, 9, 30, 0]]
    assert batch.batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0]]
    assert batch.batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4]]


def test_the_recipe_check_loads_the_agent_before_any_worker_starts():
    from hybridflow.checks.agents import _check_agent_tools
    from hybridflow.config.schema import RecipeConfig

    cfg = RecipeConfig()
    cfg.rollout = RolloutConfig(
        name="vllm", agent=AgentConfig(loop="openai", openai_agent="nowhere.agents:run")
    )
    assert _check_agent_tools(cfg) == [
        "rollout.agent.openai_agent='nowhere.agents:run' cannot be imported: ModuleNotFoundError: No module "
        "named 'nowhere'"
    ]
    cfg.rollout.agent.openai_agent = "hybridflow.agents.openai_example:calculator_agent"
    assert _check_agent_tools(cfg) == []
