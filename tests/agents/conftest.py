"""The tool-using tiny model, fitted once per test run (tool_model.py)."""

import pytest
from made_once import made_once, run_shared_dir
from tool_model import make_tool_using_model


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory, worker_id):
    """Fitted once per pytest run (made_once): under pytest-xdist (`make test`) the first worker to
    ask fits it, the others wait and read it."""
    root = run_shared_dir(tmp_path_factory, worker_id) / "tool_model"
    made_once(root, lambda out: make_tool_using_model(out / "model"))
    return root / "model"
