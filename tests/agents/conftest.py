"""The tool-using tiny model, fitted once per test run (tool_model.py)."""

import os

import pytest
from filelock import FileLock
from tool_model import make_tool_using_model


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """Under pytest-xdist (`make test`) every worker has a session of its own; they share the run's
    temporary directory, where the first to get the lock fits the model and the others read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, above each worker's popen-gwK/
    model_dir, done = root / "tool_model" / "model", root / "tool_model" / "fitted"
    with FileLock(root / "tool_model.lock"):
        if not done.exists():
            make_tool_using_model(model_dir)
            done.touch()
    return model_dir
