"""CheckpointManager: atomic publish, `latest`, pruning, verification against the manifest,
fallback past incomplete checkpoints; trainer state and RNG round trips."""

import json
import logging
import random
import shutil

import numpy as np
import pytest
import torch

from hybridflow.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    load_trainer_state,
    save_trainer_state,
    verify_checkpoint,
)


def writer(step: int):
    """A write_fn like the trainer's: an actor folder of shards and a trainer_state file."""

    def write(directory):
        (directory / "actor").mkdir()
        (directory / "actor" / "shard_0.bin").write_bytes(bytes([step]) * 100)
        (directory / "actor" / "shard_1.bin").write_bytes(bytes([step]) * 50)
        (directory / "trainer_state.pt").write_bytes(b"state" * step)

    return write


PARTS = ["actor", "trainer_state.pt"]


def test_save_publishes_directory_manifest_and_latest(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    path = manager.save(2, writer(2), PARTS)
    assert path == tmp_path / "checkpoints" / "global_step_2"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step_2\n"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["global_step_2", "latest"]
    assert verify_checkpoint(path) == []
    point = manager.find_resume_point()
    assert (point.step, point.path, point.part("actor")) == (2, path, path / "actor")


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert CheckpointManager(tmp_path / "none").find_resume_point() is None


def test_save_that_misses_a_part_is_not_published(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(1), PARTS)

    def partial(directory):
        (directory / "actor").mkdir()

    with pytest.raises(CheckpointError, match=r"did not write \['trainer_state.pt'\]"):
        manager.save(2, partial, PARTS)
    assert manager.latest_step() == 1
    assert not (tmp_path / "global_step_2").exists()
    assert manager.find_resume_point().step == 1


def test_crash_inside_write_fn_keeps_previous_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(1), PARTS)

    def crash(directory):
        (directory / "actor").mkdir()
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        manager.save(2, crash, PARTS)
    assert (tmp_path / ".tmp_global_step_2").exists()  # left behind, never read
    assert manager.find_resume_point().step == 1
    manager.save(2, writer(2), PARTS)  # the retried save replaces the leftover
    assert not (tmp_path / ".tmp_global_step_2").exists()
    assert manager.find_resume_point().step == 2


