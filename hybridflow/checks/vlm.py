"""What a recipe may combine with a vision-language policy (a LLaVA `model.path`, docs/vlm.md):
the parts of hybridflow built for image prompts so far, and prompt files whose image columns
agree with the policy. Each problem names the key and the fix.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.config.schema import RecipeConfig
from hybridflow.data.image_prompts import IMAGES_KEY


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


def _vision_tower_problems(cfg: RecipeConfig, path: str) -> list[str]:
    """A vision-language policy's unsupported settings; a vision-tower setting on a text model."""
    from engines.model_dir import is_vision_language_dir

    if is_vision_language_dir(path):
        return vision_language_problems(cfg, path)
    if not cfg.actor.freeze_vision_tower:
        return [f"actor.freeze_vision_tower=false, but model.path={path} is a text model with no "
                "vision tower; remove the setting"]  # fmt: skip
    return []


IMAGE_COLUMNS = ("images", "image")  # verl's data.image_key and the usual datasets column


def check_image_columns_match_model(cfg: RecipeConfig) -> None:
    """ValueError when a prompt file and the policy disagree about images: an image column with a
    text model (the trainer would read only the prompt's text and drop the images without a word),
    or a vision-language model with a file that has no `images` column."""
    from engines.model_dir import is_vision_language_dir

    vision = is_vision_language_dir(cfg.model.path)
    for key in ("train_files", "val_files"):
        for index, path in enumerate(getattr(cfg.data, key)):
            try:
                names = pq.read_schema(path).names
            except (OSError, pa.ArrowException):
                continue  # check_data names the unreadable file
            images = [name for name in names if name in IMAGE_COLUMNS]
            where, model = f"data.{key}[{index}]={path}", f"model.path={cfg.model.path}"
            if images and not vision:
                raise ValueError(
                    f"{where} has an image column '{images[0]}', but {model} is a text-only model "
                    f"({_architecture(cfg.model.path)}): its images would be dropped without a word; drop "
                    "the column, or train a vision-language model (docs/vlm.md)"
                )
            if vision and IMAGES_KEY not in names:
                raise ValueError(
                    f"{where} has no '{IMAGES_KEY}' column, but {model} is a vision-language model "
                    f"({_architecture(cfg.model.path)}) that reads each prompt's images from it; add the "
                    "column (a list of encoded images per row), or train a text model"
                )


def _architecture(model_dir: str) -> str:
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return ", ".join(raw.get("architectures") or [raw.get("model_type", "unknown")])
