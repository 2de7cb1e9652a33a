"""Engine settings passed through by the engine's own names (Megatron-Core's config dataclasses,
SGLang's `ServerArgs`): each name is checked against the engine's field list before any worker
starts, so a misspelt one fails with the nearest valid name instead of reaching the engine."""

import difflib
from collections.abc import Iterable, Mapping


def check_setting_names(
    section: str, settings: Mapping, valid: Iterable[str], owner: str, set_elsewhere: Mapping[str, str]
) -> None:
    """ValueError unless every key of `settings` is in `valid` (the fields of `owner`) and none is
    one hybridflow sets itself (`set_elsewhere` maps those to where the recipe sets them)."""
    valid = sorted(valid)
    for name in settings:
        if name in set_elsewhere:
            raise ValueError(f"{section}.{name}: hybridflow sets {owner}.{name} from {set_elsewhere[name]}")
        if name not in valid:
            nearest = difflib.get_close_matches(name, valid, n=1)
            hint = f"did you mean {section}.{nearest[0]}?" if nearest else f"valid names: {valid}"
            raise ValueError(f"{section}.{name} is not a field of {owner}; {hint}")


# How a YAML value reads in a field's kinds (engines/rollout/vllm_engine_args.py ENGINE_ARGS_KINDS)
VALUE_KINDS = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    type(None): "null",
    list: "list",
    dict: "dict",
}


def check_setting_values(
    section: str,
    settings: Mapping,
    kinds: Mapping[str, tuple[str, ...]],
    choices: Mapping[str, tuple],
    owner: str,
) -> None:
    """ValueError naming `section.name` for a value whose kind the field does not take (`kinds`: a
    quoted 8 or false is a string in YAML) or that is none of its choices (`choices`, the Literal
    fields); fields in neither mapping are not checked."""
    for name, value in settings.items():
        takes, options = kinds.get(name, ()), choices.get(name, ())
        if (takes or options) and not _fits(value, takes, options):
            raise ValueError(
                f"{section}.{name}={value!r} " + _unfit(value, takes, options, f"{owner}.{name}")
            )


def _fits(value, takes: tuple[str, ...], options: tuple) -> bool:
    kind = VALUE_KINDS.get(type(value))
    if kind in takes or (kind == "int" and "float" in takes):
        return True
    return any(value == option and type(value) is type(option) for option in options)


def _unfit(value, takes: tuple[str, ...], options: tuple, field: str) -> str:
    """What is wrong with `value` for `field` and the fix (after `section.name=value `)."""
    kind = VALUE_KINDS.get(type(value), type(value).__name__)
    if options:
        nearest = difflib.get_close_matches(str(value), [str(o) for o in options], n=1)
        also = f" (or a {' or '.join(takes)})" if takes else ""
        return f"is not one of {field}'s choices {list(options)}{also}" + (
            f"; did you mean {nearest[0]!r}?" if nearest else ""
        )
    quoted = (
        " (quoted, a number or a boolean is a string in YAML: remove the quotes)" if kind == "str" else ""
    )
    article = "an" if kind[0] in "aeiou" else "a"
    return f"is {article} {kind}, but {field} takes {' or '.join(takes)}{quoted}"


# A bound's name (annotated_types, as vLLM's pydantic configs write them) -> (its test, its symbol)
BOUND_TESTS = {
    "ge": (lambda value, bound: value >= bound, ">="),
    "gt": (lambda value, bound: value > bound, ">"),
    "le": (lambda value, bound: value <= bound, "<="),
    "lt": (lambda value, bound: value < bound, "<"),
}


def check_setting_bounds(
    section: str, settings: Mapping, bounds: Mapping[str, tuple[tuple[str, float], ...]], owner: str
) -> None:
    """ValueError naming `section.name` for a number outside the bounds the engine's own config
    puts on it (`bounds`: name -> (ge | gt | le | lt, bound) pairs); other values pass (their kind
    is check_setting_values')."""
    for name, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        failed = [
            f"{BOUND_TESTS[b][1]} {bound}"
            for b, bound in bounds.get(name, ())
            if not BOUND_TESTS[b][0](value, bound)
        ]
        if failed:
            raise ValueError(
                f"{section}.{name} must be {' and '.join(failed)} ({owner}.{name}'s bounds), got {value}"
            )
