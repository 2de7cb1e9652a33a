"""torchrun worker: Megatron-Core's LLaVAModel (engines/megatron/vlm.py) against transformers'
LlavaForConditionalGeneration on the same images and text, at the TP size of the launch.

    torchrun --nproc_per_node 2 tests/megatron/_vlm_parity_worker.py --hf-dir D --out-dir O

On every rank it checks:
  1. the logits on every position (text and image) equal transformers' within 1e-5 (fp32), and so
     do the log-probs of the next tokens;
  2. the check can fail: with the two images swapped the logits move by far more than 1e-5;
  3. the export (save_vlm_hf_checkpoint) holds the source checkpoint's tensors bit for bit, same
     names and dtypes, and transformers loads it (with its processor) to the same logits;
  4. the actor's path (forward.compute_log_prob, micro-batches of 2) on a batch as the trainer
     holds it: left-padded image prompts with 1, 0, 2 and 1 images, right-padded responses (one
     holding a sampled image placeholder), the pixels in `non_tensor_batch`: response log-probs
     within 1e-5 of transformers decoding each row alone (no padding), as generate does;
  5. the gradients of the summed response log-probs through Megatron's schedule equal
     transformers' for the projector's first layer and the word embeddings (this rank's shard),
     within 5e-5.
Prints "VLM PARITY OK tp=.. rank=.. logits_max_abs=.. logp_max_abs=.." when every check passed.
"""

import argparse
import os
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from PIL import Image
from safetensors.torch import load_file

from engines.megatron import forward
from engines.megatron.config import MegatronConfig
from engines.megatron.parallel import init_megatron
from engines.megatron.vlm import IMAGE_SLOT, build_llava_model, collapse_image_tokens, mark_image_slots
from engines.megatron.vlm_config import load_vlm_config
from engines.megatron.vlm_weights import load_vlm_weights, save_vlm_hf_checkpoint
from hybridflow.data.image_prompts import image_prompt_inputs
from hybridflow.protocol import PIXEL_VALUES_KEY, DataProto

TOL = 1e-5
# Gradients sum over every token of the batch: TP2's summation order alone moved one by 1.2e-5.
GRAD_TOL = 5e-5
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
    slots = mark_image_slots(inputs["input_ids"], vlm.image_token_id, inputs["input_ids"].shape[1])  # (B, T)
    ids = collapse_image_tokens(slots, IMAGE_SLOT, vlm.image_feature_count)  # (B, T')
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


# (prompt text, indices into images()), and the response tokens drawn for each row
BATCH_ROWS = [
    ("<image>How many?", [0]),
    ("No image here", []),
    ("<image>or<image>?", [1, 0]),
    ("Count<image>", [1]),
]
RESPONSE_LENGTHS = [5, 3, 6, 2]


def batch_rows(hf_dir: Path) -> list[tuple[list[int], np.ndarray, list[int]]]:
    """(prompt ids, pixels (n, 3, H, W), response ids) per row, prompts through the chat template."""
    from transformers import AutoProcessor

    processor, pictures = AutoProcessor.from_pretrained(hf_dir), images()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for (text, which), length in zip(BATCH_ROWS, RESPONSE_LENGTHS, strict=True):
        messages = [{"role": "user", "content": text}]
        ids, pixels = image_prompt_inputs(processor, messages, [pictures[i] for i in which], text)
        response = torch.randint(3, 200, (length,), generator=generator).tolist()  # bytes
        rows.append((ids, pixels, response))
    # a sampled image placeholder is a token of the response, not an image (as generate treats it)
    rows[0][2][2] = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return rows


def padded_batch(rows, pad_id: int) -> DataProto:
    """As the trainer holds a batch: left-padded prompts (B, P), right-padded responses (B, R)."""
    prompt_len, response_len = max(len(r[0]) for r in rows), max(len(r[2]) for r in rows)
    ids = torch.full((len(rows), prompt_len + response_len), pad_id)  # (B, P + R)
    mask = torch.zeros_like(ids)
    for i, (prompt, _, response) in enumerate(rows):
        start = prompt_len - len(prompt)
        ids[i, start : prompt_len + len(response)] = torch.tensor(prompt + response)
        mask[i, start : prompt_len + len(response)] = 1
    pixels = np.empty(len(rows), dtype=object)
    pixels[:] = [r[1] for r in rows]
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    tensors["responses"], tensors["response_mask"] = ids[:, prompt_len:], mask[:, prompt_len:]
    return DataProto.from_dict(tensors=tensors, non_tensors={PIXEL_VALUES_KEY: pixels})


