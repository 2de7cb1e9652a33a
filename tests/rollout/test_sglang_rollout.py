"""The `sglang` engine: availability errors everywhere; against the SGLang contract double
(tests/doubles/sglang, in this process through the `sglang_double` fixture), what building and
calling an engine must leave right (the worker's logging and CUDA/NCCL settings, int64 seeds, EOS
and its log-prob); generation and weight updates with the real SGLang where it and CUDA are present
(skipped otherwise, with the reason)."""

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from engines.placement import EngineDevices
from engines.process_env import PROCESS_ENV_KEYS, process_env
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.factory import check_rollout_available
from engines.rollout.sglang_rollout import SGLangRolloutEngine
from hybridflow.protocol import DataProto

HAS_SGLANG_GPU = torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None
GREEDY = SamplingConfig(do_sample=False, temperature=0.0)


def set_eos(checkpoint: Path, eos_id: int) -> None:
    """Declare `eos_id` the model's EOS in config.json and generation_config.json."""
    for name in ("config.json", "generation_config.json"):
        path = checkpoint / name
        config = json.loads(path.read_text())
        config["eos_token_id"] = eos_id
        path.write_text(json.dumps(config))


def double_engine(checkpoint: Path, **overrides) -> SGLangRolloutEngine:
    """The engine on this process's one GPU, with the sglang double in place of SGLang."""
    fields = dict(name="sglang", response_length=6, load_format="auto", val_sampling=GREEDY)
    return SGLangRolloutEngine(checkpoint, RolloutConfig(**{**fields, **overrides}), EngineDevices(("0",), 0))


def prompts(**meta_info) -> DataProto:
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = (ids > 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions}, meta_info=meta_info
    )


def test_availability_check_names_the_problem():
    check_rollout_available("hf")
    with pytest.raises(ValueError, match="'hf', 'vllm' or 'sglang'"):
        check_rollout_available("trtllm")
    if HAS_SGLANG_GPU:
        check_rollout_available("sglang")
    else:
        with pytest.raises(RuntimeError, match=r"rollout\.name=sglang needs"):
            check_rollout_available("sglang")


def test_engine_start_keeps_this_process_warnings(sglang_double, sglang_checkpoint, caplog):
    """D1: SGLang's engine calls logging.basicConfig(level="error", force=True) in this process;
    the worker's own warnings (the first being the engine's "not reproducible" one) must survive."""
    caplog.set_level(logging.WARNING)
    engine = double_engine(sglang_checkpoint)
    assert "SGLang sampling is not reproducible" in caplog.text
    logging.getLogger("hybridflow.workers").warning("a worker warning after the engine started")
    assert "a worker warning after the engine started" in caplog.text
    assert engine.engine.server_args["log_level"] == "warning"  # SGLang's own logs at this level too
    assert (
        double_engine(sglang_checkpoint, sglang={"log_level": "info"}).engine.server_args["log_level"]
        == "info"
    )


def test_deterministic_row_seeds_stay_in_int64_for_every_seed_stream(sglang_double, sglang_checkpoint):
    """D4: call seeds mixed with a seed stream reach 2**62; times the row stride they left int64 and
    SGLang refused the request (sampling_params.py 302-312)."""
    engine = double_engine(
        sglang_checkpoint, seed=10**7, enable_deterministic_inference=True, sampling=SamplingConfig(n=1)
    )
    first = engine.generate_sequences(prompts(rollout_seed_stream=3, seed=10**7)).batch["responses"]
    again = engine.generate_sequences(prompts(rollout_seed_stream=3, seed=10**7)).batch["responses"]
    assert torch.equal(first, again)  # the seeds were honoured
    from engines.rollout.base import row_seed

    for call_seed in (0, 10**13, 2**62 - 1, -5):
        seeds = [row_seed(call_seed, row) for row in (0, 1, 2**20)]
        assert len(set(seeds)) == 3 and all(0 <= seed < 2**63 for seed in seeds), seeds


