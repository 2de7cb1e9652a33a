"""The prompt datasets a recipe trains and validates on, built the same way by the trainer and by
the checks before Ray starts (hybridflow/checks/data.py): a vision-language `model.path` reads image
prompts with its own processor (hybridflow/data/image_prompts.py), a text model with its tokenizer."""

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


def recipe_prompt_dataset(cfg: RecipeConfig, tokenizer, files: list[str], max_samples: int | None,
                          processor=None) -> PromptDataset:  # fmt: skip
    data = cfg.data
    tools = prompt_tools(cfg.rollout.agent)
    return PromptDataset(
        files, tokenizer, data.max_prompt_length, data.prompt_key, max_samples, tools, processor=processor,
        template_kwargs=cfg.rollout.chat_template_kwargs,
    )  # fmt: skip
