"""`make test` after `make quickstart` (the README's order) passes as on a fresh clone: no test
depends on what a run leaves, or does not leave, in the working tree.

The shipped recipes name paths relative to the working directory (outputs/quickstart/...,
data/gsm8k/..., models/...). The tests that read them in-process run in a directory laid out as
`make quickstart` leaves the working tree (tests/working_tree.py, conftest's
`in_quickstart_working_tree`); the tests that run them in a subprocess point every path at their
own tmp_path. This module checks that the tree is what a finished quickstart leaves, and that every
module reading a shipped recipe in-process runs in it.
"""

import re
from pathlib import Path

import pytest

from hybridflow.checks.recipe import validate_recipe
from hybridflow.config.loader import load_recipe
from hybridflow.trainer.resume import plan_resume

TESTS = Path(__file__).resolve().parent
READS_A_RECIPE = re.compile(r"\b(load_recipe|main)\(")
NAMES_A_SHIPPED_RECIPE = re.compile(r"[\"'/]recipes[\"'/]")


@pytest.mark.usefixtures("in_quickstart_working_tree")
@pytest.mark.parametrize("recipe", ["quickstart", "tool_demo"])
def test_the_tree_is_a_finished_quickstart(recipe):
    """The RL stage validates as shipped (its warm start and data are there) and a rerun would
    resume from its last checkpoint."""
    cfg = load_recipe(TESTS.parent / "recipes" / f"{recipe}.yaml")
    validate_recipe(cfg, cuda_available=False)
    plan = plan_resume(cfg)
    assert plan is not None and plan.state["global_step"] == cfg.trainer.total_training_steps


def test_every_module_that_reads_a_shipped_recipe_in_process_runs_in_the_tree():
    readers = [
        path
        for path in TESTS.rglob("*.py")
        if READS_A_RECIPE.search(text := path.read_text()) and NAMES_A_SHIPPED_RECIPE.search(text)
    ]
    assert TESTS / "test_config.py" in readers  # the scan finds them
    # a subprocess worker script (tests/_*.py) runs in its own directory instead (os.chdir)
    in_own_dir = [p for p in readers if p.name.startswith("_") and "os.chdir(" in p.read_text()]
    outside = [
        p.name for p in readers if p not in in_own_dir and "in_quickstart_working_tree" not in p.read_text()
    ]
    assert outside == [], f"{outside} read a shipped recipe outside in_quickstart_working_tree"
