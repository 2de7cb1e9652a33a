"""Resume and recipe changes: the recipe stored in a checkpoint is compared with the current one
before anything starts; changes that move the data position or change the update are refused
with the list of keys unless accepted; other differences are logged."""

import logging

import pytest

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import RecipeConfig
from hybridflow.trainer.checkpoint import CheckpointError, CheckpointManager, save_trainer_state
from hybridflow.trainer.resume import RecipeChangedError, plan_resume, recipe_changes


def recipe(tmp_path, **trainer) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.model.path = "model"
    cfg.data.train_files = ["train.parquet"]
    cfg.trainer.output_dir = str(tmp_path / "run")
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def checkpoint(cfg: RecipeConfig, step: int = 2):
    def write(directory):
        (directory / "actor").mkdir()
        (directory / "actor" / "shard.bin").write_bytes(b"w" * 10)
        save_trainer_state(
            directory / "trainer_state.pt", step, {"epoch": 0, "batch_index": step, "seed": 1}, to_dict(cfg)
        )

    manager = CheckpointManager(f"{cfg.trainer.output_dir}/checkpoints")
    return manager.save(step, write, ["actor", "trainer_state.pt"])


def test_same_recipe_resumes_from_the_latest_with_its_state(tmp_path):
    cfg = recipe(tmp_path)
    path = checkpoint(cfg, step=2)
    plan = plan_resume(cfg)
    assert plan.point.path == path and plan.state["global_step"] == 2 and plan.changes == {}


def test_position_changing_keys_are_refused_with_the_list(tmp_path):
    cfg = recipe(tmp_path)
    checkpoint(cfg)
    cfg.data.train_batch_size = 128
    cfg.rollout.sampling.n = 4
    cfg.data.seed = 7
    cfg.actor.optim.lr = 1e-4  # not a position key: allowed
    with pytest.raises(RecipeChangedError) as err:
        plan_resume(cfg)
    message = str(err.value)
    assert "data.seed: 1 -> 7; data.train_batch_size: 256 -> 128; rollout.sampling.n: 1 -> 4" in message
    assert "trainer.resume_accept_changes=[data.seed,data.train_batch_size,rollout.sampling.n]" in message
    assert "actor.optim.lr" not in message


def test_accepted_changes_resume_and_every_difference_is_logged(tmp_path, caplog):
    cfg = recipe(tmp_path)
    checkpoint(cfg)
    cfg.data.train_batch_size = 128
    cfg.actor.optim.lr = 1e-4
    cfg.trainer.resume_accept_changes = ["data.train_batch_size"]
    with caplog.at_level(logging.WARNING):
        plan = plan_resume(cfg)
    assert set(plan.changes) == {"data.train_batch_size", "actor.optim.lr"}
    assert (
        "data.train_batch_size 256 -> 128" in caplog.text and "actor.optim.lr 1e-06 -> 0.0001" in caplog.text
    )


def test_accepting_a_key_that_needs_no_acceptance_is_an_error(tmp_path):
    cfg = recipe(tmp_path, resume_accept_changes=["actor.optim.lr"])
    checkpoint(cfg)
    with pytest.raises(ValueError, match=r"resume_accept_changes names \['actor.optim.lr'\]"):
        plan_resume(cfg)


def test_resume_settings_themselves_may_differ_and_disable_means_fresh(tmp_path):
    cfg = recipe(tmp_path)
    path = checkpoint(cfg)
    cfg.trainer.resume_from_path = str(path)
    assert plan_resume(cfg).changes == {}
    assert plan_resume(recipe(tmp_path, resume_mode="disable")) is None
    assert recipe_changes({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}) == {"a.c": (None, 2)}


def test_explicit_corrupted_checkpoint_is_refused_by_name(tmp_path):
    cfg = recipe(tmp_path)
    path = checkpoint(cfg)
    (path / "actor" / "shard.bin").write_bytes(b"x" * 10)
    cfg.trainer.resume_from_path = str(path)
    with pytest.raises(
        CheckpointError, match=r"cannot resume from .*global_step_2: file actor/shard.bin does not match"
    ):
        plan_resume(cfg)
    cfg.trainer.resume_from_path = None
    assert plan_resume(cfg) is None  # auto mode: skipped, fresh start


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [("actor.lora.rank", 16, "8 -> 16"), ("actor.lora.target_modules", ["linear_qkv"], "-> ['linear_qkv']")],
)
def test_a_change_of_the_checkpoint_shapes_is_refused_even_when_accepted(tmp_path, key, value, shown):
    """A LoRA rank or target change makes the saved adapters unloadable (each rank's loader would fail
    with a raw CheckpointException): refused before anything starts, acceptance or not."""
    cfg = recipe(tmp_path)
    cfg.actor.lora.rank = 8
    checkpoint(cfg)
    setattr(cfg.actor.lora, key.rpartition(".")[2], value)
    cfg.trainer.resume_accept_changes = [key]
    with pytest.raises(RecipeChangedError) as err:
        plan_resume(cfg)
    message = str(err.value)
    assert f"{key}: " in message and shown in message
    assert "changes the shapes of the tensors the checkpoint holds" in message
    assert "resume_accept_changes=" not in message  # nothing to accept: it cannot load


@pytest.mark.parametrize(
    ("changes", "listed"),
    [
        ({"mode": "sync"}, "trainer.async_training.mode: 'async' -> 'sync'"),
        ({"max_staleness": 1}, "trainer.async_training.max_staleness: 2 -> 1"),
        ({"partial_rollout": False}, "trainer.async_training.partial_rollout: True -> False"),
    ],
)
def test_an_async_run_resumed_otherwise_is_refused_unless_accepted(tmp_path, changes, listed):
    """An async run's checkpoint holds the prompts drawn ahead; another mode or bound would train on
    other data than the uninterrupted run."""
    cfg = recipe(tmp_path)
    settings = cfg.trainer.async_training
    settings.mode, settings.max_staleness, settings.partial_rollout = "async", 2, True
    checkpoint(cfg)
    for name, value in changes.items():
        setattr(settings, name, value)
    with pytest.raises(RecipeChangedError, match=listed):
        plan_resume(cfg)
    cfg.trainer.resume_accept_changes = [f"trainer.async_training.{name}" for name in changes]
    assert plan_resume(cfg) is not None


@pytest.mark.parametrize(
    "key",
    ["actor.lora.alpha", "actor.update.use_dynamic_bsz", "critic.update.use_dynamic_bsz", "rollout.seed"],
)
def test_update_scale_packing_and_sampling_seed_are_position_and_update_keys(tmp_path, key):
    cfg = recipe(tmp_path)
    checkpoint(cfg)
    section, _, leaf = key.rpartition(".")
    node = cfg
    for part in section.split("."):
        node = getattr(node, part)
    old = getattr(node, leaf)
    setattr(node, leaf, not old if isinstance(old, bool) else old + 1)
    with pytest.raises(RecipeChangedError, match=key):
        plan_resume(cfg)
