"""The tool protocol: what an agent loop needs from a tool, loading one by dotted path from a
recipe, the function schemas a chat template renders, and checking a call's arguments.

A tool is any object with `name`, `description`, `parameters` (the JSON schema of its arguments,
an object schema) and `async call(arguments) -> str`. `call` receives arguments already checked
against `parameters` (tool_parser.run_tool_calls does it); it raises ToolError for a call it
cannot serve, and that message is what the model reads back.
"""

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jsonschema

from hybridflow.utils.imports import DottedPathError, load_by_path

# The function-name rule of the OpenAI tools API, which chat templates (Qwen, Hermes) follow.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(Exception):
    """A call the tool cannot serve (bad arguments, an input it refuses); the message goes back to
    the model as the tool's response."""


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]

    async def call(self, arguments: dict[str, Any]) -> str: ...


def load_tool(entry: str | Mapping[str, Any], recipe_key: str = "rollout.agent.tools", **kwargs: Any) -> Tool:
    """Imports `package.module.Name`: a Tool class (built with kwargs) or a Tool instance. `entry` is
    the dotted path, or a recipe's `{path: ..., kwargs: {...}}`. Whatever importing or building it
    raises is a DottedPathError naming `recipe_key`."""
    dotted_path, kwargs = _tool_entry(entry, recipe_key, kwargs)

    def build(obj: Any) -> Any:
        if inspect.isclass(obj):
            return obj(**kwargs)
        if kwargs:
            raise TypeError(f"an instance, not a class, takes no arguments {kwargs}")
        return obj

    tool = load_by_path(dotted_path, recipe_key, "package.module.ToolClass", build)
    check_tool(tool, dotted_path)
    return tool


def _tool_entry(entry: Any, recipe_key: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(dotted path, constructor arguments) of a `rollout.agent.tools` entry."""
    if isinstance(entry, str):
        return entry, kwargs
    given = entry.get("kwargs", {}) if isinstance(entry, Mapping) else None
    if (
        not isinstance(given, Mapping)
        or not isinstance(entry.get("path"), str)
        or set(entry) - {"path", "kwargs"}
    ):
        raise DottedPathError(
            f"{recipe_key}={entry!r} must be a dotted path 'package.module.ToolClass' or "
            "{path: package.module.ToolClass, kwargs: {...}}"
        )
    return entry["path"], {**given, **kwargs}


def check_tool(tool: object, origin: str) -> None:
    """Raises naming `origin` and the problem when `tool` does not follow the Tool protocol."""
    missing = [a for a in ("name", "description", "parameters", "call") if not hasattr(tool, a)]
    if missing:
        raise TypeError(
            f"tool {origin!r} is not a Tool: it has no {missing} (see hybridflow.agents.tools.Tool)"
        )
    if not inspect.iscoroutinefunction(tool.call):
        raise TypeError(f"tool {origin!r}: call must be `async def call(self, arguments) -> str`")
    if not isinstance(tool.name, str) or not TOOL_NAME.fullmatch(tool.name):
        raise ValueError(f"tool {origin!r}: name {tool.name!r} must be 1-64 letters, digits, '_' or '-'")
    if not isinstance(tool.description, str) or not tool.description:
        raise ValueError(f"tool {origin!r}: description must be a non-empty string")
    _check_parameters_schema(tool.parameters, origin)


def _check_parameters_schema(parameters: Any, origin: str) -> None:
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(
            f"tool {origin!r}: parameters must be a JSON schema of type 'object', got {parameters!r}"
        )
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as err:
        raise ValueError(f"tool {origin!r}: parameters is not a valid JSON schema: {err.message}") from err


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The `tools` list a chat template renders (OpenAI function format, as Qwen and Hermes use)."""
    check_unique_names(tools)
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


def check_unique_names(tools: Sequence[Tool]) -> None:
    names = [tool.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"tool names must be unique; {repeated} appear more than once in {names}")


def validate_arguments(tool: Tool, arguments: Any) -> None:
    """Raises ToolError, in words for the model, when `arguments` do not fit tool.parameters."""
    validator = jsonschema.validators.validator_for(tool.parameters)(tool.parameters)
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path)
        raise ToolError(
            f"invalid arguments for {tool.name}: {error.message}" + (f" (at '{where}')" if where else "")
        )


def prompt_tools(agent_cfg) -> list[dict[str, Any]] | None:
    """The function schemas a recipe's prompts carry: those of `rollout.agent.tools` (loaded by
    dotted path), or None without a tool loop."""
    if not agent_cfg.tools:
        return None
    return tool_schemas([load_tool(path) for path in agent_cfg.tools])
