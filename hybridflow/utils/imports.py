"""Objects a recipe names by import path: reward functions, tools, agent functions."""

import importlib
from typing import Any


def import_by_path(path: str, key: str, example: str) -> Any:
    """The object `package.module.name` (or `package.module:name`) names. ValueError naming the
    recipe `key`, the path and the problem (`example` shows the expected form)."""
    module_name, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{key}={path!r} must be a dotted path '{example}'")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{key}={path!r} cannot be imported: {err}") from err
