"""How the devices split over the roles (`Layout`), and the batch sizes and token budgets against
it: every division the workers would otherwise find uneven after they started.
"""

from dataclasses import dataclass

from hybridflow.checks.roles import teacher_devices_per_node, uses_teacher
from hybridflow.config.schema import RecipeConfig


@dataclass(frozen=True)
class Layout:
    """How the devices split: the actor pool (actor, rollout, ref, colocated critic / reward
    model) and data-parallel size there; a separate critic pool when the critic asks for one."""

    actor_devices: int
    actor_dp: int
    critic_devices: int
    critic_dp: int
    teacher_dp: int = 0  # the distillation teacher's data-parallel size (0: no teacher)


def _model_parallel(megatron) -> int:
    return (
        megatron.tensor_model_parallel_size
        * megatron.pipeline_model_parallel_size
        * megatron.context_parallel_size
    )


def _layout(cfg: RecipeConfig) -> tuple[Layout | None, list[str]]:
    trainer, critic = cfg.trainer, cfg.critic
    own_critic = critic.enable and critic.n_gpus_per_node > 0
    own_teacher = teacher_devices_per_node(cfg)
    actor_per_node = trainer.n_gpus_per_node - (critic.n_gpus_per_node if own_critic else 0) - own_teacher
    if actor_per_node <= 0:
        teacher_part = f" and teacher.n_gpus_per_node={own_teacher}" if own_teacher else ""
        return None, [
            f"critic.n_gpus_per_node={critic.n_gpus_per_node}{teacher_part} leave no devices for the actor "
            f"out of trainer.n_gpus_per_node={trainer.n_gpus_per_node}; lower it or use 0 (colocate)"
        ]
    actor_devices = trainer.nnodes * actor_per_node
    critic_devices = trainer.nnodes * critic.n_gpus_per_node if own_critic else actor_devices
    errors = _check_divides("actor.megatron", cfg.actor.megatron, actor_devices)
    if own_critic:
        errors += _check_divides("critic.megatron", critic.megatron, critic_devices)
    if own_teacher:
        errors += _check_divides("teacher.megatron", cfg.teacher.megatron, trainer.nnodes * own_teacher)
    colocated = {
        "critic": critic.enable and not own_critic,
        "reward_model": cfg.reward_model.enable,
        "teacher": uses_teacher(cfg) and not own_teacher,
    }
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
    teacher_dp = _teacher_dp(cfg, actor_dp)
    return Layout(actor_devices, actor_dp, critic_devices, critic_dp, teacher_dp), []


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
    return _check_expert_divides(key, megatron, devices)


def _check_expert_divides(key: str, megatron, devices: int) -> list[str]:
    """Megatron-Core lays experts out as expert TP x EP x expert DP x PP over the same devices."""
    ep = megatron.expert_model_parallel_size
    etp = megatron.expert_tensor_parallel_size or megatron.tensor_model_parallel_size
    if ep < 1 or etp < 1:
        return [f"{key}: expert_model_parallel_size={ep} and expert_tensor_parallel_size={etp} must be >= 1"]
    pp = megatron.pipeline_model_parallel_size
    if devices % (etp * ep * pp):
        return [
            f"{key}: expert TP × EP × PP = {etp}×{ep}×{pp} does not divide the {devices} devices; lower "
            "expert_model_parallel_size or expert_tensor_parallel_size"
        ]
    return []


def _teacher_dp(cfg: RecipeConfig, actor_dp: int) -> int:
    if not uses_teacher(cfg):
        return 0
    own = teacher_devices_per_node(cfg)
    return cfg.trainer.nnodes * own // _model_parallel(cfg.teacher.megatron) if own else actor_dp


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
    errors += _check_teacher_micro_batches(cfg, responses, layout.teacher_dp)
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


def _check_teacher_micro_batches(cfg: RecipeConfig, responses: int, teacher_dp: int) -> list[str]:
    """The teacher scores every response: they split over its data-parallel ranks, then into whole
    micro-batches."""
    micro = cfg.teacher.log_prob_micro_batch_size
    if not teacher_dp or micro <= 0:
        return []
    if responses % teacher_dp:
        return [
            f"the {responses} responses per step do not split over the teacher's {teacher_dp} data-parallel "
            "ranks (teacher.n_gpus_per_node over teacher.megatron's TP x PP); change either"
        ]
    if (responses // teacher_dp) % micro:
        return [
            f"teacher.log_prob_micro_batch_size={micro} does not divide the {responses // teacher_dp} "
            f"responses each teacher data-parallel rank scores per step; pick a divisor"
        ]
    return []


def _check_token_budgets(cfg: RecipeConfig) -> list[str]:
    """Packed micro-batches hold whole sequences: each token budget in use must fit the longest one."""
    longest = cfg.data.max_prompt_length + cfg.rollout.response_length
    budgets = {}
    if cfg.actor.update.use_dynamic_bsz:
        budgets["actor.update.max_token_len_per_gpu"] = cfg.actor.update.max_token_len_per_gpu
        budgets["actor.log_prob_max_token_len_per_gpu"] = cfg.actor.log_prob_max_token_len_per_gpu
        budgets["ref.log_prob_max_token_len_per_gpu"] = cfg.ref.log_prob_max_token_len_per_gpu
    if cfg.critic.enable and cfg.critic.update.use_dynamic_bsz:
        budgets["critic.update.max_token_len_per_gpu"] = cfg.critic.update.max_token_len_per_gpu
        budgets["critic.forward_max_token_len_per_gpu"] = cfg.critic.forward_max_token_len_per_gpu
    if uses_teacher(cfg) and cfg.actor.update.use_dynamic_bsz:
        budgets["teacher.log_prob_max_token_len_per_gpu"] = cfg.teacher.log_prob_max_token_len_per_gpu
    if cfg.reward_model.enable and cfg.reward_model.use_dynamic_bsz:
        budgets["reward_model.forward_max_token_len_per_gpu"] = cfg.reward_model.forward_max_token_len_per_gpu
    return [
        f"{key}={budget} is below the longest sequence, data.max_prompt_length + rollout.response_length = "
        f"{longest} tokens; raise it to at least {longest}"
        for key, budget in budgets.items()
        if budget < longest
    ]
