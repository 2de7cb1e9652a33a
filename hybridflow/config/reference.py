"""The recipe reference page (docs/reference/recipe.md), generated from the recipe's dataclasses.

Every key of `RecipeConfig` (schema.py, with the engine config classes it nests) is listed by its
dotted path with its type, its default and its description. The description is the comment beside
the field in the dataclass source (on the field's lines, or the comment lines right above it), read
here with `tokenize`, so each key is described in one place: its dataclass.

    python -m hybridflow.config.reference                                   # print the page
    python -m hybridflow.config.reference --write docs/reference/recipe.md  # regenerate it
    python -m hybridflow.config.reference --check docs/reference/recipe.md  # exit 1 if it is stale
"""

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import sys
import tokenize
import types
import typing
from pathlib import Path

from omegaconf import MISSING

ROOT = Path(__file__).resolve().parents[2]
PAGE = "docs/reference/recipe.md"
WRITE_COMMAND = f"python -m hybridflow.config.reference --write {PAGE}"


@dataclasses.dataclass
class Section:
    """One dataclass at one dotted path, with its table of rows (key, type, default, description)."""

    path: str
    cls: type
    note: str  # the comment beside the field that holds this dataclass, if any
    rows: list[tuple[str, str, str, str]]


def _comments_by_line(source: str) -> dict[int, str]:
    """Each comment's text (without `#`) by its line number."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0]: tok.string.lstrip("#").strip() for tok in tokens if tok.type == tokenize.COMMENT}


@functools.cache
def _module_fields(path: str) -> dict[tuple[str, str], tuple[str, int]]:
    """(class name, field name) -> (description, line) for every annotated field in the file. A field
    typed by a module-level alias (`mode: AsyncMode`) also gets the comment beside the alias, where
    the choices are explained."""
    source = Path(path).read_text()
    lines, comments = source.splitlines(), _comments_by_line(source)
    tree = ast.parse(source, filename=path)
    aliases = {
        node.targets[0].id: _comment_beside(node, lines, comments)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    described = {}
    for node in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                alias = aliases.get(item.annotation.id, "") if isinstance(item.annotation, ast.Name) else ""
                text = "; ".join(t for t in (_comment_beside(item, lines, comments), alias) if t)
                described[node.name, item.target.id] = (text, item.lineno)
    return described


def _comment_beside(node: ast.stmt, lines: list[str], comments: dict[int, str]) -> str:
    """The comment lines right above the statement, then the comments on its own lines, as one line."""
    above = node.lineno - 1
    while above >= 1 and lines[above - 1].strip().startswith("#"):
        above -= 1
    return " ".join(comments[n] for n in range(above + 1, node.end_lineno + 1) if comments.get(n))


def field_source(cls: type, name: str) -> tuple[str, str, int]:
    """(description, source file relative to the repository when inside it, line) of a field."""
    path = Path(inspect.getsourcefile(cls)).resolve()
    text, line = _module_fields(str(path)).get((cls.__name__, name), ("", 0))
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return text, str(shown), line


def sections(config: object, path: str = "", note: str = "") -> list[Section]:
    """`config`'s own keys as one section, then each nested dataclass's, depth first."""
    own = Section(path, type(config), note, [])
    nested = []
    hints = typing.get_type_hints(type(config))
    for item in dataclasses.fields(config):
        value, key = getattr(config, item.name), f"{path}.{item.name}" if path else item.name
        text = field_source(type(config), item.name)[0]
        if dataclasses.is_dataclass(value):
            nested.extend(sections(value, key, text))
            continue
        own.rows.append((key, type_name(hints[item.name]), default_text(value), text))
    return [own, *nested] if own.rows else nested


def type_name(hint: object) -> str:
    """A recipe author's name for a field's type: Literal choices listed, None as null."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in args)
    if origin in (typing.Union, types.UnionType):
        named = " or ".join(type_name(arg) for arg in args if arg is not type(None))
        return f"{named} or null" if type(None) in args else named
    if origin is list and args and args[0] is not typing.Any:
        inner = type_name(args[0])
        return f"list, each {inner}" if inner.startswith("one of") else f"list of {inner}"
    if origin is list or hint is list:
        return "list"
    if origin is dict or hint is dict:
        return "mapping"
    return "any" if hint is typing.Any else getattr(hint, "__name__", str(hint))


