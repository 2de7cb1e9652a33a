"""An agent written against the `openai` client, as `rollout.agent.loop: openai` runs it
(docs/agents.md): it offers the calculator, runs the calls the model makes, sends their results
back as `tool` messages, and continues until a turn calls no tool or `max_turns` turns.

    rollout.agent.openai_agent: hybridflow.agents.openai_example:calculator_agent

Nothing here knows about the rollout: pointed at any chat-completions server, it runs the same.
"""

import json

from hybridflow.agents.tools.base import ToolError, tool_schemas, validate_arguments
from hybridflow.agents.tools.calculator import Calculator

MAX_TURNS = 4


async def calculator_agent(
    client, model: str, messages: list[dict], max_turns: int = MAX_TURNS, **row
) -> None:
    """Chat with `model` until it answers without a tool call (`client`: an openai.AsyncOpenAI)."""
    calculator = Calculator()
    messages = list(messages)
    for _ in range(max_turns):
        response = await client.chat.completions.create(
            model=model, messages=messages, tools=tool_schemas([calculator])
        )
        choice = response.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return
        for call in choice.message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": await run_calculator(calculator, call)}
            )


async def run_calculator(calculator: Calculator, call) -> str:
    """The calculator's answer to one tool call, or an error text for the model."""
    try:
        arguments = json.loads(call.function.arguments)
        if call.function.name != calculator.name:
            raise ToolError(f"unknown tool {call.function.name!r}; available: {calculator.name}")
        validate_arguments(calculator, arguments)
        return await calculator.call(arguments)
    except (ToolError, json.JSONDecodeError) as err:
        return f"Error: {err}"
