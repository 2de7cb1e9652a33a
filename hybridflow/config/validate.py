"""Checks a loaded recipe before anything starts: every problem is reported at once, each
naming the key path and the fix. Nothing is corrected silently.
"""

import difflib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from hybridflow.algorithms import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES
from hybridflow.algorithms.kl import KL_PENALTY_KINDS
from hybridflow.config.schema import RecipeConfig
from hybridflow.reward.registry import load_reward_fn
from hybridflow.utils.tracking import BACKENDS as LOGGERS

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
CHOICES = {
    "algorithm.adv_estimator": tuple(ADVANTAGE_ESTIMATORS),
    "algorithm.kl_penalty": KL_PENALTY_KINDS,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "actor.update.kl_loss_type": KL_PENALTY_KINDS,
    "actor.update.loss_agg_mode": LOSS_AGG_MODES,
    "critic.update.loss_agg_mode": LOSS_AGG_MODES,
    "trainer.resume_mode": ("auto", "disable"),
    "trainer.mode": ("rl", "sft"),
}


class RecipeError(ValueError):
    """A recipe that cannot run; the message lists every problem found."""


@dataclass(frozen=True)
class Layout:
    """How the devices split: the actor pool (actor, rollout, ref, colocated critic / reward
    model) and data-parallel size there; a separate critic pool when the critic asks for one."""

    actor_devices: int
    actor_dp: int
    critic_devices: int
    critic_dp: int


