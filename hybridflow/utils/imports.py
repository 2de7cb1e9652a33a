"""The one loader of what a recipe names by import path: reward functions, tools, agent functions.

User code runs when its module is imported and when a named class is built (a tool's constructor
may refuse the machine, as the Python sandbox does when a kernel layer cannot be applied). Any
exception either raises is turned into a `DottedPathError` naming the recipe key, the path and the
first line of the cause, so the driver reports it as one `error:` line before Ray starts.
"""

import importlib
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DottedPathError(ValueError):
    """A recipe's import path that does not load: the key, the path and the cause."""


def import_by_path(path: str, key: str, example: str) -> Any:
    """The object `package.module.name` (or `package.module:name`) names. DottedPathError naming the
    recipe `key`, the path and the problem (`example` shows the expected form)."""
    module_name, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise DottedPathError(f"{key}={path!r} must be a dotted path '{example}'")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (Exception, SystemExit) as err:  # the module's own code runs here: anything may come out
        raise DottedPathError(f"{key}={path!r} cannot be imported: {first_line(err)}") from err


def load_by_path(path: str, key: str, example: str, build: Callable[[Any], T]) -> T:
    """`build(the object path names)`, e.g. a tool's constructor; what it raises is named as
    import_by_path names what an import raises."""
    obj = import_by_path(path, key, example)
    try:
        return build(obj)
    except (Exception, SystemExit) as err:
        raise DottedPathError(f"{key}={path!r} cannot be built: {first_line(err)}") from err


def parameter_names(fn: object, path: str, key: str) -> tuple[str, ...]:
    """The names of the parameters of the function `path` named; DottedPathError naming `key` when it
    is not a callable with a signature."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as err:  # not a callable, or one without a signature
        raise DottedPathError(f"{key}={path!r} names {fn!r}, which is not a function: {err}") from err


def first_line(err: BaseException) -> str:
    """`RuntimeError: the message's first line` (a traceback-free summary of the cause)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
