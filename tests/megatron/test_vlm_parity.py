"""The tiny LLaVA-shaped model (hybridflow/utils/tiny_vlm.py) on Megatron-Core's LLaVAModel against
transformers, one torchrun launch per case: logits and next-token log-probs within 1e-5 (fp32),
and the HF -> Megatron -> HF export bit for bit; then the actor's log-prob pass on a left-padded
batch with 0 to 2 images per row (each row against transformers alone) and the gradients through
Megatron's schedule. The checks live in `_vlm_parity_worker.py`, which prints one
"VLM PARITY OK tp=.. rank=.." line per rank when all of them passed."""

import pytest
from launch import run_distributed

from hybridflow.utils.tiny_vlm import make_tiny_vlm

MODELS = {
    # llava-1.5's choices: hidden state -2 (the tower's last layer unused), CLS feature dropped
    "qwen2": dict(text_arch="qwen2"),
    # every tower layer used, CLS kept, tied embeddings, one KV head (shared by both TP ranks)
    "llama_tied_full": dict(
        text_arch="llama",
        tie_word_embeddings=True,
        text_kv_heads=1,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        seed=1,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(("model", "tp"), [("qwen2", 1), ("qwen2", 2), ("llama_tied_full", 2)])
def test_llava_logits_and_export_match_transformers(tmp_path, model, tp):
    hf_dir = make_tiny_vlm(tmp_path / model, **MODELS[model])
    output = run_distributed(
        "_vlm_parity_worker.py", tp, "--hf-dir", hf_dir, "--out-dir", tmp_path / "export", timeout=600
    )
    for rank in range(tp):
        line = f"VLM PARITY OK tp={tp} rank={rank}"
        assert line in output, f"missing {line!r} in:\n{output[-4000:]}"


@pytest.mark.slow
def test_llava_actor_trains_with_a_frozen_tower_and_exports_what_it_trained(tmp_path):
    """`_vlm_train_worker.py` at TP2: SFT steps on the padded image batch lower the loss and leave
    the frozen tower bit for bit; the export gives transformers the actor's log-probs."""
    hf_dir = make_tiny_vlm(tmp_path / "qwen2", **MODELS["qwen2"])
    output = run_distributed(
        "_vlm_train_worker.py", 2, "--hf-dir", hf_dir, "--out-dir", tmp_path / "trained", timeout=600
    )
    for rank in range(2):
        line = f"VLM TRAIN OK tp=2 rank={rank}"
        assert line in output, f"missing {line!r} in:\n{output[-4000:]}"
