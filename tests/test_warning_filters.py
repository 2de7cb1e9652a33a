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
}


def shown(message: str, module: str, cuda_available: bool = False) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        install(cuda_available=cuda_available)
        warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
    return bool(caught)


def sample_text(pattern: str) -> str:
    return pattern.replace("\\.", ".") + " (rest of the message)"


@pytest.mark.parametrize("known", KNOWN_HARMLESS, ids=[k.message[:40] for k in KNOWN_HARMLESS])
def test_each_listed_warning_is_silenced_from_its_module_only(known):
    text = sample_text(known.message)
    assert not shown(text, SAMPLE_MODULES[known.module])
    assert shown(text, "hybridflow.trainer.ppo_trainer")  # hybridflow's own warnings always show
    assert shown(text, "transformers.modeling_utils")
    assert shown(known.why, SAMPLE_MODULES[known.module])  # another text from the same module
    assert shown(text, SAMPLE_MODULES[known.module], cuda_available=True) == known.only_without_cuda


def test_every_entry_says_why():
    assert all(len(known.why) > 40 for known in KNOWN_HARMLESS)


@pytest.mark.slow
def test_a_normal_run_prints_no_warning(tmp_path):
    local = tiny_run_inputs(tmp_path / "inputs")
    env = environment(local, uuid.uuid4().hex)
    del env["PYTHONWARNINGS"]
    env.pop("RAY_DEDUP_LOGS", None)  # as a user's shell has it
    argv = command(local, tmp_path / "run", "trainer.total_training_steps=1", "trainer.save_freq=1")
    result = run_in_own_session(argv, env=env, timeout=1200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Warning" not in output and "warnings.warn" not in output, output[-4000:]
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "global_step_1")
