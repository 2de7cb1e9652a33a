"""A base model's turn ends at the chat template's end of turn, not at its EOS: on the real vLLM
engine (CPU build), a tiny model with a Qwen2.5 base tokenizer (EOS `<|endoftext|>`, turns ending
on `<|im_end|>`) that goes on writing a tool response and another call after `<|im_end|>` trains
only up to its end of turn, and only the call before it runs. See `_vllm_base_model_worker.py`."""

import os
import sys
from pathlib import Path

import pytest
from base_model import make_base_model
from process_group import run_in_own_session

WORKER = Path(__file__).resolve().parent / "_vllm_base_model_worker.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_base_models_turn_ends_at_the_templates_end_of_turn(tmp_path):
    model_dir = make_base_model(tmp_path / "base_model")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    done = run_in_own_session([sys.executable, str(WORKER), str(model_dir)], cwd=ROOT, env=env, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    for check in ("stops-at-end-of-turn", "only-real-calls-run"):
        assert f"OK {check}" in output, f"check {check!r} did not pass:\n{output[-4000:]}"
