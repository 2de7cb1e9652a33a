"""The learning tests' stage 2 (tests/test_quickstart_learning.py, tests/test_distillation_learning.py,
tests/test_vlm_learning.py): a quickstart recipe from its SFT warm start (`quickstart_warm_start`,
tests/conftest.py; `vlm_warm_start`, tests/test_vlm_learning.py) for STEPS steps, through
scripts/run_recipe.sh, unchanged but for the paths, validation at step 0 and the last step only and
no checkpoints or export; and the check that held-out accuracy rose."""

from pathlib import Path

import pytest
from process_group import run_recipe_script

from hybridflow.utils.tracking import read_metrics

STEPS = 20
MARGIN = 0.08  # held-out accuracy that STEPS steps must add (8 points)
RUN_TIMEOUT_S = 1200  # each recipe run of a learning test: its stage 1, a teacher, its stage 2


def learning_test_marks(runs: int) -> list[pytest.MarkDecorator]:
    """A learning test file's `pytestmark`: `slow` (its file runs early), `learning` (`make
    test-learning` runs it, `make test` leaves it out) and a pytest-timeout for an item that may make
    `runs` recipe runs: the timeout counts fixture setup, and the first item to ask for a warm start
    (or a teacher) builds it. The suite's 900 s is not enough on a slow day: the distillation test's
    warm start and teacher took 630 s there, its own run 270 s (2026-11-27)."""
    return [pytest.mark.slow, pytest.mark.learning, pytest.mark.timeout(runs * RUN_TIMEOUT_S)]


def run_sft_warm_start(recipe: str, model: Path, data: dict, root: Path) -> dict:
    """Stage 1: the SFT `recipe` on `model` and `data` (train / test parquet) into <root>/sft, without
    its validation passes; the paths stage 2 reads: the data's and the export's (`hf`)."""
    overrides = [
        *warm_start_overrides({**data, "hf": model}, root / "sft"),
        "trainer.logger=[console]",
        "trainer.test_freq=0",
    ]
    done = run_recipe_script(recipe, overrides, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {**data, "hf": root / "sft" / "hf"}


def run_from_warm_start(recipe: str, warm_start: dict, out: Path, extra: list[str]) -> list[dict]:
    """`recipe` from the warm start for STEPS steps, with `extra` overrides; its metrics records."""
    overrides = [
        *warm_start_overrides(warm_start, out),
        f"trainer.total_training_steps={STEPS}",
        f"trainer.test_freq={STEPS}",
        "trainer.save_freq=0",
        "trainer.export_hf=false",
        "trainer.logger=[console]",
        *extra,
    ]
    done = run_recipe_script(recipe, overrides, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_metrics(out / "metrics.jsonl")


def warm_start_overrides(warm_start: dict, out: Path) -> list[str]:
    """A quickstart recipe's overrides for a run from the warm start's export and data into `out`."""
    return [
        f"model.path={warm_start['hf']}",
        f"data.train_files=[{warm_start['train']}]",
        f"data.val_files=[{warm_start['test']}]",
        f"trainer.output_dir={out}",
    ]


def check_accuracy_rises(records: list[dict]) -> None:
    accuracy = {r["step"]: r["val/accuracy"] for r in records if "val/accuracy" in r}
    assert sorted(accuracy) == [0, STEPS]
    before, after = accuracy[0], accuracy[STEPS]
    assert before > 0.1, f"the warm start answers {before:.1%}: too few for RL to have a signal"
    assert after - before >= MARGIN, f"held-out accuracy {before:.1%} -> {after:.1%} after {STEPS} steps"
