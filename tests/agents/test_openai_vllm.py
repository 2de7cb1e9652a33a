"""Agents written against the `openai` client, through the chat-completions endpoint on the real
vLLM engine (CPU build): a 3-turn calculator conversation is exactly the engine's returned ids
plus the delta-rendered tool messages; an unsupported parameter is a 400; an edited history is a
counted divergence. See `_vllm_openai_worker.py` for each check."""

import os
import sys
from pathlib import Path

import pytest
from process_group import run_in_own_session

WORKER = Path(__file__).resolve().parent / "_vllm_openai_worker.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_openai_client_agents_on_vllm_are_token_in_token_out(tool_model):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    done = run_in_own_session([sys.executable, str(WORKER), str(tool_model)], cwd=ROOT, env=env, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    for check in ("three-turns", "token-in-token-out", "refused-and-edited"):
        assert f"OK {check}" in output, f"check {check!r} did not pass:\n{output[-4000:]}"
