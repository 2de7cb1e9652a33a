"""The train-inference mismatch monitor: its statistics against values worked out by hand, and what
trainer.mismatch_policy does with a step over the threshold (the recipe checks for its keys too).
The end-to-end run with a corrupted engine is tests/test_mismatch_stop.py."""

import math

import pytest
import torch

from hybridflow.algorithms.mismatch import log_prob_mismatch
from hybridflow.checks.algorithm import _check_mismatch_monitor
from hybridflow.config.schema import RecipeConfig, TrainerConfig
from hybridflow.protocol import DataProto
from hybridflow.trainer.mismatch import TrainInferenceMismatchError, check_mismatch

LOG = math.log
# Row 0: the actor agrees on token 0 and halves token 1 (pi = 0.25, mu = 0.5); token 2 is padding
# with a wild value that must not count. Row 1: pi = 0.9 against mu = 0.3 on its one token.
OLD = torch.tensor([[LOG(0.5), LOG(0.25), 0.0], [LOG(0.9), 0.0, 0.0]])
ROLLOUT = torch.tensor([[LOG(0.5), LOG(0.5), -50.0], [LOG(0.3), 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_statistics_equal_hand_computed_values():
    stats = log_prob_mismatch(OLD, ROLLOUT, MASK, token_threshold=0.5)
    # |log pi - log mu| per valid token: 0, log 2, log 3
    assert stats["mismatch/log_prob_abs_diff_mean"] == pytest.approx((LOG(2) + LOG(3)) / 3)
    assert stats["mismatch/log_prob_abs_diff_max"] == pytest.approx(LOG(3))
    # k3 = rho - 1 - log rho with rho = pi / mu: 1 -> 0; 0.5 -> -0.5 + log 2; 3 -> 2 - log 3
    assert stats["mismatch/kl_k3"] == pytest.approx((0 + (-0.5 + LOG(2)) + (2 - LOG(3))) / 3)
    assert stats["mismatch/tokens_over_threshold"] == pytest.approx(2 / 3)  # log 2, log 3 > 0.5
    higher = log_prob_mismatch(OLD, ROLLOUT, MASK, token_threshold=0.7)
    assert higher["mismatch/tokens_over_threshold"] == pytest.approx(1 / 3)  # log 3 only


def test_agreeing_engine_and_actor_give_zeros_and_an_empty_mask_gives_zeros():
    same = log_prob_mismatch(OLD, OLD, MASK, 0.5)
    assert same == {key: 0.0 for key in same}
    assert set(log_prob_mismatch(OLD, ROLLOUT, torch.zeros_like(MASK), 0.5).values()) == {0.0}


def batch(rollout: torch.Tensor | None = ROLLOUT) -> DataProto:
    tensors = {"old_log_probs": OLD, "response_mask": MASK}
    if rollout is not None:
        tensors["rollout_log_probs"] = rollout
    return DataProto.from_dict(tensors)


def test_stop_names_the_metric_its_value_and_the_step():
    cfg = TrainerConfig(mismatch_policy="stop", mismatch_threshold=0.2)  # k3 mean is 0.3648
    with pytest.raises(TrainInferenceMismatchError) as err:
        check_mismatch(batch(), cfg, step=7)
    assert str(err.value).startswith(
        "step 7: mismatch/kl_k3 is 0.3648, over trainer.mismatch_threshold=0.2: the rollout engine's"
    )
    assert "stops before this step's update, with no checkpoint" in str(err.value)


def test_warn_prints_and_returns_the_metrics_and_below_the_threshold_is_silent(capsys):
    stats = check_mismatch(batch(), TrainerConfig(mismatch_threshold=0.2), step=3)
    assert stats["mismatch/kl_k3"] == pytest.approx(0.3648, abs=1e-4)
    assert capsys.readouterr().out.startswith("warning: step 3: mismatch/kl_k3 is 0.3648")
    check_mismatch(batch(), TrainerConfig(mismatch_policy="stop", mismatch_threshold=0.5), step=3)
    assert capsys.readouterr().out == ""
    assert check_mismatch(batch(rollout=None), TrainerConfig(mismatch_policy="stop"), step=3) == {}


def test_recipe_check_names_the_keys():
    cfg = RecipeConfig()
    assert cfg.rollout.calculate_log_probs  # on by default: the monitor runs in every run
    cfg.trainer.mismatch_policy, cfg.rollout.calculate_log_probs = "stop", False
    cfg.trainer.mismatch_threshold = 0.0
    assert _check_mismatch_monitor(cfg) == [
        "trainer.mismatch_threshold must be positive, got 0.0",
        "trainer.mismatch_policy=stop compares the rollout engine's log-probs with the actor's: set "
        "rollout.calculate_log_probs=true",
    ]


def with_top_k(actor_top1: torch.Tensor) -> DataProto:
    """The batch above with an engine's top-2 (rollout.top_k_log_probs=2) and the actor's view of
    it: on the three response tokens the same log-probs (mu = pi there); on the padding token wild
    values that would count if the mask were ignored."""
    data = batch()
    ids = torch.tensor([[[3, 1], [0, 2], [5, 4]], [[1, 0], [0, 1], [0, 1]]])  # (B, R, K)
    engine = torch.tensor([[[LOG(0.6), LOG(0.2)]] * 3, [[LOG(0.5), LOG(0.4)]] * 3])  # (B, R, K)
    actor = engine.clone()
    actor[0, 2] = torch.tensor([LOG(0.01), 0.0])  # padding
    data.batch["rollout_top_k_ids"], data.batch["rollout_top_k_log_probs"] = ids, engine
    data.batch["actor_top_k_log_probs"], data.batch["actor_top1_ids"] = actor, actor_top1
    return data


def test_the_top_k_check_runs_over_the_response_tokens_when_the_engine_returned_its_top_k():
    agreeing = torch.tensor([[3, 0, 9], [1, 9, 9]])  # the engine's top-1 where it counts
    stats = check_mismatch(with_top_k(agreeing), TrainerConfig(mismatch_threshold=1.0), step=1)
    assert stats["mismatch/top_k_kl_max"] == pytest.approx(0.0, abs=1e-7)
    assert stats["mismatch/top1_agreement"] == 1.0
    one_differs = torch.tensor([[3, 2, 5], [1, 0, 0]])  # position (0, 1): the actor prefers token 2
    stats = check_mismatch(with_top_k(one_differs), TrainerConfig(mismatch_threshold=1.0), step=1)
    assert stats["mismatch/top1_agreement"] == pytest.approx(2 / 3)
    assert "mismatch/top_k_kl_mean" not in check_mismatch(batch(), TrainerConfig(mismatch_threshold=1.0), 1)
