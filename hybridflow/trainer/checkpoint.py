"""Checkpoint directories that are either complete or ignored, and the driver's own state.

Layout under `<output_dir>/checkpoints/`:

    global_step_N/actor/             written by the actor workers (Megatron dist_checkpointing)
    global_step_N/critic/            written by the critic workers (when there is a critic)
    global_step_N/trainer_state.pt   the driver: step, data position, RNG states, config
    global_step_N/manifest.json      written last: every file of the checkpoint with its size
                                     and SHA-256
    latest                           text file naming the newest complete global_step_N

A save writes into `.tmp_global_step_N`, checks that every expected part is there, writes the
manifest, renames the directory to `global_step_N` (atomic on one filesystem) and then replaces
`latest` (write a temporary file + os.replace). A crash at any point leaves either the previous
checkpoint as `latest` or the new one complete. A save that fails (a full disk, a worker's error)
becomes one `CheckpointSaveError` naming the step, the directory, the cause and the checkpoint a
rerun resumes from; the partial `.tmp_global_step_N` it leaves is removed when the next run
starts (`remove_partial_saves`). On resume every file is checked against the
manifest (size and SHA-256, so a file zeroed in place is caught too): in `auto` mode a checkpoint
that does not match is reported by name and skipped in favour of the previous valid one (or a
fresh start, said so); a checkpoint named explicitly is refused with a `CheckpointError`.
"""

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridflow.utils.checkpoint_layout import LATEST, MANIFEST, STEP_DIR
from hybridflow.utils.disk import NO_SPACE, free_bytes, free_space_text, human_bytes, is_disk_full
from hybridflow.utils.imports import first_line

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
PARTIAL_SAVE = ".tmp_global_step_*"
TRAINER_STATE_VERSION = 1
MANIFEST_VERSION = 2  # 2: size and SHA-256 of every file (1 had sizes only)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with what is wrong with it."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint save that failed: the step, the directory, the cause, and where a rerun resumes."""


@dataclass(frozen=True)
class ResumePoint:
    """A complete checkpoint to continue from."""

    step: int
    path: Path

    def part(self, name: str) -> Path:
        return self.path / name


def step_dir_name(step: int) -> str:
    return f"global_step_{step}"


