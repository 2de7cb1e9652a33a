"""Agent loops: each tool and OpenAI-style agent loads, an environment's connector is installed and
no reward beside its own, no loop setting left unread; and the chat template against the loop
(it takes tool responses and writes tool calls in the format the loop reads).
"""

import json
import logging
import os

from hybridflow.agents.template import check_incremental_template
from hybridflow.agents.tool_formats import FORMATS, ToolCallFormat, resolve_format
from hybridflow.agents.tool_parser import ToolCall
from hybridflow.agents.tools.base import prompt_tools
from hybridflow.checks.settings import _changed_fields, _no_effect
from hybridflow.config.schema import RecipeConfig
from hybridflow.utils.imports import DottedPathError, first_line

logger = logging.getLogger(__name__)


def _check_agent_tools(cfg: RecipeConfig) -> list[str]:
    """Each `rollout.agent.tools` entry must load as a tool, and an `openai_agent` as an async
    function (before any worker starts)."""
    from hybridflow.agents.tools.base import load_tool

    errors = []
    for index, path in enumerate(cfg.rollout.agent.tools):
        try:
            load_tool(path, recipe_key=f"rollout.agent.tools[{index}]")
        except DottedPathError as err:  # names the key and the path
            errors.append(str(err))
        except (TypeError, ValueError) as err:  # check_tool's: names the path
            errors.append(f"rollout.agent.tools[{index}]: {err}")
    if cfg.rollout.agent.loop == "openai":
        from hybridflow.agents.openai_loop import load_openai_agent

        try:
            load_openai_agent(cfg.rollout.agent.openai_agent)
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    return errors


def _check_environment(cfg: RecipeConfig) -> list[str]:
    """loop=environment: the environment's rewards are the scores, so a reward function or model
    beside them is refused, and its connector's package must be installed."""
    if cfg.rollout.agent.loop != "environment":
        return []
    import importlib.util

    because = "rollout.agent.loop=environment: the environment's rewards are the scores"
    errors = _no_effect(_changed_fields(cfg.reward, "reward", ("custom_fn",)), because, "; remove {it}")
    errors += _no_effect(
        _changed_fields(cfg.reward_model, "reward_model", ("enable",)), because, "; set {it} to false"
    )
    if importlib.util.find_spec("openenv") is None:
        errors.append(
            "rollout.agent.environment.name=openenv needs the openenv-core package, which is not installed: "
            "pip install -r requirements.txt (it pins openenv-core)"
        )
    return errors


def _agent_settings_unread(cfg: RecipeConfig) -> list[str]:
    """The tool loop's limits without loop=tool, the endpoint's settings without loop=openai."""
    agent, loop = cfg.rollout.agent, cfg.rollout.agent.loop
    errors = []
    if loop != "tool":
        tool_loop = () if loop == "environment" else ("max_turns",)  # the environment loop's too
        tool_loop += ("tool_timeout_s", "max_concurrent_tool_calls", "max_tool_response_length")
        changed = _changed_fields(agent, "rollout.agent", tool_loop)
        errors += _no_effect(
            changed,
            f"rollout.agent.loop={loop}",
            ": only loop=tool reads {it}; set rollout.agent.loop=tool, or remove {it}",
        )
    if loop != "environment":
        changed = _changed_fields(agent, "rollout.agent", ("environment",))
        errors += _no_effect(
            changed,
            f"rollout.agent.loop={loop}",
            ": only loop=environment runs episodes; set rollout.agent.loop=environment, or remove {it}",
        )
    if loop in ("single_turn", "environment"):
        changed = _changed_fields(agent, "rollout.agent", ("tool_call_format",))
        errors += _no_effect(
            changed,
            f"rollout.agent.loop={loop}",
            ": only the tool and openai loops read tool calls; set rollout.agent.loop, or remove {it}",
        )
    if loop != "openai":
        changed = _changed_fields(cfg.rollout.server, "rollout.server", ("host", "port", "model_name"))
        errors += _no_effect(
            changed,
            f"rollout.agent.loop={loop}",
            ": only loop=openai serves an endpoint; set rollout.agent.loop=openai, or remove {it}",
        )
    return errors


# The tool an openai-loop recipe's template is tried with (its agent passes its own at run time)
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A tool of the chat-template check.",
        "parameters": {"type": "object", "properties": {}},
    },
}


PROBE_QUESTION = [{"role": "user", "content": "What is 1+1?"}]


PROBE_RESPONSE = "§tool response§"  # a text no template writes by itself


