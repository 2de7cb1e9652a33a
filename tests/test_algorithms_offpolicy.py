"""Off-policy correction (truncated IS, masked IS, AReaL's decoupled PPO) against hand-computed
values, its wiring into the actor's batch, and the recipe checks that guard it."""

import math
from pathlib import Path

import pytest
import torch

from engines.megatron.actor import off_policy_correction
from hybridflow.algorithms import compute_policy_loss, compute_policy_loss_gspo
from hybridflow.algorithms.offpolicy import (
    decoupled_ppo_weights,
    masked_is_weights,
    off_policy_weights,
    rollout_mismatch_kl,
    truncated_is_weights,
)
from hybridflow.algorithms.rollout_correction import RolloutCorrectionConfig, validate_rollout_correction
from hybridflow.checks.recipe import RecipeError, validate_recipe
from hybridflow.config.loader import load_recipe
from hybridflow.protocol import DataProto
from hybridflow.utils.tiny_model import make_tiny_model

# the shipped recipes' relative paths exist, as after `make quickstart` (tests/working_tree.py)
pytestmark = pytest.mark.usefixtures("in_quickstart_working_tree")

ROLLOUT = torch.full((2, 3), -1.0)  # (B, R) the engine's log-probs of the sampled tokens
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])  # (B, R) the last token of row 1 is padding


def old_with_ratios(ratios: list[list[float]]) -> torch.Tensor:
    """Actor log-probs whose ratio pi_old / mu to ROLLOUT is `ratios`. (B, R)"""
    return ROLLOUT + torch.tensor(ratios).log()


def test_truncated_is_caps_the_ratio_at_c():
    old = old_with_ratios([[0.25, 1.0, 4.0], [2.0, 3.0, 1.0]])
    expected = torch.tensor([[0.25, 1.0, 2.0], [2.0, 2.0, 1.0]])
    torch.testing.assert_close(truncated_is_weights(old, ROLLOUT, cap=2.0), expected)


def test_masked_is_per_token_zeroes_ratios_outside_the_bounds():
    old = old_with_ratios([[0.25, 1.0, 4.0], [0.5, 2.0, 1.5]])
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.5, 2.0, 1.5]])
    torch.testing.assert_close(masked_is_weights(old, ROLLOUT, MASK, 0.5, 2.0), expected)
    only_upper = torch.tensor([[0.25, 1.0, 0.0], [0.5, 2.0, 1.5]])
    torch.testing.assert_close(masked_is_weights(old, ROLLOUT, MASK, None, 2.0), only_upper)


def test_masked_is_per_sequence_uses_the_product_over_valid_tokens():
    # row 0: 2 * 2 * 1 = 4 > 2, the whole sequence is masked; row 1: 2 * 0.5 = 1 (padding ignored)
    old = old_with_ratios([[2.0, 2.0, 1.0], [2.0, 0.5, 100.0]])
    expected = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(masked_is_weights(old, ROLLOUT, MASK, 0.5, 2.0, "sequence"), expected)
    with pytest.raises(ValueError, match="level must be one of"):
        masked_is_weights(old, ROLLOUT, MASK, 0.5, 2.0, "sentence")


def test_decoupled_ppo_weight_is_proximal_over_behaviour_and_drops_above_the_cap():
    proximal = old_with_ratios([[0.5, 3.0, 1.0], [1.5, 2.5, 1.0]])
    torch.testing.assert_close(
        decoupled_ppo_weights(proximal, ROLLOUT, cap=2.0), torch.tensor([[0.5, 0.0, 1.0], [1.5, 0.0, 1.0]])
    )
    torch.testing.assert_close(
        decoupled_ppo_weights(proximal, ROLLOUT, cap=None), torch.tensor([[0.5, 3.0, 1.0], [1.5, 2.5, 1.0]])
    )


def test_weights_of_a_huge_log_ratio_stay_finite():
    old = ROLLOUT + torch.tensor([[500.0, -500.0, 0.0], [0.0, 0.0, 0.0]])
    for mode in ("truncated_is", "masked_is", "decoupled_ppo"):
        weights = off_policy_weights(mode, old, ROLLOUT, MASK, 0.5, 2.0)
        assert torch.isfinite(weights).all(), mode
    assert torch.isfinite(decoupled_ppo_weights(old, ROLLOUT, cap=None)).all()


def test_off_policy_weights_dispatches_on_the_mode():
    old = old_with_ratios([[0.25, 1.0, 4.0], [2.0, 3.0, 1.0]])
    assert off_policy_weights("none", old, ROLLOUT, MASK) is None
    torch.testing.assert_close(
        off_policy_weights("truncated_is", old, ROLLOUT, MASK, upper=2.0),
        truncated_is_weights(old, ROLLOUT, 2.0),
    )
    with pytest.raises(ValueError, match="needs an upper bound"):
        off_policy_weights("truncated_is", old, ROLLOUT, MASK, upper=None)
    with pytest.raises(ValueError, match="must be one of"):
        off_policy_weights("tis", old, ROLLOUT, MASK)


