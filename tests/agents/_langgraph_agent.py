"""An agent written with LangGraph and langchain-openai the way their documentation builds a
tool-calling agent: a chat model bound to a tool, a `ToolNode` that runs the model's calls, and a
graph looping model -> tools -> model until the model answers without a call. It knows nothing of
hybridflow but the calculator it wraps; the rollout runs it as `rollout.agent.openai_agent`
(tests/agents/test_langgraph_agent.py)."""

import contextlib

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from hybridflow.agents.tools import Calculator, ToolError

MAX_TURNS = 4  # model calls per episode, as the example agent (hybridflow/agents/openai_example.py)


@tool
async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. 127 * 48."""
    try:
        return await Calculator().call({"expression": expression})
    except ToolError as err:
        return f"Error: {err}"


def agent_graph(llm):
    model = llm.bind_tools([calculator])

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


async def run(client, model: str, messages: list[dict], **row) -> None:
    llm = ChatOpenAI(model=model, base_url=str(client.base_url), api_key="none", max_retries=0)
    # each turn is two steps (model, tools); at the limit the episode ends with what was recorded
    with contextlib.suppress(GraphRecursionError):
        await agent_graph(llm).ainvoke({"messages": messages}, {"recursion_limit": 2 * MAX_TURNS})
