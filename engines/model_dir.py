"""What kind of model a Hugging Face directory holds, read from its config.json alone (no engine
library): the driver's checks, its choice of a vision-language policy's processor and the policy
worker's choice of model build all ask it, without importing an engine's modules."""

import json
from pathlib import Path


def is_vision_language_dir(path) -> bool:
    """Whether `<path>/config.json` describes a vision-language model (it has a `vision_config`);
    False where there is no readable config (load_hf_config names that problem)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and "vision_config" in raw
