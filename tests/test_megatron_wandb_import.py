"""Megatron-Core imports wandb when it is installed, for its inference engine only; imported through
engines.megatron it skips wandb (engines/megatron/__init__.py), and a run that logs to wandb in the
same process still gets it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
import engines.megatron.parallel
import megatron.core
from megatron.core.inference.contexts import dynamic_context

print("HAVE_WANDB", dynamic_context.HAVE_WANDB)
print("LOADED_AFTER_MEGATRON", "wandb" in sys.modules)
from hybridflow.utils.tracking import Tracking

tracking = Tracking(sys.argv[1], backends=["wandb"], project_name="p", experiment_name="e")
tracking.log({"score": 1.5}, step=1)
tracking.close()
print("LOADED_AFTER_LOGGING", "wandb.sdk" in sys.modules)
"""


def test_megatron_core_skips_wandb_and_a_wandb_run_in_the_process_still_logs(tmp_path):
    pytest.importorskip("wandb")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = set(done.stdout.splitlines())
    assert "HAVE_WANDB False" in lines  # Megatron-Core's inference engine, unused here, logs without it
    assert "LOADED_AFTER_MEGATRON False" in lines
    assert "LOADED_AFTER_LOGGING True" in lines
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