def test_decoupled_ppo_loss_clips_against_the_proximal_policy_and_weights_by_behaviour():
    """Token 0: r = pi/pi_prox = 1.5, A = 1, clipped at 1.2: -1.2, behaviour weight 0.5 -> -0.6.
    Token 1: r = 0.5, A = -1, clipped at 0.8: 0.8, weight 2 -> 1.6. Token mean: 0.5."""
    behaviour = torch.tensor([[-1.0, -1.0]])
    proximal = behaviour + torch.tensor([[0.5, 2.0]]).log()
    log_prob = proximal + torch.tensor([[1.5, 0.5]]).log()
    advantages, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    weights = decoupled_ppo_weights(proximal, behaviour, cap=None)
    loss, clipfrac, _, _ = compute_policy_loss(proximal, log_prob, advantages, mask, is_weights=weights)
    assert loss.item() == pytest.approx(0.5)
    assert clipfrac.item() == pytest.approx(1.0)


def test_truncated_is_weights_scale_the_gradient_of_each_token():
    """Unclipped tokens (r = 1.1, A = 1 and r = 0.9, A = -1): d loss / d log_prob = -A * r * w / 2."""
    old = torch.tensor([[-1.0, -2.0]])
    log_prob = (old + torch.tensor([[1.1, 0.9]]).log()).requires_grad_()
    advantages, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    rollout = old - torch.tensor([[4.0, 0.5]]).log()  # rho = 4 (truncated to 2) and 0.5
    weights = truncated_is_weights(old, rollout, cap=2.0)
    loss, _, _, _ = compute_policy_loss(old, log_prob, advantages, mask, is_weights=weights)
    loss.backward()
    expected = torch.tensor([[-1.1 * 2.0 / 2, 0.9 * 0.5 / 2]])
    torch.testing.assert_close(log_prob.grad, expected)


def test_gspo_loss_is_weighted_per_token():
    old = torch.tensor([[-1.0, -1.0]])
    advantages, mask = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    plain, _, _, _ = compute_policy_loss_gspo(old, old, advantages, mask, loss_agg_mode="token-mean")
    weights = torch.tensor([[0.5, 0.0]])
    weighted, _, _, _ = compute_policy_loss_gspo(
        old, old, advantages, mask, loss_agg_mode="token-mean", is_weights=weights
    )
    assert plain.item() == pytest.approx(-1.0)
    assert weighted.item() == pytest.approx(-0.25)  # (-1 * 0.5 + -1 * 0) / 2


def test_mismatch_kl_is_the_k3_estimate():
    old = old_with_ratios([[2.0, 0.5, 1.0], [1.0, 1.0, 9.0]])
    by_hand = ((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 5  # padding (9.0) ignored
    assert rollout_mismatch_kl(old, ROLLOUT, MASK) == pytest.approx(by_hand)
    assert rollout_mismatch_kl(ROLLOUT, ROLLOUT, MASK) == 0.0


def policy_batch(rollout_log_probs: torch.Tensor | None) -> DataProto:
    tensors = {"old_log_probs": old_with_ratios([[0.25, 1.0, 4.0], [2.0, 3.0, 1.0]]), "response_mask": MASK}
    if rollout_log_probs is not None:
        tensors["rollout_log_probs"] = rollout_log_probs
    return DataProto.from_dict(tensors)


def test_actor_batch_gets_weights_and_metrics_from_rollout_log_probs():
    batch = policy_batch(ROLLOUT)
    metrics = off_policy_correction(batch, RolloutCorrectionConfig(mode="truncated_is", upper=2.0))
    torch.testing.assert_close(
        batch.batch["is_weights"], truncated_is_weights(batch.batch["old_log_probs"], ROLLOUT, 2.0)
    )
    assert metrics["is_weight_max"] == [pytest.approx(2.0)]
    assert metrics["rollout_actor_kl"][0] > 0
    # without a correction the mismatch is still reported, and nothing weighs the loss
    plain = policy_batch(ROLLOUT)
    assert set(off_policy_correction(plain, RolloutCorrectionConfig())) == {"rollout_actor_kl"}
    assert "is_weights" not in plain.batch
    assert off_policy_correction(policy_batch(None), RolloutCorrectionConfig(mode="masked_is")) == {}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mode": "truncated_is", "upper": 0.5}, "upper must be >= 1"),
        ({"mode": "truncated_is", "upper": None}, "needs upper"),
        ({"mode": "masked_is", "upper": None}, "needs lower and/or upper"),
        ({"mode": "masked_is", "lower": 1.5}, r"in \(0, 1\]"),
        ({"mode": "truncated_is", "lower": 0.5}, "used by mode=masked_is only"),
        ({"mode": "decoupled_ppo", "level": "sequence"}, "set level: token"),
    ],
)
def test_off_policy_settings_are_refused_with_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        validate_rollout_correction(RolloutCorrectionConfig(**settings))


def test_recipe_with_a_correction_needs_the_rollout_log_probs(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    for name in ("train", "test"):
        (tmp_path / f"{name}.parquet").write_bytes(b"")
    overrides = [
        f"model.path={model}",
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'test.parquet'}]",
        "trainer.use_gpu=false",
        "trainer.n_gpus_per_node=2",
        "rollout.name=hf",
        "rollout.tensor_model_parallel_size=1",
        "data.max_prompt_length=256",
        "rollout.response_length=256",
        "algorithm.rollout_correction.mode=decoupled_ppo",
        "rollout.calculate_log_probs=false",  # on by default (the mismatch monitor)
    ]
    cfg = load_recipe(Path(__file__).resolve().parents[1] / "recipes/gsm8k_grpo.yaml", overrides)
    message = "algorithm.rollout_correction.mode=decoupled_ppo .* set rollout.calculate_log_probs=true"
    with pytest.raises(RecipeError, match=message):
        validate_recipe(cfg, cuda_available=False)
    cfg.rollout.calculate_log_probs = True
    validate_recipe(cfg, cuda_available=False)
