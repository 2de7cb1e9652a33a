"""The checkpoint a run would resume from, before Ray starts: an explicit
trainer.resume_from_path is a finished checkpoint directory, and `latest` names one; restarts that
would find no checkpoint to restart from are warned of.
"""

import logging
from pathlib import Path

from hybridflow.config.schema import RecipeConfig
from hybridflow.utils.checkpoint_layout import LATEST, MANIFEST, STEP_DIR

logger = logging.getLogger(__name__)


def check_resume_point(cfg: RecipeConfig) -> None:
    """An explicit trainer.resume_from_path must be a finished checkpoint directory; with
    resume_mode auto, an existing `latest` file must name one."""
    trainer = cfg.trainer
    if trainer.resume_from_path:
        path = Path(trainer.resume_from_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"trainer.resume_from_path={path} does not exist; give a <output_dir>/checkpoints/"
                "global_step_N directory, or remove the key"
            )
        if not STEP_DIR.match(path.name):
            raise ValueError(f"trainer.resume_from_path={path}: expected a directory named global_step_N")
        if not (path / MANIFEST).is_file():
            raise ValueError(
                f"trainer.resume_from_path={path} has no {MANIFEST}: that checkpoint's save did not finish"
            )
    elif trainer.resume_mode == "auto":
        latest = Path(trainer.output_dir) / "checkpoints" / LATEST
        if latest.is_file() and not STEP_DIR.match(latest.read_text().strip()):
            raise ValueError(
                f"{latest} should name a global_step_N directory, it holds {latest.read_text()[:80]!r}; "
                "write the newest complete checkpoint's name there, or set trainer.resume_mode=disable"
            )


def warn_if_restarts_start_over(cfg: RecipeConfig) -> None:
    """A warning, not a refusal, for restarts without checkpoints: each restart then trains from
    step 0 again, which still finishes the run (a short run, or one whose checkpoints would not
    fit, may choose that), only later."""
    trainer = cfg.trainer
    if trainer.restart_on_failure > 0 and trainer.save_freq == 0:
        logger.warning(
            "trainer.restart_on_failure=%d with trainer.save_freq=0: no checkpoint is written, so every "
            "restart trains from step 0 again; set trainer.save_freq (e.g. 10) to restart from the newest "
            "checkpoint",
            trainer.restart_on_failure,
        )
