"""docs/reference/recipe.md is generated from the recipe's dataclasses (hybridflow/config/reference.py):
the page is current, every field has a description beside it, and a new field makes the page stale."""

import difflib
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from hybridflow.config import reference
from hybridflow.config.schema import RecipeConfig

ROOT = Path(__file__).resolve().parents[1]

FAKE_RECIPE = '''
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["a", "b"]  # a: the first way | b: the second way


@dataclass
class Inner:
    """An inner section."""

    mode: Mode = "a"  # how it goes
    engine: dict[str, Any] = field(default_factory=dict)  # the engine's own settings by name
{extra}

@dataclass
class Root:
    """The whole fake recipe."""

    inner: Inner = field(default_factory=Inner)  # the inner part
    # None: as large as it gets
    size: int | None = None
    path: str = "out/<name>"  # where | what
'''


def test_the_recipe_reference_page_is_current():
    page = ROOT / reference.PAGE
    assert page.is_file(), f"{reference.PAGE} is missing; run `{reference.WRITE_COMMAND}`"
    written, current = page.read_text(), reference.render(RecipeConfig)
    if written != current:
        diff = difflib.unified_diff(written.splitlines(), current.splitlines(), "written", "generated")
        shown = "\n".join(line.rstrip("\n") for line in list(diff)[:30])
        pytest.fail(f"{reference.PAGE} is stale; run `{reference.WRITE_COMMAND}`\n{shown}")


def test_every_recipe_field_has_a_description():
    missing = reference.missing_descriptions(RecipeConfig)
    assert missing == [], "fields without a comment beside them in their dataclass:\n" + "\n".join(missing)


def _fake_recipe(tmp_path, monkeypatch, name: str, extra: str = "") -> type:
    """The fake recipe's `Root`, from a module written under tmp_path (its source is read for comments)."""
    path = tmp_path / f"{name}.py"
    path.write_text(FAKE_RECIPE.format(extra=textwrap.indent(extra, "    ")))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module.Root


def test_the_page_lists_each_key_with_its_type_default_and_comment(tmp_path, monkeypatch):
    page = reference.render(_fake_recipe(tmp_path, monkeypatch, "fake_recipe_rows"))
    assert "## inner\n\nAn inner section.\n\nthe inner part\n" in page
    mode = "| `inner.mode` | one of `a`, `b` | `a` | how it goes; a: the first way \\| b: the second way |"
    assert mode in page
    assert "| `inner.engine` | mapping | `{}` | the engine's own settings by name |" in page
    assert "| `size` | int or null | `null` | None: as large as it gets |" in page
    assert "| `path` | str | `out/<name>` | where \\| what |" in page


def test_the_check_catches_a_new_field(tmp_path, monkeypatch, capsys):
    page = tmp_path / "recipe.md"
    before = _fake_recipe(tmp_path, monkeypatch, "fake_recipe_before")
    assert reference.main(["--write", str(page)], root=before) == 0
    assert reference.main(["--check", str(page)], root=before) == 0

    after = _fake_recipe(tmp_path, monkeypatch, "fake_recipe_after", "depth: int = 3  # levels deep\n")
    assert reference.main(["--check", str(page)], root=after) == 1
    assert f"{page} is stale: regenerate it with `python -m hybridflow.config.reference --write" in (
        capsys.readouterr().err
    )


def test_a_field_without_a_comment_is_named_with_its_file(tmp_path, monkeypatch, capsys):
    root = _fake_recipe(tmp_path, monkeypatch, "fake_recipe_bare", "depth: int = 3\n")
    source = tmp_path / "fake_recipe_bare.py"
    line = source.read_text().splitlines().index("    depth: int = 3") + 1
    assert reference.missing_descriptions(root) == [f"Inner.depth ({source}:{line}), e.g. inner.depth"]
    assert reference.main(["--write", str(tmp_path / "recipe.md")], root=root) == 1
    assert "Inner.depth" in capsys.readouterr().err
    assert not (tmp_path / "recipe.md").exists()