def test_max_to_keep_prunes_oldest(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        manager.save(step, writer(step), PARTS)
    assert manager.complete_steps() == [3, 4]
    with pytest.raises(ValueError, match="max_ckpt_to_keep must be >= 1"):
        CheckpointManager(tmp_path, max_to_keep=0)


def test_corrupted_latest_is_named_and_skipped_for_the_previous_complete(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        manager.save(step, writer(step), PARTS)
    (tmp_path / "global_step_3" / "actor" / "shard_1.bin").unlink()
    (tmp_path / "global_step_3" / "trainer_state.pt").write_bytes(b"x")  # truncated
    assert verify_checkpoint(tmp_path / "global_step_3") == [
        "file actor/shard_1.bin is missing",
        "file trainer_state.pt has 1 bytes, expected 15",
    ]
    with caplog.at_level(logging.WARNING):
        point = manager.find_resume_point()
    assert point.step == 2
    assert "skipping invalid checkpoint" in caplog.text and "actor/shard_1.bin is missing" in caplog.text
    assert f"falling back to the previous valid checkpoint {tmp_path / 'global_step_2'}" in caplog.text


def test_file_zeroed_in_place_is_caught_by_its_checksum(tmp_path, caplog):
    """Same size, different bytes: a size-only manifest would pass it."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(1), PARTS)
    manager.save(2, writer(2), PARTS)
    shard = tmp_path / "global_step_2" / "actor" / "shard_0.bin"
    shard.write_bytes(bytes(shard.stat().st_size))
    assert verify_checkpoint(tmp_path / "global_step_2") == [
        "file actor/shard_0.bin does not match its SHA-256 checksum (corrupted)"
    ]
    with caplog.at_level(logging.WARNING):
        assert manager.find_resume_point().step == 1
    assert "skipping invalid checkpoint" in caplog.text and "shard_0.bin does not match" in caplog.text
    with pytest.raises(CheckpointError, match=r"cannot resume from .*global_step_2: .*shard_0.bin does not"):
        manager.load_resume_point(tmp_path / "global_step_2")


def test_no_valid_checkpoint_left_is_a_fresh_start_and_says_so(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(1), PARTS)
    (tmp_path / "global_step_1" / "trainer_state.pt").write_bytes(b"xxxxx")  # same size, corrupted
    with caplog.at_level(logging.WARNING):
        assert manager.find_resume_point() is None
    assert f"no valid checkpoint in {tmp_path}: starting from scratch" in caplog.text


def test_manifest_without_checksums_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(1), PARTS)
    manifest = tmp_path / "global_step_1" / "manifest.json"
    manifest.write_text(json.dumps({"step": 1, "parts": PARTS, "files": {"trainer_state.pt": 5}}))
    assert "has manifest version None" in verify_checkpoint(tmp_path / "global_step_1")[0]


def test_missing_manifest_or_part_and_explicit_resume_path(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(1), PARTS)
    manager.save(2, writer(2), PARTS)
    (tmp_path / "global_step_2" / "manifest.json").unlink()
    assert verify_checkpoint(tmp_path / "global_step_2")[0].endswith("is missing (the save did not finish)")
    assert manager.find_resume_point().step == 1
    with pytest.raises(
        CheckpointError, match=r"cannot resume from .*global_step_2: .*manifest\.json is missing"
    ):
        manager.load_resume_point(tmp_path / "global_step_2")
    assert manager.load_resume_point(tmp_path / "global_step_1").step == 1
    shutil.rmtree(tmp_path / "global_step_1" / "actor")
    assert "part 'actor' is missing" in verify_checkpoint(tmp_path / "global_step_1")
    assert manager.find_resume_point() is None


def test_latest_without_its_directory_falls_back_to_newest_complete(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(5, writer(5), PARTS)
    (tmp_path / "latest").write_text("global_step_9\n")
    assert manager.find_resume_point().step == 5
    (tmp_path / "latest").write_text("junk")
    with pytest.raises(CheckpointError, match="should name a global_step_N directory"):
        manager.find_resume_point()


def draw_all() -> tuple:
    return random.random(), np.random.rand(), torch.rand(3)


def test_trainer_state_round_trip_restores_rng_and_fields(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draw_all()
    save_trainer_state(
        tmp_path / "trainer_state.pt",
        global_step=7,
        dataloader={"epoch": 1, "batch_index": 3, "seed": 1},
        config={"trainer": {"output_dir": "x"}},
        extra={"kl_coef": 0.02},
    )
    expected = draw_all()
    draw_all()  # move every generator on
    state = load_trainer_state(tmp_path / "trainer_state.pt")
    after = draw_all()
    assert after[0] == expected[0] and after[1] == expected[1] and torch.equal(after[2], expected[2])
    assert state["global_step"] == 7
    assert state["dataloader"] == {"epoch": 1, "batch_index": 3, "seed": 1}
    assert state["config"] == {"trainer": {"output_dir": "x"}}
    assert state["extra"] == {"kl_coef": 0.02}


def test_trainer_state_with_another_version_is_refused(tmp_path):
    torch.save({"version": 99}, tmp_path / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="trainer-state version 99"):
        load_trainer_state(tmp_path / "trainer_state.pt")


def test_a_partial_save_left_by_an_earlier_run_is_removed_and_reported(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(1), PARTS)
    (tmp_path / ".tmp_global_step_2" / "actor").mkdir(parents=True)
    assert manager.remove_partial_saves() == [tmp_path / ".tmp_global_step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "latest"]
    assert manager.remove_partial_saves() == []


def test_a_save_that_hits_enospc_names_the_step_the_space_and_the_checkpoint_to_resume(tmp_path):
    """/dev/full raises a real ENOSPC on write: a stand-in for a full filesystem."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(1), PARTS)

    def fill(directory):
        writer(2)(directory)
        with open("/dev/full", "wb") as full:
            full.write(b"x")

    with pytest.raises(OSError) as raised:
        manager.save(2, fill, PARTS)
    message = str(manager.save_failed(2, raised.value))
    partial, last = tmp_path / ".tmp_global_step_2", tmp_path / "global_step_1"
    assert message.startswith(
        f"step 2: saving the checkpoint into {partial} failed: No space left on device ("
    )
    assert " free of " in message
    assert f"the last complete checkpoint is {last}, which a rerun resumes from" in message


def test_a_save_failure_without_enospc_is_out_of_space_when_a_checkpoint_no_longer_fits(tmp_path):
    """A rank's writer may fail with another error on a full disk (torch's zip writer: 'unexpected
    pos'); less free space than one checkpoint takes then names the cause."""
    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    fits = str(CheckpointManager(tmp_path, expected_bytes=1).save_failed(1, err))
    assert "failed: RuntimeError: [enforce fail at inline_container.cc:672]" in fits
    assert "there is no complete checkpoint yet, so a rerun starts from the beginning" in fits
    too_big = CheckpointManager(tmp_path, expected_bytes=shutil.disk_usage(tmp_path).free + 2**30)
    assert "failed: No space left on device (" in str(too_big.save_failed(1, err))


def test_a_worker_error_is_reported_by_its_cause_in_one_line(tmp_path):
    """The driver's WorkerError carries the worker's traceback after its first line."""
    from ray.exceptions import RayTaskError

    from hybridflow.single_controller.errors import worker_error

    cause = ValueError("bad shard")
    err = worker_error(
        RayTaskError("save_checkpoint", "Traceback (most recent call last): ...", cause), 0, "save"
    )
    message = str(CheckpointManager(tmp_path).save_failed(3, err))
    assert "failed: ValueError: bad shard;" in message and "Traceback" not in message
