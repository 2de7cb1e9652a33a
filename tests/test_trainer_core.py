"""The driver's pure helpers: rewards with KL, advantage wiring, step metrics, validation accuracy."""

import numpy as np
import pytest
import torch

from hybridflow.config.schema import AlgorithmConfig, KLControlConfig, OverlongBufferConfig
from hybridflow.protocol import DataProto
from hybridflow.trainer import core, metrics
from hybridflow.trainer.validation import accuracy_metrics


def _batch(**tensors) -> DataProto:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    scores = torch.tensor([[0, 1.0, 0], [0, 0, 0], [1.0, 0, 0], [0, 1.0, 0]])
    base = {
        "response_mask": mask,
        "token_level_scores": scores,
        "attention_mask": torch.cat([torch.ones(4, 2, dtype=torch.long), mask], dim=1),
    }
    uid = np.array(["a", "a", "b", "b"], dtype=object)
    return DataProto.from_dict({**base, **tensors}, non_tensors={"uid": uid})


def test_rewards_are_the_scores_without_kl_in_reward():
    batch = _batch()
    kl_ctrl = core.make_kl_controller(KLControlConfig())
    rewards, kl = core.token_level_rewards(batch, AlgorithmConfig(), kl_ctrl)
    assert torch.equal(rewards.batch["token_level_rewards"], batch.batch["token_level_scores"])
    assert kl == {}


def test_kl_in_reward_subtracts_beta_times_the_token_kl():
    log_probs = torch.full((4, 3), -1.0)
    ref = torch.full((4, 3), -1.5)  # k1 = 0.5 on every token
    batch = _batch(old_log_probs=log_probs, ref_log_prob=ref)
    algo = AlgorithmConfig(use_kl_in_reward=True, kl_penalty="kl", kl_ctrl=KLControlConfig(kl_coef=0.1))
    rewards, kl = core.token_level_rewards(batch, algo, core.make_kl_controller(algo.kl_ctrl))
    expected = batch.batch["token_level_scores"] - 0.1 * 0.5 * batch.batch["response_mask"]
    assert torch.allclose(rewards.batch["token_level_rewards"], expected)
    assert kl == pytest.approx({"kl/reward_penalty": 0.5, "kl/reward_coef": 0.1})


def test_adaptive_controller_is_chosen_by_the_recipe():
    ctrl = core.make_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=1.0, horizon=10))
    ctrl.update(current_kl=2.0, n_steps=5)  # error clipped to 0.2: 0.2 * (1 + 0.2 * 5 / 10)
    assert ctrl.value == pytest.approx(0.22)


def test_grpo_advantage_groups_by_uid():
    batch = _batch()
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    out = core.compute_advantage(batch, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=False))
    # group a: scores 1, 0 -> +0.5, -0.5; group b: 1, 1 -> 0, 0 (broadcast over valid tokens)
    expected = torch.tensor([[0.5, 0.5, 0], [-0.5, -0.5, -0.5], [0, 0, 0], [0, 0, 0]])
    assert torch.allclose(out.batch["advantages"], expected)


def test_uids_are_unique_strings():
    uids = core.new_uids(5)
    assert len(set(uids)) == 5 and uids.dtype == object


def test_batch_metrics_hand_computed():
    log_probs = torch.full((4, 3), -1.0)
    batch = _batch(old_log_probs=log_probs, ref_log_prob=log_probs - 0.25, advantages=torch.ones(4, 3))
    out = metrics.batch_metrics(batch)
    assert out["reward/mean"] == 0.75
    assert out["response_length/mean"] == 2.0 and out["response_length/max"] == 3.0
    assert out["response_length/clip_ratio"] == 0.25
    assert out["prompt_length/mean"] == 2.0
    assert out["kl/mean"] == pytest.approx(0.25)
    assert "critic/values_mean" not in out
    assert metrics.throughput(batch, step_seconds=2.0) == {"throughput/tokens_per_s": (8 + 8) / 2.0}


def test_worker_metrics_are_averaged_and_timings_named():
    out = DataProto(meta_info={"metrics": {"actor/pg_loss": [1.0, 3.0], "actor/grad_norm": [0.5]}})
    assert metrics.mean_worker_metrics(out) == {"actor/pg_loss": 2.0, "actor/grad_norm": 0.5}
    timings = {}
    with metrics.timer("gen", timings):
        pass
    assert list(metrics.timing_metrics(timings)) == ["timing/gen"] and timings["gen"] >= 0


def test_accuracy_per_data_source():
    out = accuracy_metrics([1.0, 0.0, 1.0, 1.0], ["openai/gsm8k", "openai/gsm8k", "arith", "arith"])
    assert out == {"val/accuracy": 0.75, "val/openai/gsm8k/accuracy": 0.5, "val/arith/accuracy": 1.0}


def test_overlong_penalty_lands_on_each_responses_last_token():
    # lengths 2, 3, 1, 2 against a 3-token limit with a 2-token zone: no penalty up to 1 token,
    # then ((3 - 2) - length) / 2, i.e. -0.5 at 2 tokens and -1 at 3, scaled by penalty_factor 0.5
    overlong = OverlongBufferConfig(enable=True, length=2, penalty_factor=0.5)
    expected = torch.tensor([[0, -0.25, 0], [0, 0, -0.5], [0, 0, 0], [0, -0.25, 0]])
    torch.testing.assert_close(core.overlong_scores(_batch(), overlong, max_length=3), expected)
