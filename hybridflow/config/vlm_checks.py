"""What a recipe may combine with a vision-language policy (a LLaVA `model.path`, docs/vlm.md):
the parts of hybridflow built for image prompts so far. Each problem names the key and the fix."""

from hybridflow.config.schema import RecipeConfig


def _settings_problems(cfg: RecipeConfig) -> list[str]:
    megatron, trainer = cfg.actor.megatron, cfg.trainer
    checks = [
        (cfg.rollout.name == "sglang", "rollout.name=sglang: image prompts generate with the hf and vllm "
         "engines only so far; set rollout.name: hf or vllm"),
        (cfg.actor.lora.rank > 0, f"actor.lora.rank={cfg.actor.lora.rank}: LoRA on a vision-language "
         "model is not built; set it to 0"),
        (megatron.pipeline_model_parallel_size > 1 or megatron.context_parallel_size > 1
         or megatron.sequence_parallel, "actor.megatron: the LLaVA actor runs tensor parallelism only; "
         "set pipeline_model_parallel_size and context_parallel_size to 1 and sequence_parallel false"),
        (cfg.actor.update.use_dynamic_bsz, "actor.update.use_dynamic_bsz=true: packing with image "
         "tokens is not built; set it to false"),
        (cfg.rollout.agent.loop != "single_turn", f"rollout.agent.loop={cfg.rollout.agent.loop}: agent "
         "loops with image prompts are not built; use single_turn"),
        (trainer.async_training.mode != "sync" or trainer.placement != "colocated",
         "trainer.async_training.mode / trainer.placement: a vision-language policy trains synchronously "
         "with its engines colocated (the weight sync to a separate rollout pool is not built); use "
         "mode: sync and placement: colocated"),
        (cfg.critic.enable or cfg.reward_model.enable or cfg.algorithm.distillation.enable,
         "critic / reward_model / algorithm.distillation: only the policy may be a vision-language model, "
         "and the others would read its image prompts as text; use a critic-free algorithm (e.g. GRPO) "
         "with a rule or custom reward"),
    ]  # fmt: skip
    return [message for failed, message in checks if failed] + _vllm_problems(cfg)


def _vllm_problems(cfg: RecipeConfig) -> list[str]:
    from engines.rollout.vllm_images import check_image_engine_args

    if cfg.rollout.name != "vllm":
        return []
    problems = []
    if cfg.rollout.verify_weight_sync:
        problems.append("rollout.verify_weight_sync=true: with vllm the check scores text tokens through "
                        "the actor, and the LLaVA actor takes none without images; set it to false, or use "
                        "rollout.name: hf, whose check compares the weights themselves")  # fmt: skip
    try:
        check_image_engine_args(cfg.rollout.vllm)
    except ValueError as err:
        problems.append(str(err))
    return problems


def vision_language_problems(cfg: RecipeConfig, path: str) -> list[str]:
    """The recipe's settings a vision-language `model.path` cannot run with yet, each naming the fix."""
    return [f"model.path={path} is a vision-language model: {problem}" for problem in _settings_problems(cfg)]
