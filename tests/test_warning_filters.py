"""Third-party warnings known to be harmless are silenced in the workers and the driver
(hybridflow/utils/warning_filters.py), and nothing else is:

- each listed warning is ignored once `install()` ran, when it comes from its module; the same
  text from another module, and any other warning, still shows; the CUDA-only hint shows on GPUs;
- a normal run (the tiny GRPO run of tests/tiny_run.py, without PYTHONWARNINGS) prints no warning
  at all: not from Megatron-Core in the workers, not from the driver.
"""

import os
import uuid
import warnings

import pytest
from process_group import run_in_own_session
from tiny_run import command, environment, tiny_run_inputs

from hybridflow.utils.warning_filters import KNOWN_HARMLESS, install

SAMPLE_MODULES = {  # a module each entry's pattern is meant for, as Megatron-Core 0.16.1 names it
    r"megatron": "megatron.core.optimizer.clip_grads",
    r"megatron\.core\.transformer\.transformer_config": "megatron.core.transformer.transformer_config",
    r"megatron\.core\.tensor_parallel\.layers": "megatron.core.tensor_parallel.layers",
    r"vllm\.triton_utils\.dispatcher": "vllm.triton_utils.dispatcher",
}


def shown(message: str, module: str, cuda_available: bool = False, category=UserWarning) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        install(cuda_available=cuda_available)
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return bool(caught)


def sample_text(pattern: str) -> str:
    return pattern.replace("\\.", ".") + " (rest of the message)"


@pytest.mark.parametrize("known", KNOWN_HARMLESS, ids=[k.message[:40] for k in KNOWN_HARMLESS])
def test_each_listed_warning_is_silenced_from_its_module_only(known):
    text, module, category = sample_text(known.message), SAMPLE_MODULES[known.module], known.category
    assert not shown(text, module, category=category)
    assert shown(text, "hybridflow.trainer.ppo_trainer", category=category)  # hybridflow's own show
    assert shown(text, "transformers.modeling_utils", category=category)
    assert shown(known.why, module, category=category)  # another text from the same module
    assert shown(text, module, cuda_available=True, category=category) == known.only_without_cuda
    other = DeprecationWarning if category is not DeprecationWarning else UserWarning
    assert shown(text, module, category=other)  # the same text of another category


def test_every_entry_says_why():
    assert all(len(known.why) > 40 for known in KNOWN_HARMLESS)


@pytest.mark.slow
def test_a_normal_run_prints_no_warning(tmp_path):
    local = tiny_run_inputs(tmp_path / "inputs")
    env = environment(local, uuid.uuid4().hex)
    del env["PYTHONWARNINGS"]
    env.pop("RAY_DEDUP_LOGS", None)  # as a user's shell has it
    plots = "trainer.logger=[console,plots]"  # matplotlib too, as in a recipe's default run
    argv = command(local, tmp_path / "run", "trainer.total_training_steps=1", "trainer.save_freq=1", plots)
    result = run_in_own_session(argv, env=env, timeout=1200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Warning" not in output and "warnings.warn" not in output, output[-4000:]
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "global_step_1")
