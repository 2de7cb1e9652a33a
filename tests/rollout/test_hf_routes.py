"""The hf engine's recorded experts (rollout.return_routed_experts, engines/rollout/hf_routes.py) on
the tiny Qwen3-MoE, against an independent reference: transformers' own routers in one forward over
the finished sequences (no KV cache), read through forward hooks. The Megatron side of routing
replay is tests/megatron/test_routing_replay.py."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from hf_prompts import PROMPT_WIDTH, make_cfg, make_prompts
from tiny_hf import ascii_vocab_size, make_tiny_hf_checkpoint

from engines.rollout.hf_rollout import HFRolloutEngine

TIE = 1e-5


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    return make_tiny_hf_checkpoint(path, arch="qwen3_moe", num_layers=2, vocab_size=ascii_vocab_size())


def reference_routes(checkpoint, out) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' top-k experts (B, T, L, k) in one forward over `out`'s sequences, and whether
    the k-th and (k+1)-th router probabilities are within TIE (B, T, L)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    picks, ties = [], []

    def keep(module, args, output):
        logits, _, indices = output  # (B*T, E), _, (B*T, k)
        top = logits.float().softmax(-1).topk(module.top_k + 1, dim=-1).values  # (B*T, k+1)
        picks.append(indices)
        ties.append(top[:, -2] - top[:, -1] < TIE)

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(keep)
    ids, mask, positions = (out.batch[key] for key in ("input_ids", "attention_mask", "position_ids"))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions)
    routes = torch.stack([p.reshape(*ids.shape, -1) for p in picks], 2)  # (B, T, L, k)
    return routes, torch.stack([t.reshape(ids.shape) for t in ties], 2)  # (B, T, L)


def test_recorded_experts_equal_a_full_forward_and_the_rest_is_filler(moe_checkpoint):
    engine = HFRolloutEngine(moe_checkpoint, make_cfg(return_routed_experts=True))
    out = engine.generate_sequences(make_prompts(data_seed=3))
    routes = out.batch["routed_experts"]  # (B, P+R, L, k)
    assert routes.dtype == torch.int16 and routes.shape == (*out.batch["input_ids"].shape, 2, 2)
    expected, ties = reference_routes(moe_checkpoint, out)
    generated = int(out.batch["response_mask"].sum(-1).max())  # generate's decoding steps
    ran = PROMPT_WIDTH + generated - 1  # positions the engine fed through the model
    real = out.batch["attention_mask"].bool()[:, :ran, None] & ~ties[:, :ran]  # (B, ran, L)
    same = (routes[:, :ran].long().sort(-1).values == expected[:, :ran].sort(-1).values).all(-1)
    assert same[real].all() and real.sum() > 40
    assert (routes[:, ran:] == torch.arange(2, dtype=torch.int16)).all()  # never fed: filler ids


def test_no_routes_unless_asked_and_a_dense_model_is_refused(moe_checkpoint, tmp_path):
    out = HFRolloutEngine(moe_checkpoint, make_cfg()).generate_sequences(make_prompts())
    assert "routed_experts" not in out.batch
    dense = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", num_layers=1, vocab_size=ascii_vocab_size())
    with pytest.raises(ValueError, match="routing replay needs a mixture-of-experts model"):
        HFRolloutEngine(dense, make_cfg(return_routed_experts=True))
