"""The recipe's model directories: Hugging Face Hub ids among them replaced by their local
snapshots (`hybridflow.utils.hub`), once, on the driver before anything starts."""

from hybridflow.config.schema import RecipeConfig
from hybridflow.utils.hub import resolve_model


def resolve_recipe_models(cfg: RecipeConfig) -> RecipeConfig:
    """Replaces every Hub id among the recipe's model paths by its local snapshot directory."""
    revision = cfg.model.revision
    cfg.model.path = resolve_model("model.path", cfg.model.path, revision)
    if cfg.model.tokenizer_path is not None:
        cfg.model.tokenizer_path = resolve_model("model.tokenizer_path", cfg.model.tokenizer_path, revision)
    if cfg.critic.enable and cfg.critic.model_path is not None:
        cfg.critic.model_path = resolve_model("critic.model_path", cfg.critic.model_path)
    if cfg.reward_model.enable and cfg.reward_model.path is not None:
        cfg.reward_model.path = resolve_model("reward_model.path", cfg.reward_model.path)
    if cfg.algorithm.distillation.enable and cfg.teacher.path is not None:
        cfg.teacher.path = resolve_model("teacher.path", cfg.teacher.path)
    return cfg