def check_chat_template(cfg: RecipeConfig, tokenizer) -> None:
    """An agent loop's template must take the tool role (the loop appends tool responses as such
    messages) and write tool calls, if it writes them, in the tool-call format the loop reads
    (rollout.agent.tool_call_format, agents/tool_formats.py; the model learned its calls in that
    format); ValueError naming the tokenizer's key. A template that ignores `tools=` or drops calls
    is a warning: the model can still call tools it was fine-tuned on (the tool demo's warm start),
    but it sees no schema."""
    loop = cfg.rollout.agent.loop
    if loop == "single_turn":
        return
    key = _tokenizer_key(cfg)
    if loop == "environment":  # observations are user turns appended to the sampled ids
        check_incremental_template(tokenizer, key, [{"role": "user", "content": PROBE_RESPONSE}])
        return
    render = template_renderer(tokenizer, key)
    schemas = prompt_tools(cfg.rollout.agent) or [PROBE_TOOL]
    if render(PROBE_QUESTION, schemas, "tools=") == render(PROBE_QUESTION, None, "a user message"):
        logger.warning(
            "%s: the chat template ignores tools=: the prompts carry no tool schema, so the model can call "
            "only tools it was fine-tuned to call (as the tool demo's warm start does)", key,
        )  # fmt: skip
    name = schemas[0]["function"]["name"]
    what = f"a tool call followed by its response, a message of role 'tool', which rollout.agent.loop={loop}"
    rendered = render(_tool_turn(name), schemas, f"{what} appends after every call")
    if PROBE_RESPONSE not in rendered:
        raise ValueError(
            f"{key}: the chat template renders a tool message without its content, so the model never reads "
            f"what its tools return; {TEMPLATE_FIX}"
        )
    prompt = render(PROBE_QUESTION, schemas, "tools=")
    call_format = resolve_format(cfg.rollout.agent.tool_call_format, tokenizer)
    _check_tool_call_format(
        _after(prompt, rendered[: rendered.index(PROBE_RESPONSE)]), name, key, loop, call_format
    )
    check_incremental_template(tokenizer, key)  # tool responses append to the sampled ids


def _tool_turn(name: str) -> list[dict]:
    """The probe question, an assistant turn calling tool `name`, and the tool's response."""
    call = {"id": "c00000000", "type": "function", "function": {"name": name, "arguments": {}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    response = {"role": "tool", "name": name, "tool_call_id": call["id"], "content": PROBE_RESPONSE}
    return [*PROBE_QUESTION, turn, response]


TEMPLATE_FIX = "use a model whose template renders tool messages and calls, or set model.tokenizer_path"


def _tokenizer_key(cfg: RecipeConfig) -> str:
    if cfg.model.tokenizer_path is None:
        return f"model.path={cfg.model.path}"
    return f"model.tokenizer_path={cfg.model.tokenizer_path}"


def template_renderer(tokenizer, key: str):
    """`render(messages, tools, what)`: the template's text (with the assistant prompt); what the
    template's own code raises is a ValueError naming `key` and `what` it refused."""

    def render(messages: list[dict], tools: list[dict] | None, what: str) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # raise_exception(), a missing field, ...
            raise ValueError(
                f"{key}: the chat template refuses {what} ({first_line(err)}); {TEMPLATE_FIX}"
            ) from None

    return render


def _after(prompt: str, rendered: str) -> str:
    """`rendered` from where it stops agreeing with `prompt` (the question with the assistant
    prompt): the assistant turn as the template writes it."""
    return rendered[len(os.path.commonprefix([prompt, rendered])) :]  # noqa: RUF071 (text, not paths)


def _check_tool_call_format(
    written: str, name: str, key: str, loop: str, call_format: ToolCallFormat
) -> None:
    """A call the template writes (`written`: the assistant turn) must parse back as the same call
    (name, arguments) in `call_format`. A template that writes none matters to loop=openai only,
    whose agents send their conversations back."""
    expected = [ToolCall(name, {})]
    if call_format.parse(written).calls == expected:
        return
    readers = [fmt.name for fmt in FORMATS.values() if fmt.parse(written).calls == expected]
    if readers:
        raise ValueError(
            f"{key}: the chat template writes tool calls in the {readers[0]} format, not the "
            f"{call_format.name} format the tool loop would read; set rollout.agent.tool_call_format: "
            f"{readers[0]} (or auto)"
        )
    if name not in written:
        if loop == "openai":
            logger.warning(
                "%s: the chat template writes no tool call of an assistant message: the calls of a "
                "conversation an OpenAI-style agent sends back are lost when it is rendered", key,
            )  # fmt: skip
        return
    raise ValueError(
        f"{key}: the chat template writes a tool call as {_written_call(written, name)!r}, which no "
        f"tool-call format reads (known: {', '.join(FORMATS)}): a model trained on this template would "
        f"call tools no loop runs; {TEMPLATE_FIX}"
    )


def _written_call(text: str, name: str) -> str:
    """The JSON object around the call's name in `text` (the line holding it when there is none)."""
    at = text.index(f'"{name}"')
    start = text.rfind("{", 0, at)
    try:
        return text[start : json.JSONDecoder().raw_decode(text, start)[1]]
    except ValueError:
        return text[text.rfind("\n", 0, at) + 1 :].split("\n")[0]
