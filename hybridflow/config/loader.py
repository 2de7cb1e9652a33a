"""Loads a recipe: YAML file + `key.path=value` overrides -> a typed `RecipeConfig`.

OmegaConf structured configs do the typed merge (unknown keys and wrong types are rejected
against the dataclasses, override values parse as YAML so lists and booleans work); writing that
by hand would re-implement a well-kept library. This module only turns OmegaConf's errors into
messages that name the key path and the fix, and writes the resolved recipe.
"""

import dataclasses
import difflib
import re
import typing
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from hybridflow.config.schema import RecipeConfig


def load_recipe(path: str | Path, overrides: list[str] = ()) -> RecipeConfig:
    """The recipe at `path` with `overrides` ("a.b=1", "data.train_files=[x.parquet]") applied."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path} does not exist")
    merged = OmegaConf.structured(RecipeConfig)
    merged = _merge(merged, _read_yaml(path), source=str(path))
    merged = _merge(merged, _parse_overrides(overrides), source="command-line override")
    try:
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as err:
        raise ValueError(
            f"{path}: {err.full_key} is required; set it in the recipe or pass {err.full_key}=<value>"
        ) from None
    except ValueError as err:  # an engine config's own __post_init__ check
        where = f"{path}{' with the command-line overrides' if overrides else ''}"
        raise ValueError(f"{where}: {_with_role(merged, str(err))}") from None


# A Megatron pass-through error names its key from `megatron.` on (MegatronConfig knows no role)
MEGATRON_KEY = re.compile(r"megatron\.(transformer|ddp|optimizer)\.(\w+)")
MEGATRON_ROLES = ("actor", "critic", "reward_model", "teacher")


def _with_role(merged: DictConfig, message: str) -> str:
    """`message` with the role in front of a `megatron.<section>.<name>` it starts with, when one
    role of the recipe sets that key."""
    key = MEGATRON_KEY.match(message)
    if key is None:
        return message
    roles = [r for r in MEGATRON_ROLES if OmegaConf.select(merged, f"{r}.{key[0]}", default=None) is not None]
    return f"{roles[0]}.{message}" if len(roles) == 1 else message


def _yaml_problem(err: yaml.YAMLError) -> str:
    """`<problem> at line L, column C` from a YAML error (its own text spans several lines)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or type(err).__name__}{where}"


def _read_yaml(path: Path) -> DictConfig:
    try:
        recipe = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
    if isinstance(recipe, ListConfig):
        raise ValueError(
            f"{path} holds a YAML list; a recipe is a mapping of sections (model:, data:, actor:, ...)"
        )
    return recipe


def _parse_overrides(overrides: list[str]) -> DictConfig:
    malformed = [o for o in overrides if "=" not in o or o.startswith("=")]
    if malformed:
        raise ValueError(f"overrides must look like key.path=value, got {malformed}")
    parsed = OmegaConf.create()
    for override in overrides:
        try:
            parsed = OmegaConf.merge(parsed, OmegaConf.from_dotlist([override]))
        except yaml.YAMLError as err:
            raise ValueError(
                f"command-line override {override!r}: the value is not valid YAML ({_yaml_problem(err)})"
            ) from None
    return parsed


# Keys a recipe may still carry from an older layout: key -> where it is now and what to change.
MOVED_KEYS = {
    "actor.update.off_policy": (
        "algorithm.rollout_correction; its mode, lower, upper and level keep their names (write "
        "algorithm.rollout_correction.mode=... in place of actor.update.off_policy.mode=...)"
    ),
}


def _moved(full_key: str) -> str | None:
    """The refusal of a key under one of MOVED_KEYS, else None."""
    for old, where in MOVED_KEYS.items():
        if full_key == old or full_key.startswith(old + "."):
            return f"{old} moved to {where}"
    return None


def _merge(base: DictConfig, update: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)
    except ConfigKeyError as err:
        moved = _moved(err.full_key)
        if moved is not None:
            raise ValueError(f"{source}: {moved}") from None
        raise ValueError(f"{source}: unknown key '{err.full_key}'{_suggestion(err.full_key)}") from None
    except ValidationError as err:
        choices = _literal_choices(err.full_key)
        if choices is not None:
            nearest = difflib.get_close_matches(str(err.value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
            raise ValueError(
                f"{source}: {err.full_key}={err.value!r} is not one of {list(choices)}{hint}"
            ) from None
        expected = _field_type(err.full_key)
        reason = str(err.msg).splitlines()[0]  # the rest repeats the key and the dataclass
        raise TypeError(f"{source}: {err.full_key}: {reason}; expected {expected}") from None
    except OmegaConfBaseException as err:
        raise ValueError(f"{source}: {err}") from None


def _schema_at(key_path: list[str]) -> type | None:
    """The dataclass reached by following `key_path` from RecipeConfig, or None."""
    node = RecipeConfig
    for key in key_path:
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if key not in fields:
            return None
        node = typing.get_type_hints(node)[key]
    return node if dataclasses.is_dataclass(node) else None


def _suggestion(full_key: str) -> str:
    *parents, leaf = full_key.split(".")
    node = _schema_at(parents)
    if node is None:
        return ""
    valid = [f.name for f in dataclasses.fields(node)]
    nearest = difflib.get_close_matches(leaf, valid, n=1)
    prefix = ".".join(parents) + "." if parents else ""
    if nearest:
        return f"; did you mean '{prefix}{nearest[0]}'?"
    return f"; valid keys under '{prefix.rstrip('.') or 'the top level'}': {valid}"


def _field_hint(full_key: str):
    """The schema's type annotation of `full_key` ("a.b" or "a.b[0]", a list's element), or None."""
    *parents, leaf = full_key.split(".")
    leaf, is_element = leaf.split("[")[0], "[" in leaf
    node = _schema_at(parents)
    if node is None or leaf not in {f.name for f in dataclasses.fields(node)}:
        return None
    hint = typing.get_type_hints(node)[leaf]
    return typing.get_args(hint)[0] if is_element and typing.get_args(hint) else hint


def _literal_choices(full_key: str) -> tuple | None:
    hint = _field_hint(full_key)
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def _field_type(full_key: str) -> str:
    hint = _field_hint(full_key)
    if hint is None:
        return "a value of the schema's type"
    return getattr(hint, "__name__", str(hint)) if not typing.get_args(hint) else str(hint)


def to_yaml(cfg: RecipeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RecipeConfig) -> dict:
    """The recipe as plain dicts/lists/scalars (for checkpoints and experiment trackers)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def write_resolved_recipe(cfg: RecipeConfig, output_dir: str | Path) -> Path:
    """Writes the fully resolved recipe to `<output_dir>/config.yaml`."""
    out = Path(output_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_yaml(cfg))
    return out
