"""One session serves one request at a time: an agent that sends two requests on one session at once
(`asyncio.gather` through the official `openai` client) gets both answered one after the other,
and what is recorded is what the engine sampled, each turn after the ids it was sampled from."""

import asyncio

from scripted_chat import QUESTION, ScriptedChat, agent_prompts, openai_rollout

from hybridflow.agents.chat_session import ChatSession
from hybridflow.data.prompt_dataset import tokenize_chat
from hybridflow.utils.tiny_model import build_tokenizer


class BothArrived(ScriptedChat):
    """Samples nothing until both requests have reached the session, so that the second arrives
    while the first is being sampled (the race an agent's asyncio.gather makes)."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.arrived, self.both = 0, asyncio.Event()

    async def generate(self, ids, sampling, seed, max_new_tokens):
        if self.requests:  # the agent's first request is alone
            await self.both.wait()
        return await super().generate(ids, sampling, seed, max_new_tokens)


def counting_session(engine: BothArrived, session: ChatSession) -> ChatSession:
    complete = session.complete

    async def arrive(request, generate):
        engine.arrived += 1
        if engine.arrived == 3:
            engine.both.set()
        return await complete(request, generate)

    session.complete = arrive
    return session


async def gather_agent(client, model, messages, **row):
    """Asks one question, then two follow-ups of its answer at once."""
    first = await client.chat.completions.create(model=model, messages=messages)
    history = [*messages, first.choices[0].message.model_dump()]
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(model=model, messages=[*history, {"role": "user", "content": q}])
            for q in ("a?", "b?")
        )
    )
    assert sorted(reply.choices[0].message.content for reply in replies) == ["#### 1", "#### 2"]


def test_concurrent_requests_on_one_session_are_served_in_turn_and_recorded_as_sampled():
    tokenizer = build_tokenizer()
    engine = BothArrived(tokenizer, ["#### 0", "#### 1", "#### 2"])
    rollout = openai_rollout(gather_agent, engine, tokenizer)
    make_session = rollout.session
    sessions = []
    rollout.session = lambda name, seed: (
        sessions.append(counting_session(engine, make_session(name, seed))) or sessions[-1]
    )
    rollout.generate_sequences(agent_prompts(tokenizer, 1))
    session = sessions[0]
    eos = [tokenizer.eos_token_id]
    answer = [*engine.ids("#### 0"), *eos]
    first_prompt = tokenize_chat(tokenizer, QUESTION, None)
    follow_ups = [engine.requests[1][0], engine.requests[2][0]]
    assert {tokenizer.decode(ids[len(first_prompt) + len(answer) :]) for ids in follow_ups} == {
        "<|user|>a?<|assistant|>",
        "<|user|>b?<|assistant|>",
    }
    # served in turn: the later follow-up does not continue the earlier one (it lacks its reply),
    # so it is a segment of its own, rendered from its messages; each segment is what was sampled
    assert session.divergences == 1
    for segment, request in zip(session.segments, engine.requests[1:], strict=True):
        sampled = engine.ids(engine.script[engine.requests.index(request)]) + eos
        assert segment.trajectory.prompt_ids + segment.trajectory.response_ids == request[0] + sampled