def hf_response_log_probs(hf_model, prompt, pixels, response) -> torch.Tensor:
    """(R,) transformers' log-probs of `response` after `prompt`, the row alone (no padding), decoded
    as generate does: the prompt with its pixels, then one response token at a time from the cache
    (a full forward would take a sampled image placeholder for an image)."""
    extra = {"pixel_values": torch.as_tensor(pixels)} if len(pixels) else {}
    out = hf_model(input_ids=torch.tensor([prompt]), use_cache=True, **extra)
    logits = [out.logits[0, -1]]  # R of (V,)
    for token in response[:-1]:
        out = hf_model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0, -1])
    log_probs = torch.log_softmax(torch.stack(logits), -1)  # (R, V)
    return log_probs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def check_padded_log_probs(model, hf_dir: Path, rows, data: DataProto) -> float:
    from transformers import LlavaForConditionalGeneration

    hf_model = LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = forward.compute_log_prob([model], data, micro_batch_size=2, calculate_entropy=False)
    worst = 0.0
    for i, (prompt, pixels, response) in enumerate(rows):
        with torch.no_grad():
            ref = hf_response_log_probs(hf_model, prompt, pixels, response)
        got = out.batch["old_log_probs"][i, : len(response)]
        torch.testing.assert_close(got, ref, atol=TOL, rtol=0, msg=lambda m, i=i: f"row {i}: {m}")
        worst = max(worst, (got - ref).abs().max().item())
    return worst


def summed_log_prob_loss(vocab_size, logits, micro_batch):
    log_probs, _ = forward.response_log_probs(logits, micro_batch, 1.0, vocab_size, "none")  # (b, R)
    mask = micro_batch["attention_mask"][:, -micro_batch["responses"].shape[1] :]  # (b, R)
    loss = (log_probs * mask).sum()
    return loss, {}


def cfg_tp_and_rank() -> tuple[int, int]:
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def check_gradients(model, hf_dir: Path, rows, data: DataProto, vocab_size: int) -> None:
    """Megatron's schedule divides each micro-batch's loss by the number of micro-batches (2)."""
    from transformers import LlavaForConditionalGeneration

    hf_model = LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
    sum(hf_response_log_probs(hf_model, p, px, r).sum() for p, px, r in rows).backward()
    model.zero_grad()
    forward.run_micro_batches([model], data, 2, partial(summed_log_prob_loss, vocab_size), forward_only=False)
    tp, rank = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    mine = dict(model.named_parameters())
    hf = dict(hf_model.named_parameters())
    pairs = {
        "vision_projection.encoder.linear_fc1.weight": "model.multi_modal_projector.linear_1.weight",
        "language_model.embedding.word_embeddings.weight": "model.language_model.embed_tokens.weight",
    }
    for name, hf_name in pairs.items():
        assert hf[hf_name].grad.abs().max() > 1e-3, f"{hf_name}: no gradient to compare"
        shard = mine[name].grad.cpu()
        padded = F.pad(hf[hf_name].grad / 2, (0, 0, 0, shard.shape[0] * tp - hf[hf_name].shape[0]))
        torch.testing.assert_close(
            shard, padded.chunk(tp)[rank], atol=GRAD_TOL, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


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
    rows = batch_rows(hf_dir)
    data = padded_batch(rows, pad_id=0)
    padded_logp = check_padded_log_probs(model, hf_dir, rows, data)
    check_gradients(model, hf_dir, rows, data, vlm.text.vocab_size)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return (
        f"VLM PARITY OK tp={cfg.tensor_model_parallel_size} rank={rank} "
        f"logits_max_abs={(logits - ref).abs().max():.3e} logp_max_abs={(logp - ref_logp).abs().max():.3e} "
        f"padded_batch_logp_max_abs={padded_logp:.3e}"
    )


def parse_dirs() -> argparse.Namespace:
    """--hf-dir (the tiny VLM) and --out-dir (where exports go), as both VLM workers take them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_dirs()
    print(run(args.hf_dir, args.out_dir), flush=True)


if __name__ == "__main__":
    main()
