"""The algorithm's settings across keys: the advantage estimator against the critic and the group
size, pass@k, DAPO, the mismatch monitor, routing replay, rollout correction, and the registered
losses' knobs the chosen loss does not read.
"""

from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, advantage_estimator_fn
from hybridflow.algorithms.policy_losses import POLICY_LOSS_KNOBS
from hybridflow.algorithms.rollout_correction import active_parts
from hybridflow.checks.settings import _changed_fields, _no_effect
from hybridflow.config.schema import RecipeConfig

GROUP_ESTIMATORS = (
    "grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk", "opo", "gpg", "gdpo",
    "optimal_token_baseline",
)  # fmt: skip


def _check_algorithm(cfg: RecipeConfig) -> list[str]:
    errors = []
    estimator, n = cfg.algorithm.adv_estimator, cfg.rollout.sampling.n
    if estimator == "gae" and not cfg.critic.enable:
        errors.append(
            "algorithm.adv_estimator=gae needs a critic: set critic.enable=true, or choose a critic-free "
            "estimator such as algorithm.adv_estimator=grpo"
        )
    if cfg.critic.enable and estimator in ADVANTAGE_ESTIMATORS and estimator != "gae":
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
    if cfg.rollout.sampling.temperature <= 0:
        errors.append(
            f"rollout.sampling.temperature={cfg.rollout.sampling.temperature}: the policy's log-probs of "
            "the sampled tokens are computed at it; set it > 0 (with do_sample: false greedy decoding "
            "ignores it: leave it at 1.0)"
        )
    if estimator in GROUP_ESTIMATORS and n < 2:
        errors.append(
            f"algorithm.adv_estimator={estimator} compares responses to the same prompt: set "
            "rollout.sampling.n >= 2"
        )
    errors += _check_estimator(cfg) + _check_dapo(cfg)
    errors += _check_mismatch_monitor(cfg) + _check_routing_replay(cfg)
    corrections = active_parts(cfg.algorithm.rollout_correction)
    if corrections and not cfg.rollout.calculate_log_probs:
        errors.append(
            f"algorithm.rollout_correction.{corrections[0]} weighs the loss by the rollout engine's own "
            "log-probs: set rollout.calculate_log_probs=true"
        )
    source = cfg.data.source.reasoning_gym
    held_out = cfg.data.val_files or (source.enabled() and source.val_size > 0)
    if (cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train) and not held_out:
        errors.append(
            "validation is requested (trainer.test_freq / trainer.val_before_train) but data.val_files is "
            "empty" + (" and data.source.reasoning_gym.val_size is 0" if source.enabled() else "")
        )
    return errors


def _check_estimator(cfg: RecipeConfig) -> list[str]:
    """A user's estimator loads with the right signature; grpo_passk's k fits the group."""
    estimator, k, n = cfg.algorithm.adv_estimator, cfg.algorithm.pass_k, cfg.rollout.sampling.n
    try:
        advantage_estimator_fn(estimator)
    except ValueError as err:  # DottedPathError too: the key, the path and the cause
        return [str(err)]
    if estimator == "grpo_passk" and (k is None or not 1 <= k <= n):
        return [
            f"algorithm.adv_estimator=grpo_passk needs algorithm.pass_k, the k of pass@k, between 1 and "
            f"rollout.sampling.n={n}; got {k}"
        ]
    if estimator != "grpo_passk" and k is not None:
        return [f"algorithm.pass_k={k} is read by adv_estimator=grpo_passk only; remove it or use that one"]
    return _passk_reward_shaping(cfg) if estimator == "grpo_passk" else []


def _passk_reward_shaping(cfg: RecipeConfig) -> list[str]:
    """grpo_passk scores 0 / 1 outcomes: nothing may add to them before the estimator reads them."""
    algorithm = cfg.algorithm
    shaping = {
        "algorithm.use_kl_in_reward": (algorithm.use_kl_in_reward, "; a KL term can go in the loss instead: "
                                       "actor.update.use_kl_loss=true"),
        "algorithm.overlong_buffer.enable": (algorithm.overlong_buffer.enable, ""),
    }  # fmt: skip
    return [
        f"algorithm.adv_estimator=grpo_passk scores 0 / 1 outcomes, and {key}=true adds to them: set it "
        f"to false{hint}"
        for key, (on, hint) in shaping.items()
        if on
    ]