def validate_recipe(cfg: RecipeConfig, cuda_available: bool | None = None) -> Layout:
    """Raises RecipeError listing every problem; returns the device layout when there are none."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    errors: list[str] = []
    errors += _check_choices(cfg)
    errors += _check_paths(cfg)
    if cfg.trainer.mode == "rl":
        errors += _check_algorithm(cfg)
    errors += _check_devices(cfg, cuda_available)
    layout, layout_errors = _layout(cfg)
    errors += layout_errors
    if layout is not None:
        errors += _check_batch_sizes(cfg, layout)
    if errors:
        raise RecipeError("invalid recipe:\n  - " + "\n  - ".join(errors))
    return layout


def _get(cfg: RecipeConfig, key_path: str):
    node = cfg
    for key in key_path.split("."):
        node = getattr(node, key)
    return node


def _check_choices(cfg: RecipeConfig) -> list[str]:
    errors = []
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            nearest = difflib.get_close_matches(str(value), choices, n=1)
            hint = f"did you mean {nearest[0]!r}? " if nearest else ""
            errors.append(f"{key}={value!r} is not one of {list(choices)}; {hint}")
    errors += [
        f"trainer.logger has {name!r}; choose from {list(LOGGERS)}"
        for name in cfg.trainer.logger
        if name not in LOGGERS
    ]
    return errors


def _check_paths(cfg: RecipeConfig) -> list[str]:
    errors = []
    models = {"model.path": cfg.model.path, "model.tokenizer_path": cfg.model.tokenizer_path}
    if cfg.critic.enable:
        models["critic.model_path"] = cfg.critic.model_path
    if cfg.reward_model.enable:
        if cfg.reward_model.path is None:
            errors.append("reward_model.enable=true needs reward_model.path (a Hugging Face model directory)")
        models["reward_model.path"] = cfg.reward_model.path
    for key, path in models.items():
        if path is not None and not (Path(path) / "config.json").is_file():
            errors.append(
                f"{key}={path} is not a Hugging Face model directory (no config.json there); fix the path"
            )
    if not cfg.data.train_files:
        errors.append("data.train_files is empty; list the training parquet files")
    for key in ("data.train_files", "data.val_files"):
        errors += [
            f"{key} has {f}, which does not exist; fix the path"
            for f in _get(cfg, key)
            if not Path(f).is_file()
        ]
    if cfg.reward.custom_fn is not None:
        try:
            load_reward_fn(cfg.reward.custom_fn)
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    return errors


def _check_algorithm(cfg: RecipeConfig) -> list[str]:
    errors = []
    estimator, n = cfg.algorithm.adv_estimator, cfg.rollout.sampling.n
    if estimator == "gae" and not cfg.critic.enable:
        errors.append(
            "algorithm.adv_estimator=gae needs a critic: set critic.enable=true, or choose a critic-free "
            "estimator such as algorithm.adv_estimator=grpo"
        )
    if cfg.critic.enable and estimator != "gae":
        errors.append(
            f"critic.enable=true but algorithm.adv_estimator={estimator} does not use values; set "
            "critic.enable=false"
        )
    if cfg.critic.warmup_steps and not cfg.critic.enable:
        errors.append(
            "critic.warmup_steps is set but there is no critic; set critic.enable=true or remove it"
        )
    if estimator == "remax" and cfg.rollout.val_sampling.do_sample:
        errors.append(
            "algorithm.adv_estimator=remax takes its baseline from a greedy response generated with "
            "rollout.val_sampling: set rollout.val_sampling.do_sample=false"
        )
    if estimator in GROUP_ESTIMATORS and n < 2:
        errors.append(
            f"algorithm.adv_estimator={estimator} compares responses to the same prompt: set "
            "rollout.sampling.n >= 2"
        )
    if (cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train) and not cfg.data.val_files:
        errors.append(
            "validation is requested (trainer.test_freq / trainer.val_before_train) but data.val_files is "
            "empty"
        )
    positive = (
        "data.train_batch_size",
        "data.max_prompt_length",
        "rollout.response_length",
        "trainer.nnodes",
        "trainer.n_gpus_per_node",
    )
    errors += [f"{key} must be positive, got {_get(cfg, key)}" for key in positive if _get(cfg, key) <= 0]
    return errors


def _check_devices(cfg: RecipeConfig, cuda_available: bool) -> list[str]:
    errors = []
    if cfg.trainer.use_gpu and not cuda_available:
        errors.append(
            "trainer.use_gpu=true but CUDA is not available here; set trainer.use_gpu=false to run on CPU "
            "processes"
        )
    if cfg.rollout.name == "sglang":
        if not cuda_available or not cfg.trainer.use_gpu:
            errors.append(
                "rollout.name=sglang needs CUDA GPUs (trainer.use_gpu=true on a CUDA machine); use "
                "rollout.name=hf here"
            )
        elif importlib.util.find_spec("sglang") is None:
            errors.append(
                "rollout.name=sglang but sglang is not installed; install the GPU pins "
                "(`pip install -r requirements-gpu.txt -e .`, README 'GPU machines') or use rollout.name=hf"
            )
    return errors


def _model_parallel(megatron) -> int:
    return (
        megatron.tensor_model_parallel_size
        * megatron.pipeline_model_parallel_size
        * megatron.context_parallel_size
    )


def _layout(cfg: RecipeConfig) -> tuple[Layout | None, list[str]]:
    trainer, critic = cfg.trainer, cfg.critic
    own_critic = critic.enable and critic.n_gpus_per_node > 0
    actor_per_node = trainer.n_gpus_per_node - (critic.n_gpus_per_node if own_critic else 0)
    if actor_per_node <= 0:
        return None, [
            f"critic.n_gpus_per_node={critic.n_gpus_per_node} leaves no devices for the actor out of "
            f"trainer.n_gpus_per_node={trainer.n_gpus_per_node}; lower it or use 0 (colocate)"
        ]
    actor_devices = trainer.nnodes * actor_per_node
    critic_devices = trainer.nnodes * critic.n_gpus_per_node if own_critic else actor_devices
    errors = _check_divides("actor.megatron", cfg.actor.megatron, actor_devices)
    if own_critic:
        errors += _check_divides("critic.megatron", critic.megatron, critic_devices)
    colocated = {"critic": critic.enable and not own_critic, "reward_model": cfg.reward_model.enable}
    for role in (name for name, on in colocated.items() if on):
        if _sizes(getattr(cfg, role).megatron) != _sizes(cfg.actor.megatron):
            errors.append(
                f"{role}.megatron parallel sizes {_sizes(getattr(cfg, role).megatron)} differ from "
                "actor.megatron's "
                f"{_sizes(cfg.actor.megatron)}; colocated roles share one layout: make them equal"
            )
    rollout_tp = cfg.rollout.tensor_model_parallel_size
    if actor_devices % rollout_tp:
        errors.append(
            f"rollout.tensor_model_parallel_size={rollout_tp} does not divide the {actor_devices} actor "
            "devices"
        )
    if errors:
        return None, errors
    actor_dp = actor_devices // _model_parallel(cfg.actor.megatron)
    critic_dp = critic_devices // _model_parallel(critic.megatron if own_critic else cfg.actor.megatron)
    return Layout(actor_devices, actor_dp, critic_devices, critic_dp), []


def _sizes(megatron) -> tuple[int, int, int]:
    return (
        megatron.tensor_model_parallel_size,
        megatron.pipeline_model_parallel_size,
        megatron.context_parallel_size,
    )


def _check_divides(key: str, megatron, devices: int) -> list[str]:
    tp, pp, cp = _sizes(megatron)
    if devices % (tp * pp * cp):
        return [
            f"{key}: TP × PP × CP = {tp}×{pp}×{cp} = {tp * pp * cp} does not divide the {devices} devices "
            "(trainer.nnodes × trainer.n_gpus_per_node), so no data-parallel size DP gives TP × PP × CP × "
            "DP = "
            f"{devices}; change the parallel sizes or trainer.n_gpus_per_node"
        ]
    return []


def _check_batch_sizes(cfg: RecipeConfig, layout: Layout) -> list[str]:
    """Responses per step split evenly over DP ranks, into whole mini-batches (in sequences, one
    optimizer step each) whose per-rank share splits into whole micro-batches."""
    if cfg.trainer.mode == "sft":
        return _check_sft_batch_sizes(cfg, layout)
    n = cfg.rollout.sampling.n
    responses = cfg.data.train_batch_size * n
    errors = []
    if responses % layout.actor_dp:
        errors.append(
            f"data.train_batch_size={cfg.data.train_batch_size} × rollout.sampling.n={n} = {responses} "
            "responses "
            f"do not split over the {layout.actor_dp} data-parallel ranks; make the product a multiple of "
            f"{layout.actor_dp}"
        )
    errors += _check_forward_micro_batches(cfg, responses // layout.actor_dp)
    roles = [("actor", cfg.actor.update, layout.actor_dp)]
    if cfg.critic.enable:
        roles.append(("critic", cfg.critic.update, layout.critic_dp))
    for role, update, dp in roles:
        key, mini, micro = f"{role}.update", update.ppo_mini_batch_size, update.ppo_micro_batch_size
        if responses % mini:
            errors.append(
                f"{key}.ppo_mini_batch_size={mini} sequences does not divide the {responses} responses per "
                "step "
                f"(data.train_batch_size × rollout.sampling.n); pick a divisor of {responses}"
            )
        if mini % dp:
            errors.append(
                f"{key}.ppo_mini_batch_size={mini} does not split over the {dp} data-parallel ranks"
            )
        elif (mini // dp) % micro:
            errors.append(
                f"{key}.ppo_micro_batch_size={micro} does not divide the {mini // dp} sequences each of "
                f"the {dp} "
                f"data-parallel ranks gets per mini-batch; pick a divisor of {mini // dp}"
            )
    return errors


def _check_sft_batch_sizes(cfg: RecipeConfig, layout: Layout) -> list[str]:
    """SFT: one optimizer step per batch of prompt + answer rows, split over DP, then micro-batches."""
    batch, dp, micro = cfg.data.train_batch_size, layout.actor_dp, cfg.actor.update.ppo_micro_batch_size
    if batch % dp:
        return [f"data.train_batch_size={batch} does not split over the {dp} data-parallel ranks"]
    if (batch // dp) % micro:
        return [
            f"actor.update.ppo_micro_batch_size={micro} does not divide the {batch // dp} rows each of the "
            f"{dp} data-parallel ranks gets per SFT step; pick a divisor of {batch // dp}"
        ]
    return []


def _check_forward_micro_batches(cfg: RecipeConfig, rows_per_rank: int) -> list[str]:
    """Forward-only passes (log-probs, reward model) split each rank's rows into whole micro-batches."""
    sizes = {"actor.log_prob_micro_batch_size": cfg.actor.log_prob_micro_batch_size}
    if cfg.algorithm.use_kl_in_reward or cfg.actor.update.use_kl_loss:
        sizes["ref.log_prob_micro_batch_size"] = cfg.ref.log_prob_micro_batch_size
    if cfg.reward_model.enable:
        sizes["reward_model.micro_batch_size"] = cfg.reward_model.micro_batch_size
    errors = [
        f"{key}={size} does not divide the {rows_per_rank} responses each data-parallel rank scores per step;"
        f" pick a divisor of {rows_per_rank}"
        for key, size in sizes.items()
        if rows_per_rank % size
    ]
    if cfg.reward_model.enable and cfg.algorithm.adv_estimator == "remax":
        dp = cfg.data.train_batch_size * cfg.rollout.sampling.n // rows_per_rank
        greedy_rows = -(-cfg.data.train_batch_size // dp)  # ReMax's greedy responses, padded to split
        if greedy_rows % cfg.reward_model.micro_batch_size:
            errors.append(
                f"reward_model.micro_batch_size={cfg.reward_model.micro_batch_size} does not divide the "
                f"{greedy_rows} greedy baseline responses each data-parallel rank scores; pick a divisor"
            )
    return errors
