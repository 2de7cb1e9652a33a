"""The SGLang contract double (tests/doubles/sglang) importable as `sglang` for one test, and a
tiny checkpoint for it; the hf engine tests' tiny Qwen2 (`checkpoint`) and its transformers model
(`reference_model`), which tests/rollout/test_vllm_rollout.py replaces with a wider model of its own.

Outside the `sglang_double` fixture `sglang` must stay missing in the test process (the
availability check expects it). Building an engine changes process-wide state as SGLang does (the
root logger, `os.environ`); the fixture puts that back afterwards, whatever the code under test did.
"""

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "megatron"))
from tiny_hf import ascii_vocab_size, make_tiny_hf_checkpoint  # noqa: E402


@pytest.fixture
def sglang_double(monkeypatch):
    root = logging.getLogger()
    handlers, level, environ = list(root.handlers), root.level, dict(os.environ)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the one GPU of this "rank"
    monkeypatch.syspath_prepend(str(TESTS / "doubles"))
    import sglang

    yield sglang
    for name in [m for m in sys.modules if m.split(".")[0] == "sglang"]:
        del sys.modules[name]
    for handler in root.handlers[:]:  # what logging.basicConfig(force=True) installed
        if type(handler) is logging.StreamHandler and handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture(scope="module")
def sglang_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("sglang_tiny"), vocab_size=ascii_vocab_size())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Every id decodes to one character or one special token, so stop strings map to token positions.
    vocab_size = ascii_vocab_size()
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", vocab_size=vocab_size)


@pytest.fixture(scope="module")
def reference_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
