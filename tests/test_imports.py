"""Recipe import paths (reward.custom_fn, rollout.agent.tools, agent functions) resolve by dots or
a colon, and a bad one is a ValueError naming the key and the path, whatever the module or the
object raised (its first line)."""

import json
import sys

import pytest

from hybridflow.utils.imports import DottedPathError, import_by_path, load_by_path


def test_dotted_and_colon_paths_name_the_same_object():
    assert import_by_path("json.dumps", "k", "m.f") is json.dumps
    assert import_by_path("json:dumps", "k", "m.f") is json.dumps
    assert import_by_path("json.decoder:JSONDecoder", "k", "m.f") is json.JSONDecoder


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("dumps", "reward.custom_fn='dumps' must be a dotted path 'pkg.module.fn'"),
        ("json:", "reward.custom_fn='json:' must be a dotted path"),
        (
            "no_such_module.fn",
            "reward.custom_fn='no_such_module.fn' cannot be imported: ModuleNotFoundError: No module",
        ),
        (
            "json.no_such_fn",
            "cannot be imported: AttributeError: module 'json' has no attribute 'no_such_fn'",
        ),
    ],
)
def test_a_bad_path_names_the_key_and_the_problem(path, message):
    with pytest.raises(ValueError) as caught:
        import_by_path(path, "reward.custom_fn", "pkg.module.fn")
    assert message in str(caught.value)


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Importable modules that fail in the ways user code does: at import, or when built."""
    (tmp_path / "raises_at_import.py").write_text('raise RuntimeError("no GPU here\\nsecond line")\n')
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "refusing_tool.py").write_text(
        "class Sandbox:\n    def __init__(self):\n"
        '        raise OSError("landlock: the kernel refused the ruleset")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("raises_at_import", "exits_at_import", "refusing_tool"):
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "raises_at_import.fn",
            "reward.custom_fn='raises_at_import.fn' cannot be imported: RuntimeError: no GPU here",
        ),
        ("exits_at_import.fn", "reward.custom_fn='exits_at_import.fn' cannot be imported: SystemExit: 3"),
    ],
)
def test_any_exception_while_importing_is_named_with_the_first_line_of_its_cause(modules, path, message):
    with pytest.raises(DottedPathError) as caught:
        import_by_path(path, "reward.custom_fn", "pkg.module.fn")
    assert str(caught.value) == message  # the cause's first line only


def test_an_object_that_fails_to_build_is_named_too(modules):
    with pytest.raises(DottedPathError) as caught:
        load_by_path("refusing_tool.Sandbox", "rollout.agent.tools[0]", "pkg.module.Tool", lambda cls: cls())
    assert str(caught.value) == (
        "rollout.agent.tools[0]='refusing_tool.Sandbox' cannot be built: OSError: landlock: the kernel "
        "refused the ruleset"
    )


def test_the_recipe_check_names_a_tool_that_cannot_be_built(modules):
    from engines.rollout.config import AgentConfig, RolloutConfig
    from hybridflow.checks.agents import _check_agent_tools
    from hybridflow.config.schema import RecipeConfig

    cfg = RecipeConfig()
    tools = [
        "hybridflow.agents.tools.calculator.Calculator",
        "refusing_tool.Sandbox",
        "raises_at_import.T",
    ]
    cfg.rollout = RolloutConfig(name="vllm", agent=AgentConfig(loop="tool", tools=tools))
    assert _check_agent_tools(cfg) == [
        "rollout.agent.tools[1]='refusing_tool.Sandbox' cannot be built: OSError: landlock: the kernel "
        "refused the ruleset",
        "rollout.agent.tools[2]='raises_at_import.T' cannot be imported: RuntimeError: no GPU here",
    ]
