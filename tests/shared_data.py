"""The shared GSM8K files, found as ../shared/data/gsm8k from the repository root (the layout the
README describes); tests that need them skip, saying why, when they are absent."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"


def gsm8k_dir() -> Path:
    """The directory with GSM8K's train.jsonl and test.jsonl, or a pytest skip naming what is missing."""
    missing = [name for name in ("train.jsonl", "test.jsonl") if not (GSM8K_DIR / name).is_file()]
    if missing:
        pytest.skip(
            f"GSM8K {missing} not found in {GSM8K_DIR} (../shared/data/gsm8k from the repository root)"
        )
    return GSM8K_DIR