def test_a_response_that_stopped_on_eos_ends_with_it_and_its_log_prob(
    sglang_double, sglang_checkpoint, tmp_path
):
    """SGLang's output_ids run through the stop condition: the EOS id and its log-prob come back."""
    import shutil

    from transformers import AutoModelForCausalLM

    checkpoint = Path(shutil.copytree(sglang_checkpoint, tmp_path / "eos"))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    batch = prompts(validate=True)
    prompt = batch.batch["input_ids"][1:2]  # (1, 4), no padding
    with torch.no_grad():
        greedy = model.generate(input_ids=prompt, do_sample=False, max_new_tokens=2, eos_token_id=None)
        eos = int(greedy[0, -1])  # the second greedy token becomes the EOS
        logits = model(greedy[:, :-1]).logits[0, -1]
    set_eos(checkpoint, eos)
    out = double_engine(checkpoint, calculate_log_probs=True).generate_sequences(batch)
    row = out.batch["responses"][1]
    assert row[:2].tolist() == greedy[0, -2:].tolist() and out.batch["response_mask"][1].tolist()[:3] == [
        1,
        1,
        0,
    ]
    expected = torch.log_softmax(logits.float(), -1)[eos]
    assert torch.allclose(out.batch["rollout_log_probs"][1, 1], expected, atol=1e-5)
    assert out.batch["rollout_log_probs"][1, 1] != 0


def test_engine_rank_keeps_the_settings_every_rank_got(sglang_double, sglang_checkpoint, monkeypatch):
    """D8: every Megatron rank starts with engines.process_env's settings; SGLang then writes
    CUDA_DEVICE_MAX_CONNECTIONS=8 and its NCCL settings into the engine rank's environment
    (engine.py 1878-1921). Afterwards the engine rank's values must still be every rank's."""
    for key in PROCESS_ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    every_rank = process_env("sglang", {}, os.environ)  # set on each rank before init_megatron
    assert every_rank == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
    }
    os.environ.update(every_rank)
    engine = double_engine(sglang_checkpoint)
    assert {key: os.environ.get(key) for key in PROCESS_ENV_KEYS} == {
        key: every_rank.get(key) for key in PROCESS_ENV_KEYS
    }
    engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SGLANG_GPU, reason="SGLang engine tests need CUDA and the sglang package")
def test_sglang_generates_greedy_like_transformers_and_takes_new_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from engines.placement import EngineDevices, this_process_slot
    from engines.rollout.config import RolloutConfig, SamplingConfig
    from engines.rollout.sglang_rollout import SGLangRolloutEngine
    from engines.weight_sync.common import WeightSyncError
    from hybridflow.protocol import DataProto

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
    from tiny_hf import ascii_vocab_size, make_tiny_hf_checkpoint

    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", vocab_size=ascii_vocab_size())
    greedy = SamplingConfig(do_sample=False, temperature=0.0)
    cfg = RolloutConfig(name="sglang", response_length=8, load_format="auto", val_sampling=greedy)
    devices = EngineDevices((this_process_slot(torch.cuda.device_count()).device,), base_gpu_id=0)
    engine = SGLangRolloutEngine(hf_dir, cfg, devices)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    ids = torch.randint(3, 100, mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        meta_info={"validate": True},
    )
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def expected_responses():
        with torch.no_grad():
            settings = dict(do_sample=False, max_new_tokens=8, eos_token_id=1, pad_token_id=0)
            out = reference.generate(input_ids=ids, attention_mask=mask, **settings)
        return out[:, ids.shape[1] :]

    def check():
        out = engine.generate_sequences(prompts)
        expected = expected_responses()
        width = expected.shape[1]
        keep = out.batch["response_mask"][:, :width] == 1
        assert torch.equal(out.batch["responses"][:, :width][keep], expected[keep])

    try:
        check()
        with torch.no_grad():
            for param in reference.parameters():
                param.add_(0.05 * torch.randn_like(param))
        weights = [(name, tensor.cuda()) for name, tensor in reference.state_dict().items()]
        # The sharding manager's cycle: release, resume weights, update in a session, resume the
        # KV cache, flush.
        engine.release_memory()
        engine.resume_memory(["weights"])
        with pytest.raises(WeightSyncError, match="begin_weight_update"):  # refused outside a session
            engine.update_weights(weights)
        engine.begin_weight_update()
        engine.update_weights(weights)
        engine.end_weight_update()
        engine.resume_memory(["kv_cache", "cuda_graph"])
        engine.flush_cache()
        check()
    finally:
        engine.shutdown()
