"""Tools an agent loop can call: the protocol (base.py) and the built-in ones."""

from hybridflow.agents.tools.base import Tool, ToolError, load_tool, tool_schemas, validate_arguments
from hybridflow.agents.tools.calculator import Calculator
from hybridflow.agents.tools.python_sandbox import PythonSandbox

__all__ = [
    "Calculator",
    "PythonSandbox",
    "Tool",
    "ToolError",
    "load_tool",
    "tool_schemas",
    "validate_arguments",
]
