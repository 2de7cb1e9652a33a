"""Which Megatron-Core classes and fused kernels the model is built from, per machine.

The choice is a plain function of what the machine has (CUDA, Transformer Engine, apex's wgrad
extension), so these CPU tests check the CUDA choice: with TE, Megatron-Core's TE spec keeps TE's
core attention (taking the padding mask as TE's "arbitrary" mask) and TE's final norm, with the
fusions on; without TE, the local spec with SDPA attention and torch norms even where apex imports.
TE cannot be imported here, so its classes are stand-ins recording how they are called.
"""

from typing import ClassVar

import torch
from launch import run_distributed
from megatron.core.transformer.enums import AttnMaskType
from tiny_hf import make_tiny_hf_checkpoint

from engines.megatron import model as model_module
from engines.megatron.attention import SDPACoreAttention
from engines.megatron.forward import build_attention_mask
from engines.megatron.model import ModelKernels, block_spec, fusion_settings, model_kernels
from engines.megatron.te_attention import te_core_attention, te_mask_arguments
from hybridflow.utils.tiny_vlm import make_tiny_vlm


def test_transformer_engine_only_with_cuda_and_wgrad_fusion_only_with_apex():
    assert model_kernels(cuda=True, transformer_engine=True, apex_wgrad_extension=True) == ModelKernels(
        True, True
    )
    assert model_kernels(cuda=True, transformer_engine=True, apex_wgrad_extension=False) == ModelKernels(
        True, False
    )
    assert model_kernels(cuda=True, transformer_engine=False, apex_wgrad_extension=True) == ModelKernels(
        False, False
    )
    assert model_kernels(cuda=False, transformer_engine=True, apex_wgrad_extension=True) == ModelKernels(
        False, False
    )


def test_fusions_are_on_with_transformer_engine_and_off_without():
    on = fusion_settings(ModelKernels(transformer_engine=True, fused_wgrad=True))
    assert on["apply_rope_fusion"] and on["bias_activation_fusion"] and on["bias_dropout_fusion"]
    assert on["gradient_accumulation_fusion"]
    assert not fusion_settings(ModelKernels(transformer_engine=True, fused_wgrad=False))[
        "gradient_accumulation_fusion"
    ]
    off = fusion_settings(ModelKernels(transformer_engine=False, fused_wgrad=False))
    assert not any(off.values()), off


def test_te_mask_keeps_the_padding_mask_and_each_query_sees_itself():
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])  # left-padded row, right-padded row
    hidden = build_attention_mask(pad)  # (b, 1, s, s), True = hidden
    mask, kind = te_mask_arguments(hidden, packed=False)
    assert kind == AttnMaskType.arbitrary
    eye = torch.eye(5, dtype=torch.bool)
    assert not mask[:, :, eye].any()  # no row is fully hidden (TE would give NaN)
    assert torch.equal(mask[:, :, ~eye], hidden[:, :, ~eye])  # every other entry as the trainer built it
    assert te_mask_arguments(None, packed=False) == (None, AttnMaskType.causal)
    assert te_mask_arguments(None, packed=True) == (None, AttnMaskType.causal)  # Megatron: padding_causal


class StandInTEAttention(torch.nn.Module):
    """Megatron-Core's TEDotProductAttention (needs TE); records the arguments TE would receive."""

    calls: ClassVar[list] = []

    def forward(self, query, key, value, attention_mask, attn_mask_type, **kwargs):
        self.calls.append((attention_mask, attn_mask_type, kwargs))
        return query


class StandInTENorm(torch.nn.Module):
    pass


