"""torchrun worker (1 process): the model's classes on a machine with apex but no Transformer Engine.

Megatron-Core's transformer block picks its final norm from a module-level default,
`LayerNormImpl`, which is apex's FusedLayerNorm whenever apex imports (common NGC images); that
class asserts `normalization == "LayerNorm"`, so an RMSNorm model failed to build there. The
worker sets the default as apex would, builds a Qwen2 model (and the MoE one), and checks the
final norm is torch's, the core attention is SDPA and the fused kernels are off, and that in bf16
every parameter, torch's norms included, is bf16; so is every parameter of a bf16 LLaVA (the last
argument), CLIPViTModel's patch convolution and its torch norms included. Prints
"KERNELS OK" when every check passed.
"""

import sys
from pathlib import Path

import megatron.core.transformer.transformer_block as transformer_block
import torch
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

from engines.megatron.attention import SDPACoreAttention
from engines.megatron.build import build_model, build_vlm_model
from engines.megatron.config import MegatronConfig
from engines.megatron.model import unwrap_model
from engines.megatron.parallel import init_megatron


def main(model_dirs: list[Path], vlm_dir: Path) -> None:
    transformer_block.LayerNormImpl = FusedLayerNorm  # what `import apex` selects in Megatron-Core
    init_megatron(MegatronConfig())
    for model_dir in model_dirs:
        model = unwrap_model(
            build_model(model_dir, MegatronConfig(), load_weights=False, for_training=False)[0]
        )
        final_norm = model.decoder.final_layernorm
        assert isinstance(final_norm, torch.nn.RMSNorm), type(final_norm)  # what WrappedTorchNorm makes
        attentions = {type(layer.self_attention.core_attention) for layer in model.decoder.layers}
        assert attentions == {SDPACoreAttention}, attentions
        config = model.config
        fused = (config.apply_rope_fusion, config.gradient_accumulation_fusion, config.bias_activation_fusion)
        assert fused == (False, False, False), fused
        check_every_parameter_in_bf16(model_dir, build_model, "layernorm")
    check_every_parameter_in_bf16(vlm_dir, build_vlm_model, "vision_model.conv1")
    print("KERNELS OK", flush=True)


def check_every_parameter_in_bf16(model_dir: Path, build, built_without_dtype: str) -> None:
    """A bf16 model's parameters are all bf16, those Megatron-Core builds without `params_dtype`
    (torch's norms; the CLIP tower's patch convolution), named by `built_without_dtype`, too."""
    cfg = MegatronConfig(params_dtype="bfloat16")
    model = unwrap_model(build(model_dir, cfg, load_weights=False, for_training=False)[0])
    dtypes = {name: param.dtype for name, param in model.named_parameters()}
    assert set(dtypes.values()) == {torch.bfloat16}, {n: d for n, d in dtypes.items() if d != torch.bfloat16}
    assert any(built_without_dtype in name for name in dtypes), sorted(dtypes)


if __name__ == "__main__":
    main([Path(arg) for arg in sys.argv[1:-1]], Path(sys.argv[-1]))
