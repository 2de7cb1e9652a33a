"""Model FLOPs of a dense decoder and the GPUs' dense bf16 peaks, for MFU figures.

Training FLOPs per token are 6 N + 12 L h T (PaLM, Chowdhery et al. 2022, appendix B): N the
matmul parameters (QKV, output projection, gate/up/down of every layer, and the output layer), L
layers, h hidden size, T the sequence length; a forward pass is a third of that. MFU counts the
real (unpadded) tokens, so padding work is not credited.
"""

# Dense bf16 peak FLOP/s by device-name fragment (vendor data sheets, SXM parts).
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def train_flops_per_token(hf, seq_len: float) -> float:
    """6 N + 12 L h T for a model config with the fields of engines.megatron.model.HFModelConfig."""
    h, f, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    kv = hf.num_key_value_heads * hf.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f  # QKV, output projection, gate/up/down
    matmul_params = layers * per_layer + h * hf.vocab_size  # + the output layer
    return 6 * matmul_params + 12 * layers * h * seq_len


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device named like torch.cuda.get_device_name(), or None if unknown."""
    return next((peak for key, peak in PEAK_BF16.items() if key in device_name), None)
