"""The tools and the tool-call parser are light: none of their modules imports torch, Megatron-Core,
vLLM, SGLang or Ray, and importing them adds none of those to what `import hybridflow` already
loads. (The agent loops build the rollout batch, with torch, and reach vLLM only through the
engine they are given.)"""

import ast
import subprocess
import sys
from pathlib import Path

AGENTS = Path(__file__).resolve().parents[2] / "hybridflow" / "agents"
HEAVY = ("torch", "megatron", "vllm", "sglang", "transformer_engine", "ray")


def test_no_agents_module_imports_a_heavy_package():
    offenders = []
    for path in [*sorted((AGENTS / "tools").rglob("*.py")), AGENTS / "tool_parser.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] in HEAVY]
    assert offenders == []


def test_importing_the_agents_package_loads_no_heavy_package():
    probe = (
        "import sys, hybridflow; before = set(sys.modules);"
        "import hybridflow.agents.tools, hybridflow.agents.tool_parser;"
        f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {HEAVY!r}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
