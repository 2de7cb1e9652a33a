"""The names of a checkpoint directory's parts under `<output_dir>/checkpoints/`, read by the
trainer's saves and loads (hybridflow/trainer/checkpoint.py, which documents the layout) and by the
check of the checkpoint a run would resume from, before Ray starts (hybridflow/checks/resume.py)."""

import re

MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
