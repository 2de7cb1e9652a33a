"""What kind of model a Hugging Face directory holds, read from its config.json alone (no engine
library): the driver picks a vision-language policy's processor by it, and the Megatron engine's
checks (engines/megatron/vlm_config.py) which config to read."""

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
