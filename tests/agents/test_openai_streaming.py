"""`stream: true` through the official `openai` client: the same reply (content, tool calls, finish
reason) as without streaming, and the same recorded trajectory, token for token; the `developer`
role is a system message for the chat template."""

from scripted_chat import CALL, QUESTION, ScriptedChat, agent_prompts, openai_rollout

from hybridflow.data.prompt_dataset import tokenize_chat
from hybridflow.utils.tiny_model import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
INSTRUCTIONS = {"role": "developer", "content": "Use the calculator."}


async def streamed(stream) -> tuple[dict, str, dict]:
    """(message, finish reason, usage) put together from the chunks, as agent frameworks do."""
    content, calls, finish, usage = "", {}, None, None
    async for chunk in stream:
        usage = chunk.usage.model_dump() if chunk.usage else usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}, finish, usage


def plain(reply) -> tuple[dict, str, dict]:
    message = reply.choices[0].message
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    return (
        {"content": message.content, "tool_calls": calls},
        reply.choices[0].finish_reason,
        reply.usage.model_dump(),
    )


def calculator_agent(stream: bool, seen: list):
    async def run(client, model, messages, **row):
        messages = [INSTRUCTIONS, *messages]
        while True:
            request = {"model": model, "messages": messages, "tools": TOOLS}
            if stream:
                chunks = await client.chat.completions.create(
                    **request, stream=True, stream_options={"include_usage": True}
                )
                reply = await streamed(chunks)
            else:
                reply = plain(await client.chat.completions.create(**request))
            seen.append(reply)
            message, _, _ = reply
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in message["tool_calls"]
            ]
            messages.append({"role": "assistant", "content": message["content"], "tool_calls": calls or None})
            if not calls:
                return
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "408"} for c in calls]

    return run


def run_agent(stream: bool):
    tokenizer = build_tokenizer()
    engine = ScriptedChat(tokenizer, [CALL % "12*34", "#### 409"])
    seen = []
    out = openai_rollout(calculator_agent(stream, seen), engine, tokenizer).generate_sequences(
        agent_prompts(tokenizer, 1)
    )
    return seen, out, tokenizer


def test_a_streamed_reply_is_the_same_reply_and_the_same_trajectory():
    streamed_replies, streamed_batch, tokenizer = run_agent(stream=True)
    plain_replies, plain_batch, _ = run_agent(stream=False)
    assert streamed_replies == plain_replies
    assert [finish for _, finish, _ in streamed_replies] == ["tool_calls", "stop"]
    assert streamed_replies[0][0]["tool_calls"][0]["name"] == "calculator"
    for key in ("prompts", "responses", "response_mask", "rollout_log_probs"):
        assert streamed_batch.batch[key].tolist() == plain_batch.batch[key].tolist(), key
    assert streamed_batch.non_tensor_batch["agent_divergences"].tolist() == [0]
    system = {"role": "system", "content": INSTRUCTIONS["content"]}
    prompt = tokenize_chat(tokenizer, [system, *QUESTION], TOOLS)
    assert streamed_batch.batch["prompts"][0].tolist() == prompt  # developer: the template's system