def te_spec_stand_in(**kwargs):
    """get_gpt_layer_with_transformer_engine_spec's arguments, answered with the local spec's layout."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    te_spec_stand_in.kwargs = kwargs
    return get_gpt_layer_local_spec(num_experts=kwargs["num_experts"], qk_layernorm=kwargs["qk_layernorm"])


def hf_config(tmp_path, **changes):
    return model_module.load_hf_config(make_tiny_hf_checkpoint(tmp_path, **changes))


def test_te_spec_keeps_te_attention_and_norm(tmp_path, monkeypatch):
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import megatron.core.transformer.transformer_block as block

    monkeypatch.setattr(te_ext, "TEDotProductAttention", StandInTEAttention)
    monkeypatch.setattr(te_ext, "TENorm", StandInTENorm)
    monkeypatch.setattr(specs, "get_gpt_layer_with_transformer_engine_spec", te_spec_stand_in)
    monkeypatch.setattr(block, "get_num_layers_to_build", lambda config: config.num_layers)
    te_core_attention.cache_clear()
    try:
        config = hf_config(tmp_path, arch="qwen3")
        tf_config = type("Config", (), {"num_layers": 3})()
        spec = block_spec(config, tf_config, ModelKernels(transformer_engine=True, fused_wgrad=False))
        attention_class = spec.layer_specs[0].submodules.self_attention.submodules.core_attention
        assert issubclass(attention_class, StandInTEAttention) and len(spec.layer_specs) == 3
        assert spec.layer_norm is StandInTENorm
        assert te_spec_stand_in.kwargs == {
            "num_experts": None,
            "moe_grouped_gemm": False,
            "qk_layernorm": True,
        }

        pad = torch.tensor([[0, 1, 1]])
        attention_class().forward(None, None, None, build_attention_mask(pad), AttnMaskType.causal)
        mask, kind, _ = StandInTEAttention.calls[-1]
        assert kind == AttnMaskType.arbitrary and mask.shape == (1, 1, 3, 3)
    finally:
        te_core_attention.cache_clear()


def test_local_spec_uses_sdpa_and_torch_norm(tmp_path, monkeypatch):
    import megatron.core.transformer.transformer_block as block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    monkeypatch.setattr(block, "get_num_layers_to_build", lambda config: config.num_layers)
    config = hf_config(tmp_path, arch="qwen3_moe")
    tf_config = type("Config", (), {"num_layers": 2})()
    spec = block_spec(config, tf_config, ModelKernels(transformer_engine=False, fused_wgrad=False))
    assert spec.layer_norm is WrappedTorchNorm
    assert spec.layer_specs[0].submodules.self_attention.submodules.core_attention is SDPACoreAttention


def test_rmsnorm_models_build_where_apex_imports(tmp_path):
    dense = make_tiny_hf_checkpoint(tmp_path / "qwen2")
    moe = make_tiny_hf_checkpoint(tmp_path / "moe", arch="qwen3_moe")
    vlm = make_tiny_vlm(tmp_path / "llava")
    assert "KERNELS OK" in run_distributed("_kernels_worker.py", 1, dense, moe, vlm, timeout=600)


TE_CORE_ONLY_INIT = """
import os
try:
    from . import pytorch
except ImportError:
    pass
except FileNotFoundError as e:  # transformer_engine 2.20.2 __init__.py 84-108, without NVTE_FRAMEWORK
    if "Could not find shared object file" not in str(e) or os.getenv("NVTE_FRAMEWORK"):
        raise
"""


def test_transformer_engine_core_without_its_torch_extension_picks_the_local_spec(tmp_path, monkeypatch):
    """The TE core library installed, its torch extension not (a stand-in package shaped like TE
    2.20.2: `import transformer_engine` works, `transformer_engine.pytorch` does not): on a CUDA
    machine the model must not choose the TE spec (TENorm would fail to import in the build)."""
    import sys

    from engines.megatron import cpu_compat

    package = tmp_path / "site" / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text(TE_CORE_ONLY_INIT)
    (package / "pytorch" / "__init__.py").write_text(
        "raise FileNotFoundError('Could not find shared object file for transformer_engine_torch')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    try:
        __import__("transformer_engine")  # the core imports, as it does on such a machine
        assert model_module.machine_kernels() == ModelKernels(transformer_engine=False, fused_wgrad=False)
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
            del sys.modules[name]
