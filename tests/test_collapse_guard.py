"""The collapse guard end to end (the tiny GRPO run of tests/tiny_run.py, in process on this pytest
worker's Ray cluster: tests/recipe_runs.py):

- lr 1.0 (allowed by widening actor.optim.lr_limits) makes Adam's first step move every weight by
  about 1, many times the weights' norm: the run stops at step 1 with one `error:` line naming the
  update-to-weight ratio and the setting, before any checkpoint (save_freq=1) or export;
- under trainer.nonfinite_policy=skip the same run completes, counts both steps as skipped, and
  exports the initial weights untouched;
- an lr outside optim.lr_limits never gets that far (tests/test_bad_inputs.py, "lr 1e30").
"""

from pathlib import Path

import pytest
import torch
from hf_weights import load_hf_tensors
from recipe_runs import run_recipe_in_process
from tiny_run import RECIPE, overrides, tiny_run_inputs

from hybridflow.utils.tracking import read_metrics

pytestmark = pytest.mark.slow
LR_ONE = ("actor.optim.lr_limits=[1e-9,10]", "actor.optim.lr=1.0", "actor.optim.lr_warmup_iters=0")
# The rule reward scores a random tiny model's responses 0 alike: zero advantages, zero gradients,
# no update to guard. The share of digits differs between responses.
DIGIT_SHARE = """
def digit_share(data_source, solution_str, ground_truth, extra_info):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


@pytest.fixture(scope="module")
def local(tmp_path_factory, ray_cluster) -> dict:
    root = tmp_path_factory.mktemp("collapse")
    (root / "digit_reward.py").write_text(DIGIT_SHARE)
    return tiny_run_inputs(root)


def run(local: dict, output_dir: Path, *extra: str):
    settings = overrides(
        local,
        output_dir,
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
        "reward.custom_fn=digit_reward.digit_share",
        *LR_ONE,
        *extra,
    )
    return run_recipe_in_process(RECIPE, settings, pythonpath=local["root"])


def test_an_update_that_dwarfs_the_weights_stops_the_run_before_any_checkpoint(local, tmp_path):
    result = run(local, tmp_path / "run", "trainer.export_hf=true")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]  # the run ended elsewhere: show where
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: step 1: actor/update_ratio_max is "), last
    assert ", over actor.update.max_update_ratio=0.25: an optimizer step would move the weights" in last
    ratio = float(last.split("actor/update_ratio_max is ")[1].split(",")[0])
    assert ratio > 1  # the update is larger than the weights themselves
    assert not (tmp_path / "run" / "checkpoints").exists() or not list(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
    assert not (tmp_path / "run" / "hf").exists()


def test_under_the_skip_policy_refused_updates_are_counted_and_the_weights_kept(local, tmp_path):
    result = run(local, tmp_path / "run", "trainer.nonfinite_policy=skip", "trainer.export_hf=true")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "step 1 skipped: actor/update_ratio_max is " in result.stdout
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["nonfinite/skipped_steps"]) for r in rows] == [(1, 1), (2, 2)]
    exported, initial = load_hf_tensors(tmp_path / "run" / "hf"), load_hf_tensors(Path(local["model"]))
    assert exported.keys() == initial.keys()
    assert all(torch.equal(exported[k], initial[k]) for k in initial)