def sha256_of(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def list_files(root: Path) -> dict[str, dict]:
    """Relative path -> {"size", "sha256"} of every file under `root` (the manifest's content)."""
    files = (p for p in sorted(root.rglob("*")) if p.is_file())
    return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": sha256_of(p)} for p in files}


def file_problem(path: Path, rel: str, expected: dict) -> str | None:
    """What is wrong with file `rel` of the checkpoint at `path`, or None when it matches."""
    file = path / rel
    if not file.is_file():
        return f"file {rel} is missing"
    size = file.stat().st_size
    if size != expected["size"]:
        return f"file {rel} has {size} bytes, expected {expected['size']}"
    if sha256_of(file) != expected["sha256"]:
        return f"file {rel} does not match its SHA-256 checksum (corrupted)"
    return None


def verify_checkpoint(path: str | Path) -> list[str]:
    """Problems with the checkpoint at `path`, as readable strings ([] when it is complete)."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path} does not exist"]
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path} is missing (the save did not finish)"]
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        return [f"{manifest_path} is not valid JSON ({err})"]
    if manifest.get("version") != MANIFEST_VERSION:
        return [
            f"{manifest_path} has manifest version {manifest.get('version')}, this hybridflow checks "
            f"version {MANIFEST_VERSION} (sizes and checksums)"
        ]
    problems = [f"part {part!r} is missing" for part in manifest["parts"] if not (path / part).exists()]
    problems += [p for rel, exp in manifest["files"].items() if (p := file_problem(path, rel, exp))]
    return problems


class CheckpointManager:
    """Saves checkpoints atomically under `checkpoint_dir` and finds the one to resume from.

    max_to_keep: how many complete checkpoints to keep (oldest deleted first); None keeps all.
    expected_bytes: about what one checkpoint takes (preflight.checkpoint_size_estimate), to tell a
    failed save that ran out of space when no error says so (a rank's writer may fail with
    "unexpected pos" rather than ENOSPC, and the driver sees one rank's error).
    The directory must be on a filesystem every worker writes to (shared storage on several nodes).
    """

    def __init__(self, checkpoint_dir: str | Path, max_to_keep: int | None = None, expected_bytes: int = 0):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"trainer.max_ckpt_to_keep must be >= 1 or null (keep all), got {max_to_keep}")
        self.root = Path(checkpoint_dir)
        self.max_to_keep = max_to_keep
        self.expected_bytes = expected_bytes

    def save(self, step: int, write_fn: Callable[[Path], None], parts: list[str]) -> Path:
        """Calls `write_fn(directory)`, which must create each of `parts` (files or folders named
        relative to the directory, e.g. ["actor", "trainer_state.pt"]), then publishes the
        checkpoint as `global_step_<step>` and points `latest` at it. Returns its path."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp_{step_dir_name(step)}"
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save of this step
        tmp.mkdir(parents=True)
        write_fn(tmp)
        missing = [part for part in parts if not (tmp / part).exists()]
        if missing:
            raise CheckpointError(f"checkpoint save for step {step} did not write {missing} into {tmp}")
        manifest = {"version": MANIFEST_VERSION, "step": step, "parts": list(parts), "files": list_files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if final.exists():  # a rerun of a step after resuming from an earlier checkpoint
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._write_latest(final.name)
        self._prune()
        return final

    def save_failed(self, step: int, err: BaseException) -> CheckpointSaveError:
        """The one-line error for a save of `step` that raised `err` (a worker's error: its cause).
        Out of space: `err` says so, or the filesystem has less free than a checkpoint takes."""
        latest = self.latest_step()
        needed = max(self.expected_bytes, self._size(latest))
        if is_disk_full(err) or free_bytes(self.root) < needed:
            space = f"{free_space_text(self.root)} there, a checkpoint needs about {human_bytes(needed)}"
            reason = f"{NO_SPACE} ({space})"
        else:
            reason = first_line(getattr(err, "cause", None) or err)
        resume = (
            f"the last complete checkpoint is {self.root / step_dir_name(latest)}, which a rerun resumes from"
            if latest is not None
            else "there is no complete checkpoint yet, so a rerun starts from the beginning"
        )
        return CheckpointSaveError(
            f"step {step}: saving the checkpoint into {self.root / f'.tmp_{step_dir_name(step)}'} failed: "
            f"{reason}; {resume} (trainer.resume_mode=auto, the default)"
        )

    def _size(self, step: int | None) -> int:
        """Bytes of the complete checkpoint of `step` (its manifest's sizes); 0 when there is none."""
        manifest = self.root / step_dir_name(step) / MANIFEST if step is not None else None
        if manifest is None or not manifest.is_file():
            return 0
        return sum(entry["size"] for entry in json.loads(manifest.read_text())["files"].values())

    def remove_partial_saves(self) -> list[Path]:
        """Deletes the `.tmp_global_step_N` directories of saves that never finished (a crash, a
        full disk); returns them. Never resumed from, they only hold space."""
        partial = sorted(self.root.glob(PARTIAL_SAVE)) if self.root.is_dir() else []
        for path in partial:
            shutil.rmtree(path)
        return partial

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f".{LATEST}.tmp"
        tmp.write_text(name + "\n")
        os.replace(tmp, self.root / LATEST)

    def complete_steps(self) -> list[int]:
        """Steps of the published checkpoint directories, ascending (not verified)."""
        if not self.root.is_dir():
            return []
        matches = (STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in matches if m)

    def _prune(self) -> None:
        if self.max_to_keep is None:
            return
        for step in self.complete_steps()[: -self.max_to_keep]:
            shutil.rmtree(self.root / step_dir_name(step))

    def latest_step(self) -> int | None:
        """The step `latest` names, or None when there is no `latest` file."""
        latest = self.root / LATEST
        if not latest.is_file():
            return None
        match = STEP_DIR.match(latest.read_text().strip())
        if not match:
            raise CheckpointError(
                f"{latest} should name a global_step_N directory, it holds {latest.read_text()!r}"
            )
        return int(match.group(1))

    def find_resume_point(self) -> ResumePoint | None:
        """The newest valid checkpoint, starting from `latest` (for trainer.resume_mode: auto).

        A checkpoint that fails verification is logged with its problems and skipped, and the
        fallback is logged too (the previous valid checkpoint, or a fresh start); None when no
        valid checkpoint exists."""
        latest = self.latest_step()
        candidates = sorted(self.complete_steps(), reverse=True)
        if latest is not None:
            candidates = [latest] + [s for s in candidates if s < latest]
        skipped = False
        for step in candidates:
            path = self.root / step_dir_name(step)
            problems = verify_checkpoint(path)
            if not problems:
                if skipped:
                    logger.warning("falling back to the previous valid checkpoint %s", path)
                return ResumePoint(step=step, path=path)
            logger.warning("skipping invalid checkpoint %s: %s", path, "; ".join(problems))
            skipped = True
        if skipped:
            logger.warning("no valid checkpoint in %s: starting from scratch", self.root)
        return None

    def load_resume_point(self, path: str | Path) -> ResumePoint:
        """An explicitly named checkpoint (trainer.resume_from_path); an error names what is wrong."""
        path = Path(path)
        problems = verify_checkpoint(path)
        if problems:
            raise CheckpointError(f"cannot resume from {path}: " + "; ".join(problems))
        match = STEP_DIR.match(path.name)
        if not match:
            raise CheckpointError(f"cannot resume from {path}: expected a directory named global_step_N")
        return ResumePoint(step=int(match.group(1)), path=path)


def capture_rng_state() -> dict:
    """The driver's random states (Python, NumPy, torch CPU, and CUDA when present), as plain
    lists/tensors so `torch.load(weights_only=True)` reads them back."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state`."""
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_trainer_state(
    path: str | Path, global_step: int, dataloader: dict, config: dict, extra: dict | None = None
) -> None:
    """Writes the driver's state: the step just completed, the dataloader's `state_dict()`, the
    resolved recipe (plain dict), the driver RNG states, and `extra` (e.g. the adaptive KL
    controller's coefficient). Worker-side state (model, optimizer, LR schedule, worker RNG) is
    in the role folders the workers write."""
    state = {
        "version": TRAINER_STATE_VERSION,
        "global_step": global_step,
        "dataloader": dataloader,
        "config": config,
        "rng": capture_rng_state(),
        "extra": extra or {},
    }
    torch.save(state, path)


def load_trainer_state(path: str | Path, restore_rng: bool = True) -> dict:
    """Reads `save_trainer_state`'s file (and by default restores the driver RNG states)."""
    state = torch.load(path, weights_only=True)
    if state.get("version") != TRAINER_STATE_VERSION:
        raise CheckpointError(
            f"{path} has trainer-state version {state.get('version')}; this hybridflow reads "
            f"version {TRAINER_STATE_VERSION}"
        )
    if restore_rng:
        restore_rng_state(state["rng"])
    return state
