"""A loaded recipe checked before anything starts, and the files it names: every problem is
reported at once, each naming the key path (or the file) and the fix. Nothing is corrected
silently.

`validate_recipe` is the one pass over the recipe alone that the driver runs before Ray or any
process group exists. It checks value ranges and paths, runs every engine validator (optimizer,
actor / critic update, rollout, Megatron layout against each model's config.json), refuses what
the engines cannot do here (context parallelism, sequence parallelism without Transformer Engine
on CUDA) and applies the cross-field rules (devices, batch sizes, algorithm), each subject's
rules in its own module of this package. Choice values are `Literal` types in the schema,
checked when the recipe loads.

`check_run_inputs(cfg)` then reads what the workers would otherwise discover only after Ray and
Megatron have started: each model's safetensors headers (no tensor is loaded) and every tensor
shape in them against config.json, the tokenizer, the prompt data (columns, every prompt, the
reward inputs, enough rows for a batch) and the checkpoint a resume would start from; it warns
when trainer.output_dir has less free space than one checkpoint needs. Each problem raises
ValueError / FileNotFoundError naming the file (and row) and the fix.
"""

import logging
from pathlib import Path

from hybridflow.checks.agents import (
    _agent_settings_unread,
    _check_agent_tools,
    _check_environment,
    check_chat_template,
)
from hybridflow.checks.algorithm import (
    _check_algorithm,
    _mismatch_settings_unread,
    _policy_loss_settings_unread,
    _rollout_correction_settings_unread,
)
from hybridflow.checks.async_training import (
    _check_async_training,
    _check_placement,
    _check_top_k_requests,
    warn_if_staleness_is_out_of_reach,
)
from hybridflow.checks.data import _check_data_source, check_data
from hybridflow.checks.distillation import (
    _check_distillation,
    _check_distillation_weights_finite,
    _distillation_in_sft,
    _distillation_settings_unread,
    check_teacher_tokenizer,
)
from hybridflow.checks.engines import (
    _check_devices,
    _check_engine_settings,
    _check_lora_sync,
    _check_lora_without_adapters,
)
from hybridflow.checks.layout import Layout, _check_batch_sizes, _check_token_budgets, _layout
from hybridflow.checks.models import (
    _check_models,
    check_routing_replay,
    check_weights,
    load_tokenizer,
    warn_if_a_checkpoint_does_not_fit,
)
from hybridflow.checks.resume import check_resume_point
from hybridflow.checks.roles import _megatron_roles, uses_teacher
from hybridflow.checks.settings import _changed_fields, _check_not_a_number, _get, _no_effect
from hybridflow.checks.vlm import check_image_columns_match_model
from hybridflow.config.schema import RecipeConfig
from hybridflow.reward.registry import load_reward_fn
from hybridflow.utils.hub import HOW_TO_FETCH

logger = logging.getLogger(__name__)

UPDATE_SIZES = ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs")


MEGATRON_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "make_vocab_size_divisible_by",
)


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


def _check_settings_read(cfg: RecipeConfig) -> list[str]:
    """Settings of a feature the recipe leaves off have no effect: refused, not ignored (as the
    LoRA settings without adapters). Those a recipe keeps when one switch turns the feature off
    (distillation's enable, the agent loop) are a warning instead (warn_if_settings_unread)."""
    return _distillation_in_sft(cfg) + _samples_in_sft(cfg)


def _samples_in_sft(cfg: RecipeConfig) -> list[str]:
    """trainer.save_samples in an SFT run, which samples nothing: it writes no samples/ folder."""
    if cfg.trainer.mode != "sft":
        return []
    changed = _changed_fields(cfg.trainer, "trainer", ("save_samples",))
    fix = ": SFT trains on the data files' own responses, so nothing is sampled; remove {it}"
    return _no_effect(changed, "trainer.mode=sft", fix)


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


def check_run_inputs(cfg: RecipeConfig) -> None:
    parameters = check_weights(cfg)
    check_routing_replay(cfg)
    tokenizer = load_tokenizer(cfg)
    check_chat_template(cfg, tokenizer)
    if cfg.rollout.agent.loop == "environment":
        from hybridflow.agents.openenv_env import check_server

        check_server(cfg.rollout.agent.environment)
    if uses_teacher(cfg):  # the teacher scores the student's token ids: one tokenizer for both
        check_teacher_tokenizer(cfg.teacher.path, tokenizer, cfg.model.path)
    check_image_columns_match_model(cfg)
    train_rows = check_data(cfg, tokenizer)
    check_resume_point(cfg)
    warn_if_a_checkpoint_does_not_fit(cfg, parameters)
    warn_if_staleness_is_out_of_reach(cfg, train_rows)
