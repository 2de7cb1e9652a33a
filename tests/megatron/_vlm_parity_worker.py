"""torchrun worker: Megatron-Core's LLaVAModel (engines/megatron/vlm.py) against transformers'
LlavaForConditionalGeneration on the same images and text, at the TP size of the launch.

    torchrun --nproc_per_node 2 tests/megatron/_vlm_parity_worker.py --hf-dir D --out-dir O

On every rank it checks:
  1. the logits on every position (text and image) equal transformers' within 1e-5 (fp32), and so
     do the log-probs of the next tokens;
  2. the check can fail: with the two images swapped the logits move by far more than 1e-5;
  3. the export (save_vlm_hf_checkpoint) holds the source checkpoint's tensors bit for bit, same
     names and dtypes, and transformers loads it (with its processor) to the same logits.
Prints "VLM PARITY OK tp=.. rank=.. logits_max_abs=.. logp_max_abs=.." when every check passed.
"""

import argparse
import os
from pathlib import Path

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from PIL import Image
from safetensors.torch import load_file

from engines.megatron.config import MegatronConfig
from engines.megatron.parallel import init_megatron
from engines.megatron.vlm import build_llava_model, collapse_image_tokens, load_vlm_config
from engines.megatron.vlm_weights import load_vlm_weights, save_vlm_hf_checkpoint

TOL = 1e-5
# Two prompts of equal length (no padding), the image at the start of one and mid-text in the other.
PROMPTS = ["<|user|><image>How many circles?<|assistant|>", "<|user|>How many<image> circles?<|assistant|>"]


def images() -> list[Image.Image]:
    """Two seeded random RGB images of different sizes (the processor resizes and crops both)."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 48), (32, 32))]


def processed(hf_dir: Path, pictures: list[Image.Image]) -> dict[str, torch.Tensor]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(hf_dir)
    return processor(
        text=PROMPTS, images=pictures, return_tensors="pt"
    )  # input_ids (B, T), pixel_values (B, 3, H, W)


def hf_logits(hf_dir: Path, inputs: dict) -> torch.Tensor:
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**inputs).logits  # (B, T, V)


def megatron_logits(model, inputs: dict, vlm) -> torch.Tensor:
    """On the CPU, where transformers' reference is (the model may be on the GPU)."""
    device = next(model.parameters()).device
    ids = collapse_image_tokens(inputs["input_ids"], vlm.image_token_id, vlm.image_feature_count)  # (B, T')
    positions = torch.arange(ids.shape[1]).expand_as(ids)  # (B, T')
    with torch.no_grad():
        logits, _ = model(
            images=inputs["pixel_values"].to(device),
            input_ids=ids.to(device),
            position_ids=positions.to(device),
            attention_mask=None,
        )  # (B, T, Vp / TP)
    return gather_from_tensor_model_parallel_region(logits)[..., : vlm.text.vocab_size].cpu()  # (B, T, V)


def next_token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, V)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)


def check_export(model, vlm, cfg: MegatronConfig, hf_dir: Path, out_dir: Path, ref: torch.Tensor) -> None:
    save_vlm_hf_checkpoint(model, vlm, cfg, out_dir)
    source, exported = load_file(hf_dir / "model.safetensors"), load_file(out_dir / "model.safetensors")
    assert sorted(source) == sorted(exported), sorted(set(source) ^ set(exported))
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert torch.equal(hf_logits(out_dir, processed(out_dir, images())), ref), "exported model's logits"


def run(hf_dir: Path, out_dir: Path) -> str:
    cfg = MegatronConfig(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"]))  # TP = every rank
    init_megatron(cfg)
    vlm = load_vlm_config(hf_dir)
    model = build_llava_model(vlm, cfg).eval()
    load_vlm_weights(model, hf_dir, vlm, cfg)
    inputs = processed(hf_dir, images())
    ref = hf_logits(hf_dir, inputs)
    logits = megatron_logits(model, inputs, vlm)
    torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)
    logp, ref_logp = (next_token_log_probs(x, inputs["input_ids"]) for x in (logits, ref))
    torch.testing.assert_close(logp, ref_logp, atol=TOL, rtol=0)
    swapped = megatron_logits(model, processed(hf_dir, images()[::-1]), vlm)
    assert (swapped - ref).abs().max() > 1e3 * TOL, "the images do not reach the logits"
    check_export(model, vlm, cfg, hf_dir, out_dir, ref)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return (
        f"VLM PARITY OK tp={cfg.tensor_model_parallel_size} rank={rank} "
        f"logits_max_abs={(logits - ref).abs().max():.3e} logp_max_abs={(logp - ref_logp).abs().max():.3e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    print(run(args.hf_dir, args.out_dir), flush=True)


if __name__ == "__main__":
    main()
