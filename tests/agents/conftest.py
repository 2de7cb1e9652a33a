"""The tool-using tiny model, fitted once per session (tool_model.py)."""

import pytest
from tool_model import make_tool_using_model


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    return make_tool_using_model(tmp_path_factory.mktemp("tool_model") / "model")
