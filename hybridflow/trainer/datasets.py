"""The prompt datasets a recipe trains and validates on, built the same way by the trainer and by
its preflight checks: a vision-language `model.path` reads image prompts with its own processor
(hybridflow/data/image_prompts.py), a text model with its tokenizer."""

import dataclasses
from pathlib import Path

from hybridflow.agents.tools.base import prompt_tools
from hybridflow.config.schema import RecipeConfig
from hybridflow.data.prompt_dataset import PromptDataset


def policy_processor(cfg: RecipeConfig):
    """The policy's Hugging Face processor when it is a vision-language model, else None."""
    from engines.model_dir import is_vision_language_dir

    if not is_vision_language_dir(cfg.model.path):
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)


def with_generated_data(cfg: RecipeConfig) -> RecipeConfig:
    """With data.source.reasoning_gym: its training and held-out prompts written as parquet under
    <trainer.output_dir>/data/ (hybridflow/data/reasoning_gym.py) and named in data.train_files /
    data.val_files, which the resolved recipe then records; otherwise `cfg` unchanged."""
    source = cfg.data.source.reasoning_gym
    if not source.enabled():
        return cfg
    from hybridflow.data.reasoning_gym import write_splits

    paths, dropped = write_splits(source, Path(cfg.trainer.output_dir) / "data")
    print(f"reasoning-gym prompts ({', '.join(source.tasks)}): {', '.join(map(str, paths.values()))}")
    if dropped:
        print(f"dropped {dropped} of {source.size} generated training prompts: held-out questions too")
    files = {"train_files": [str(paths["train"])], "val_files": [str(paths["val"])] if "val" in paths else []}
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **files))


def recipe_prompt_dataset(cfg: RecipeConfig, tokenizer, files: list[str], max_samples: int | None,
                          processor=None) -> PromptDataset:  # fmt: skip
    data = cfg.data
    tools = prompt_tools(cfg.rollout.agent)
    return PromptDataset(
        files, tokenizer, data.max_prompt_length, data.prompt_key, max_samples, tools, processor=processor,
        template_kwargs=cfg.rollout.chat_template_kwargs,
    )  # fmt: skip
