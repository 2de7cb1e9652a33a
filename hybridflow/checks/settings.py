"""Reading a recipe's settings by key path and against their defaults: what the other checks use to
name a changed setting nothing reads, and a NaN that passes every range check.
"""

import dataclasses
import math

from hybridflow.config.schema import RecipeConfig


def _get(cfg: RecipeConfig, key_path: str):
    node = cfg
    for key in key_path.split("."):
        node = getattr(node, key)
    return node


def _changed(value, default, key: str) -> list[str]:
    """`key=value` for each field of the dataclass `value` that differs from `default`'s (nested
    dataclasses field by field, by their full key)."""
    if dataclasses.is_dataclass(value):
        return [
            change
            for f in dataclasses.fields(value)
            for change in _changed(getattr(value, f.name), getattr(default, f.name), f"{key}.{f.name}")
        ]
    if value == default:
        return []
    return [f"{key}={str(value).lower() if isinstance(value, bool) else value}"]


def _changed_fields(value, key: str, names: tuple[str, ...]) -> list[str]:
    """`_changed` of the fields `names` of `value` against its class's defaults."""
    default = type(value)()
    return [
        c for name in names for c in _changed(getattr(value, name), getattr(default, name), f"{key}.{name}")
    ]


def _no_effect(changed: list[str], because: str, fix: str) -> list[str]:
    """One message naming every setting in `changed`; `fix` may say {it} (one setting) or {them}."""
    if not changed:
        return []
    verb, it = ("has", "it") if len(changed) == 1 else ("have", "them")
    return [f"{', '.join(changed)} {verb} no effect with {because}{fix.format(it=it)}"]


def _nan_keys(value, key: str) -> list[str]:
    """The keys under `key` whose value is NaN (dataclass fields, dict entries, list items)."""
    if dataclasses.is_dataclass(value):
        return [
            k for f in dataclasses.fields(value) for k in _nan_keys(getattr(value, f.name), f"{key}.{f.name}")
        ]
    if isinstance(value, dict):
        return [k for name, item in value.items() for k in _nan_keys(item, f"{key}.{name}")]
    if isinstance(value, list | tuple):
        return [k for index, item in enumerate(value) for k in _nan_keys(item, f"{key}[{index}]")]
    return [key] if isinstance(value, float) and math.isnan(value) else []


def _check_not_a_number(cfg: RecipeConfig, errors: list[str]) -> list[str]:
    """A NaN (YAML's .nan) passes every range check, since each comparison with it is false; one
    error a key, unless another error already names that key."""
    keys = [key for f in dataclasses.fields(cfg) for key in _nan_keys(getattr(cfg, f.name), f.name)]
    return [
        f"{key}=nan is not a number; set a finite value" for key in keys if not any(key in e for e in errors)
    ]
