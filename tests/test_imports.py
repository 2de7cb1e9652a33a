"""Recipe import paths (reward.custom_fn, rollout.agent.tools, agent functions) resolve by dots or
a colon, and a bad one is a ValueError naming the key and the path."""

import json

import pytest

from hybridflow.utils.imports import import_by_path


def test_dotted_and_colon_paths_name_the_same_object():
    assert import_by_path("json.dumps", "k", "m.f") is json.dumps
    assert import_by_path("json:dumps", "k", "m.f") is json.dumps
    assert import_by_path("json.decoder:JSONDecoder", "k", "m.f") is json.JSONDecoder


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("dumps", "reward.custom_fn='dumps' must be a dotted path 'pkg.module.fn'"),
        ("json:", "reward.custom_fn='json:' must be a dotted path"),
        ("no_such_module.fn", "reward.custom_fn='no_such_module.fn' cannot be imported: No module"),
        ("json.no_such_fn", "cannot be imported: module 'json' has no attribute 'no_such_fn'"),
    ],
)
def test_a_bad_path_names_the_key_and_the_problem(path, message):
    with pytest.raises(ValueError) as caught:
        import_by_path(path, "reward.custom_fn", "pkg.module.fn")
    assert message in str(caught.value)
