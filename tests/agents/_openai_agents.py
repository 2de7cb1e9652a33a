"""Agents for _vllm_openai_worker.py, written against the `openai` client only. `run` picks one by
the row's extra_info["agent"]: `calculator` is the example agent shipped in the package; `edit`
checks that an unsupported parameter is refused with a 400 naming it, then resends the
conversation with an edited history (a system message put first), which the endpoint must count
as a divergence."""

import openai

from hybridflow.agents.openai_example import calculator_agent


async def run(client: openai.AsyncOpenAI, model: str, messages: list[dict], **row) -> None:
    agent = {"calculator": calculator_agent, "edit": edit_history_agent}[row["extra_info"]["agent"]]
    await agent(client, model, messages, **row)


async def edit_history_agent(client: openai.AsyncOpenAI, model: str, messages: list[dict], **row) -> None:
    try:
        await client.chat.completions.create(model=model, messages=messages, n=2)
    except openai.BadRequestError as refused:
        assert refused.status_code == 400 and refused.body["param"] == "n", refused.body
    else:
        raise AssertionError("n=2 was not refused")
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=60)
    edited = [{"role": "system", "content": "Be brief."}, *messages, first.choices[0].message.model_dump()]
    await client.chat.completions.create(model=model, messages=[*edited, {"role": "tool", "content": "408"}])
