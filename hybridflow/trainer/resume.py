"""Which checkpoint a run continues from, and whether the recipe still means the same run.

`plan_resume(cfg)` picks the checkpoint (trainer.resume_from_path, else the latest valid one
when trainer.resume_mode is auto), reads its driver state and compares the recipe stored in it
with the current one. A change to a key that changes the shapes of the saved tensors (the LoRA
adapters) is refused: no acceptance makes them loadable. A change to a key that moves the data
position or changes what one update is (batch sizes, seeds, samples per prompt, async mode and
staleness, packing, ...) is refused with the list of differing keys, unless each is named in
trainer.resume_accept_changes; any other difference is logged. Nothing here needs Ray or a
worker: the check runs before anything starts.
"""

import logging
from dataclasses import dataclass

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import RecipeConfig
from hybridflow.trainer.checkpoint import CheckpointManager, ResumePoint, load_trainer_state

logger = logging.getLogger(__name__)

# Keys whose change reinterprets the saved data position (which rows come next) or the update a
# step makes, so a resumed run would silently be another run.
POSITION_AND_UPDATE_KEYS = (
    "data.train_files",
    "data.train_batch_size",
    "data.train_max_samples",
    "data.max_prompt_length",
    "data.prompt_key",
    "data.shuffle",
    "data.seed",
    "rollout.sampling.n",
    "rollout.seed",  # the responses sampled for the same prompts
    "actor.update.ppo_mini_batch_size",
    "actor.update.ppo_epochs",
    "actor.update.shuffle",
    "actor.update.seed",
    "actor.update.use_dynamic_bsz",  # packing: which sequences share a micro-batch
    "actor.lora.alpha",  # the adapters' update is scaled by alpha / rank
    "critic.enable",
    "critic.update.ppo_mini_batch_size",
    "critic.update.ppo_epochs",
    "critic.update.use_dynamic_bsz",
    "algorithm.adv_estimator",
    "algorithm.distillation.enable",  # the advantage becomes the reverse KL to the teacher
    "teacher.path",  # another teacher, another objective
    "trainer.mode",
    # an async run's checkpoint holds the prompts drawn ahead and their generations
    "trainer.async_training.mode",
    "trainer.async_training.max_staleness",
    "trainer.async_training.partial_rollout",
)
# Keys whose change alters the shapes of the tensors a checkpoint holds: it cannot be loaded.
SHAPE_KEYS = ("actor.lora.rank", "actor.lora.target_modules")
# Keys that say where and how to resume; they differ between the runs by design.
RESUME_KEYS = ("trainer.resume_mode", "trainer.resume_from_path", "trainer.resume_accept_changes")


class RecipeChangedError(ValueError):
    """The recipe differs from the checkpoint's in keys that change the data position or update."""


@dataclass(frozen=True)
class ResumePlan:
    point: ResumePoint
    state: dict  # load_trainer_state's dict (driver RNG not restored yet)
    changes: dict[str, tuple]  # key -> (checkpoint's value, current value), accepted or harmless


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def recipe_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """Dotted key -> (saved value, current value) for every key whose value differs (a key only
    one side has shows `None` for the other), resume settings left out."""
    old, new = flatten(saved), flatten(current)
    keys = sorted((old.keys() | new.keys()) - set(RESUME_KEYS))
    return {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}


def check_recipe_changes(changes: dict[str, tuple], accepted: list[str], checkpoint) -> None:
    """RecipeChangedError listing the shape keys that changed, else the position / update keys that
    changed and are not accepted."""
    check_shapes_unchanged(changes, checkpoint)
    unknown = [key for key in accepted if key not in POSITION_AND_UPDATE_KEYS]
    if unknown:
        raise ValueError(
            f"trainer.resume_accept_changes names {unknown}, which are not keys that need accepting; "
            f"choose from {list(POSITION_AND_UPDATE_KEYS)}"
        )
    refused = {k: v for k, v in changes.items() if k in POSITION_AND_UPDATE_KEYS and k not in accepted}
    if refused:
        raise RecipeChangedError(
            f"cannot resume from {checkpoint}: the recipe changed keys that move the data position or "
            f"change the update ({listed(refused)}). Resume with the checkpoint's values, start a fresh run "
            f"(another trainer.output_dir, or trainer.resume_mode=disable), or accept the change with "
            f"trainer.resume_accept_changes=[{','.join(refused)}]"
        )


def check_shapes_unchanged(changes: dict[str, tuple], checkpoint) -> None:
    """RecipeChangedError when a SHAPE_KEYS change makes the checkpoint unloadable (each rank's
    loader would fail with Megatron's raw CheckpointException); no acceptance helps."""
    unloadable = {k: v for k, v in changes.items() if k in SHAPE_KEYS}
    if unloadable:
        raise RecipeChangedError(
            f"cannot resume from {checkpoint}: {listed(unloadable)} changes the shapes of the tensors the "
            "checkpoint holds (the LoRA adapters and their optimizer state), so it cannot be loaded. Resume "
            "with the checkpoint's values, or start a fresh run (another trainer.output_dir, or "
            "trainer.resume_mode=disable)"
        )


def listed(changes: dict[str, tuple]) -> str:
    return "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items())


def plan_resume(cfg: RecipeConfig) -> ResumePlan | None:
    """The checkpoint to continue from with its driver state, or None for a fresh start.

    Raises CheckpointError for an invalid explicit resume_from_path and RecipeChangedError for a
    refused recipe change; logs every other recipe difference."""
    trainer = cfg.trainer
    manager = CheckpointManager(f"{trainer.output_dir}/checkpoints", trainer.max_ckpt_to_keep)
    if trainer.resume_from_path:
        point = manager.load_resume_point(trainer.resume_from_path)
    elif trainer.resume_mode == "auto":
        point = manager.find_resume_point()
    else:
        return None
    if point is None:
        return None
    state = load_trainer_state(point.part("trainer_state.pt"), restore_rng=False)
    changes = recipe_changes(state["config"], to_dict(cfg))
    check_recipe_changes(changes, list(trainer.resume_accept_changes), point.path)
    for key, (old, new) in changes.items():
        logger.warning("recipe differs from checkpoint %s: %s %r -> %r", point.path, key, old, new)
    return ResumePlan(point=point, state=state, changes=changes)
