"""The `sglang` engine: availability errors everywhere; generation and weight updates where SGLang
and CUDA are present (skipped otherwise, with the reason)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from engines.rollout.base import check_rollout_available
from engines.rollout.sglang_rollout import _output_ids_with_eos

HAS_SGLANG_GPU = torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


def test_availability_check_names_the_problem():
    check_rollout_available("hf")
    with pytest.raises(ValueError, match="'hf', 'vllm' or 'sglang'"):
        check_rollout_available("trtllm")
    if HAS_SGLANG_GPU:
        check_rollout_available("sglang")
    else:
        with pytest.raises(RuntimeError, match=r"rollout\.name=sglang needs"):
            check_rollout_available("sglang")


def test_eos_is_kept_once_in_the_output_ids():
    def output(ids, finish):
        return {"output_ids": ids, "meta_info": {"finish_reason": finish}}

    assert _output_ids_with_eos(output([5, 6], {"type": "stop", "matched": 1})) == [5, 6, 1]
    assert _output_ids_with_eos(output([5, 6, 1], {"type": "stop", "matched": 1})) == [5, 6, 1]
    assert _output_ids_with_eos(output([5, 6], {"type": "stop", "matched": "##"})) == [5, 6]
    assert _output_ids_with_eos(output([5, 6], {"type": "length", "length": 2})) == [5, 6]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SGLANG_GPU, reason="SGLang engine tests need CUDA and the sglang package")
def test_sglang_generates_greedy_like_transformers_and_takes_new_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from engines.placement import EngineDevices, this_process_slot
    from engines.rollout.config import RolloutConfig, SamplingConfig
    from engines.rollout.sglang_rollout import SGLangRolloutEngine
    from engines.rollout.weight_sync import WeightSyncError
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
