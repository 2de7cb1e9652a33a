"""Which models a recipe builds: the roles with a Megatron model, their directories, and whether
the distillation teacher is one of them (its own devices or the actor's).
"""

from hybridflow.config.schema import RecipeConfig


def uses_teacher(cfg: RecipeConfig) -> bool:
    """The distillation teacher is built only for an RL run with algorithm.distillation.enable."""
    return cfg.trainer.mode == "rl" and cfg.algorithm.distillation.enable


def teacher_devices_per_node(cfg: RecipeConfig) -> int:
    """Devices per node of the teacher's own pool; 0 when it shares the actor's processes."""
    return max(cfg.teacher.n_gpus_per_node, 0) if uses_teacher(cfg) else 0


def _megatron_roles(cfg: RecipeConfig) -> list[str]:
    """The roles that build a Megatron model: the actor (and the reference, with its layout), an
    enabled critic and an enabled reward model."""
    roles = ["actor"] + [role for role in ("critic", "reward_model") if getattr(cfg, role).enable]
    return roles + (["teacher"] if uses_teacher(cfg) else [])


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