def default_text(value: object) -> str:
    """The default as YAML would write it (`null`, `true`, `[a, b]`); a required key says so."""
    if value == MISSING:
        return "required"
    return f"`{_yaml_value(value)}`"


def _yaml_value(value: object) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value if value else '""'
    return repr(value)


def cell(text: str, in_table: bool = True) -> str:
    """Text safe in Markdown (a table cell: `|` escaped). Outside code spans `<` and `*` are
    escaped: `<output_dir>` would be read as an HTML tag, `a * b * c` as emphasis."""
    parts = (text.replace("|", "\\|") if in_table else text).split("`")
    plain = {i: part.replace("<", "&lt;").replace("*", "\\*") for i, part in enumerate(parts) if i % 2 == 0}
    return "`".join(plain.get(i, part) for i, part in enumerate(parts))


def missing_descriptions(root: type) -> list[str]:
    """`Class.field (file:line)` of each field under `root` with no comment beside it in its source."""
    missing = {}
    for section in sections(root()):
        for key, *_, text in section.rows:
            name = key.rsplit(".", 1)[-1]
            if not text:
                _, path, line = field_source(section.cls, name)
                missing.setdefault(f"{section.cls.__name__}.{name} ({path}:{line})", key)
    return [f"{where}, e.g. {key}" for where, key in missing.items()]


def render(root: type) -> str:
    """The whole page for the dataclass `root` (RecipeConfig for the recipe)."""
    found = sections(root())
    lines = [
        "# Recipe reference",
        "",
        f"<!-- Generated by `{WRITE_COMMAND}`; edit the comments beside the fields instead. -->",
        "",
        f"This page is generated by `{WRITE_COMMAND}` from the recipe's dataclasses.",
        "A key's description is the comment beside its field in the source file named under its",
        "section: edit it there, then regenerate this page.",
        "",
        "A recipe sets a key as nested YAML (`actor:` / `optim:` / `lr: 1e-6`), or on the command line",
        "as `key.path=value` (`bash scripts/run_recipe.sh recipes/quickstart.yaml actor.optim.lr=1e-6`).",
        "A key left out keeps its default. Keys of type *mapping* pass an engine's own settings",
        "through by the engine's own names; they are checked against the pinned engine version when",
        "the recipe loads, and are not listed here.",
        "",
    ]
    for section in found:
        lines += _section_lines(section)
    return "\n".join(lines)


def _section_lines(section: Section) -> list[str]:
    doc = section.cls.__doc__ or ""
    doc = "" if doc.startswith(f"{section.cls.__name__}(") else doc  # dataclass's generated signature
    where = field_source(section.cls, section.rows[0][0].rsplit(".", 1)[-1])[1]
    lines = [f"{'#' * min(2 + section.path.count('.'), 4)} {section.path or 'top level'}", ""]
    lines += [cell(" ".join(part.split()), in_table=False) + "\n" for part in (doc, section.note) if part]
    lines += [f"`{section.cls.__name__}` in `{where}`.", ""]
    lines += ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    lines += [f"| `{key}` | {kind} | {default} | {cell(text)} |" for key, kind, default, text in section.rows]
    return [*lines, ""]


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hybridflow.config.reference",
        description="Generate the recipe reference page from the recipe's dataclasses "
        "(hybridflow/config/schema.py and the engine configs it nests). Prints it without options.",
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="PAGE", nargs="?", const=PAGE, help=f"write it (default {PAGE})")
    action.add_argument(
        "--check", metavar="PAGE", nargs="?", const=PAGE, help=f"exit 1 if PAGE (default {PAGE}) is stale"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, root: type | None = None) -> int:
    """The command line; `root` defaults to RecipeConfig (tests pass their own dataclass)."""
    if root is None:
        from hybridflow.config.schema import RecipeConfig

        root = RecipeConfig
    args = _arguments(argv)
    missing = missing_descriptions(root)
    if missing:
        heading = "fields without a description; add a comment beside each:"
        print(heading, *missing, sep="\n  ", file=sys.stderr)
        return 1
    page = render(root)
    if args.check:
        current = Path(args.check).read_text() if Path(args.check).is_file() else ""
        if current != page:
            command = f"python -m hybridflow.config.reference --write {args.check}"
            print(f"{args.check} is stale: regenerate it with `{command}`", file=sys.stderr)
            return 1
    elif args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(page)
    else:
        print(page, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
