"""A LangGraph agent (langchain-openai's ChatOpenAI, a ToolNode, a model -> tools loop) runs a
multi-turn tool episode against the endpoint, and its trajectory is token for token the ids the
engine sampled plus the template's rendering of the tool messages LangGraph sent."""

from _langgraph_agent import run
from scripted_chat import CALL, ScriptedChat, agent_prompts, openai_rollout

from hybridflow.agents.template import message_delta_renderer
from hybridflow.utils.tiny_model import build_tokenizer


def test_a_langgraph_agent_runs_a_tool_episode_token_exactly():
    tokenizer = build_tokenizer()
    engine = ScriptedChat(tokenizer, [CALL % "12*34", CALL % "408+1", "#### 409"])
    out = openai_rollout(run, engine, tokenizer).generate_sequences(agent_prompts(tokenizer, 1))
    render = message_delta_renderer(tokenizer)
    eos = [tokenizer.eos_token_id]
    turns = [engine.ids(text) + eos for text in (CALL % "12*34", CALL % "408+1", "#### 409")]
    tools = [render([{"role": "tool", "content": text}]) for text in ("408", "409")]
    expected = turns[0] + tools[0] + turns[1] + tools[1] + turns[2]
    assert out.batch["responses"][0, : len(expected)].tolist() == expected
    pieces = [(turns[0], 1), (tools[0], 0), (turns[1], 1), (tools[1], 0), (turns[2], 1)]
    mask = [flag for ids, flag in pieces for _ in ids]
    assert out.batch["response_mask"][0, : len(expected)].tolist() == mask
    assert out.non_tensor_batch["agent_tool_calls"].tolist() == [2]
    assert out.non_tensor_batch["agent_divergences"].tolist() == [0]
