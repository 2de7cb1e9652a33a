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