def _check_routing_replay(cfg: RecipeConfig) -> list[str]:
    """R3 (engines/megatron/routing_replay.py) as far as it is built: the hf engine records, the
    actor replays padded micro-batches without sequence parallelism."""
    rollout, actor = cfg.rollout, cfg.actor
    capacity = actor.megatron.transformer.get("moe_expert_capacity_factor")
    needs = {
        "rollout.return_routed_experts=true (the engine records the experts)": rollout.return_routed_experts,
        "rollout.name=hf (vllm and sglang do not return them here yet)": rollout.name == "hf",
        "actor.update.use_dynamic_bsz=false (packed micro-batches)": not actor.update.use_dynamic_bsz,
        "actor.megatron.sequence_parallel=false": not actor.megatron.sequence_parallel,
        "rollout.agent.loop=single_turn": rollout.agent.loop == "single_turn",
        "actor.megatron.transformer.moe_expert_capacity_factor unset (dropless, as the rollout engine "
        "routes; Megatron-Core counts padding positions against an expert's capacity), got "
        f"{capacity}": capacity is None,
    }
    errors = []
    if actor.megatron.moe_routing_replay == "rollout":
        errors += [
            f"actor.megatron.moe_routing_replay=rollout needs {fix}" for fix, ok in needs.items() if not ok
        ]
    if rollout.return_routed_experts and rollout.name != "hf":
        errors.append(
            f"rollout.return_routed_experts=true with rollout.name={rollout.name}: only the hf engine "
            "records them yet; set rollout.name=hf"
        )
    return errors + [
        f"{role}.megatron.moe_routing_replay=rollout: only the actor replays the rollout's experts; set off"
        for role in ("critic", "teacher")
        if getattr(cfg, role).megatron.moe_routing_replay != "off"
    ]


def _check_mismatch_monitor(cfg: RecipeConfig) -> list[str]:
    trainer = cfg.trainer
    errors = [
        f"trainer.{key} must be positive, got {getattr(trainer, key)}"
        for key in ("mismatch_threshold", "mismatch_token_threshold")
        if not getattr(trainer, key) > 0
    ]
    if trainer.mismatch_policy == "stop" and not cfg.rollout.calculate_log_probs:
        errors.append(
            "trainer.mismatch_policy=stop compares the rollout engine's log-probs with the actor's: set "
            "rollout.calculate_log_probs=true"
        )
    return errors


def _check_dapo(cfg: RecipeConfig) -> list[str]:
    """Dynamic sampling compares responses within a group; the overlong zone fits the limit."""
    errors = []
    dynamic, overlong = cfg.algorithm.filter_groups, cfg.algorithm.overlong_buffer
    if dynamic.enable and cfg.rollout.sampling.n < 2:
        errors.append(
            "algorithm.filter_groups.enable=true keeps groups whose rewards differ: set "
            "rollout.sampling.n >= 2"
        )
    if dynamic.enable and dynamic.max_num_gen_batches < 1:
        errors.append(
            f"algorithm.filter_groups.max_num_gen_batches must be >= 1, got {dynamic.max_num_gen_batches}"
        )
    limit = cfg.rollout.max_new_tokens(cfg.rollout.sampling)
    if overlong.enable and not 0 < overlong.length <= limit:
        errors.append(
            f"algorithm.overlong_buffer.length={overlong.length} must be in (0, {limit}] (the response "
            "limit, rollout.sampling.max_new_tokens or rollout.response_length)"
        )
    return errors


def _mismatch_settings_unread(cfg: RecipeConfig) -> list[str]:
    """The mismatch monitor's thresholds without the engine's log-probs (mismatch_policy=stop has
    its own error, in _check_mismatch_monitor)."""
    if cfg.rollout.calculate_log_probs:
        return []
    changed = _changed_fields(cfg.trainer, "trainer", ("mismatch_threshold", "mismatch_token_threshold"))
    return _no_effect(
        changed,
        "rollout.calculate_log_probs=false",
        ": the mismatch monitor compares the engine's log-probs, which are then not computed; set "
        "rollout.calculate_log_probs=true, or remove {it}",
    )


def _rollout_correction_settings_unread(cfg: RecipeConfig) -> list[str]:
    """Settings of a rollout-correction part its switch leaves off (mode, token_mask); lower, level
    and the rejection bounds without their part are refused instead (validate_rollout_correction)."""
    section, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    read = {
        "upper": section.mode != "none",
        "token_mask_low": section.token_mask == "icepop",
        "token_mask_high": section.token_mask == "icepop",
        "kpop_threshold": section.token_mask == "kpop",
    }
    changed = _changed_fields(section, key, tuple(name for name, is_read in read.items() if not is_read))
    return _no_effect(
        changed,
        f"{key}.mode={section.mode} and {key}.token_mask={section.token_mask}",
        ": a mode reads upper, token_mask=icepop token_mask_low and token_mask_high, token_mask=kpop "
        "kpop_threshold; switch the part on, or remove {it}",
    )


def _policy_loss_settings_unread(cfg: RecipeConfig) -> list[str]:
    """The registered losses' own knobs (tau_pos, dro_beta, ...) that the chosen registered loss
    does not read (a user's loss may read any of them)."""
    name = cfg.actor.update.policy_loss
    if name not in POLICY_LOSS_KNOBS:
        return []
    shared = POLICY_LOSS_KNOBS["vanilla"]  # PPO's clip, which several losses read in their own way
    own = dict.fromkeys(k for knobs in POLICY_LOSS_KNOBS.values() for k in knobs if k not in shared)
    unread = tuple(k for k in own if k not in POLICY_LOSS_KNOBS[name])
    return _no_effect(
        _changed_fields(cfg.actor.update, "actor.update", unread),
        f"actor.update.policy_loss={name}",
        ": docs/algorithms.md lists the losses that read {it}; choose one of them, or remove {it}",
    )
