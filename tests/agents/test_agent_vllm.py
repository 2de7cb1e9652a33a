"""The tool agent loop on the real vLLM engine (CPU build): a 3-turn calculator conversation is
exactly the engine's sampled ids plus the rendered tool responses, malformed tool calls become
tool-error turns, and the prefix-cache counts of its turns and of batch calls are whole KV blocks
where vLLM's rule puts them. See `_vllm_agent_worker.py` for each check."""

import os
import sys
from pathlib import Path

import pytest
from process_group import run_in_own_session

WORKER = Path(__file__).resolve().parent / "_vllm_agent_worker.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tool_agent_loop_on_vllm_is_token_in_token_out(tool_model):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    done = run_in_own_session([sys.executable, str(WORKER), str(tool_model)], cwd=ROOT, env=env, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    for check in ("three-turns", "ids-are-replayed", "malformed-calls", "prefix-cache"):
        assert f"OK {check}" in output, f"check {check!r} did not pass:\n{output[-4000:]}"
