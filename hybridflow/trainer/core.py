"""The driver's own math between worker calls: prompt ids, rewards with KL, advantages.

Pure functions over DataProto batches; the estimators and KL estimators themselves live in
hybridflow.algorithms.
"""

import uuid

import numpy as np
import torch

from hybridflow.algorithms import AdaptiveKLController, FixedKLController, apply_kl_penalty, overlong_penalty
from hybridflow.algorithms import compute_advantage as run_estimator
from hybridflow.algorithms.distillation import distillation_advantages
from hybridflow.config.schema import AlgorithmConfig, KLControlConfig, OverlongBufferConfig
from hybridflow.protocol import DataProto
from hybridflow.reward.manager import place_on_last_token


def new_uids(count: int) -> np.ndarray:
    """One fresh id per prompt; the responses to a prompt share it (the estimators' groups)."""
    return np.array([str(uuid.uuid4()) for _ in range(count)], dtype=object)


def make_kl_controller(cfg: KLControlConfig) -> FixedKLController | AdaptiveKLController:
    if cfg.type == "adaptive":
        return AdaptiveKLController(value=cfg.kl_coef, target=cfg.target_kl, horizon=cfg.horizon)
    return FixedKLController(value=cfg.kl_coef)


def token_level_rewards(
    batch: DataProto, algorithm: AlgorithmConfig, kl_ctrl: FixedKLController | AdaptiveKLController
) -> tuple[DataProto, dict[str, float]]:
    """`token_level_rewards`: the scores, minus beta * KL per token when KL is in the reward."""
    tensors = batch.batch
    if not algorithm.use_kl_in_reward:
        return DataProto.from_dict({"token_level_rewards": tensors["token_level_scores"]}), {}
    rewards, metrics = apply_kl_penalty(
        tensors["token_level_scores"],
        tensors["old_log_probs"],
        tensors["ref_log_prob"],
        tensors["response_mask"],
        kl_ctrl,
        kind=algorithm.kl_penalty,
    )
    return DataProto.from_dict({"token_level_rewards": rewards}), {
        "kl/reward_penalty": metrics["reward_kl_penalty"],
        "kl/reward_coef": metrics["reward_kl_penalty_coeff"],
    }


def compute_advantage(batch: DataProto, algorithm: AlgorithmConfig) -> DataProto:
    """`advantages` and `returns` (B, R) by the recipe's estimator; with on-policy distillation the
    advantages become task_coef * those - kl_coef * the per-token reverse KL to the teacher."""
    tensors = batch.batch
    advantages, returns = run_estimator(
        algorithm.adv_estimator,
        tensors["token_level_rewards"],
        tensors["response_mask"],
        values=tensors.get("values", None),
        index=batch.non_tensor_batch["uid"],
        reward_baselines=tensors.get("reward_baselines", None),
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        norm_adv_by_std=algorithm.norm_adv_by_std_in_grpo,
        k=algorithm.pass_k,
        old_log_probs=tensors.get("old_log_probs", None),
        sum_pi_squared=tensors.get("sum_pi_squared", None),  # the log-prob pass gives it when read
        batch=tensors,  # a user's estimator reads what else it needs by name
        config=algorithm,
    )
    distill = algorithm.distillation
    if distill.enable:
        advantages = distillation_advantages(
            advantages,
            tensors["old_log_probs"],
            tensors["teacher_log_prob"],
            tensors["response_mask"],
            kl_coef=distill.kl_coef,
            task_coef=distill.task_coef,
            estimator=distill.kl_estimator,
        )
    return DataProto.from_dict({"advantages": advantages, "returns": returns})


def overlong_scores(batch: DataProto, cfg: OverlongBufferConfig, max_length: int) -> torch.Tensor:
    """DAPO's overlong penalty of each response, (B, R), on its last token like the rule scores."""
    response_mask = batch.batch["response_mask"]  # (B, R)
    penalty = overlong_penalty(response_mask.sum(-1), max_length, cfg.length, cfg.penalty_factor)  # (B,)
    return place_on_last_token(penalty, response_mask)
