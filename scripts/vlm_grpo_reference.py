"""GRPO on the shapes task in plain transformers and torch, none of hybridflow's trainer, workers or
engines: an independent reference for what 20 GRPO steps from a VLM warm start can gain, to tell
the task's dynamics from the trainer's (docs/vlm.md, "Learning on the shapes task").

    python scripts/vlm_grpo_reference.py --model outputs/vlm_quickstart/sft/hf \\
        --data outputs/vlm_quickstart/data --lr 2e-4 --prompts 32 --samples 8

One process, 2 threads: each step samples `--samples` responses to `--prompts` training prompts
(top-k / top-p off), scores "#### <n>" against the answer, takes group-normalised advantages
(GRPO, Shao et al. 2024, arXiv:2402.03300: (r - mean) / (std + 1e-6) per prompt) and one Adam step
on the token-mean policy-gradient loss (on-policy: the ratio is 1), the vision tower frozen, the
gradient norm clipped to 1; greedy held-out accuracy every 5 steps.
"""

import argparse
import random
import re

import pyarrow.parquet as pq
import torch

from hybridflow.data.image_prompts import decode_images, image_prompt_inputs

ANSWER = re.compile(r"#### *(\d+)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", required=True, help="a LLaVA export (the warm start)")
    parser.add_argument("--data", required=True, help="directory with train.parquet and test.parquet")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="responses per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def encode(processor, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(input ids (B, P), pixel values (B, 3, H, W), answers) of rows whose prompts all have one length."""
    ids, pixels = [], []
    for row in rows:
        row_ids, row_pixels = image_prompt_inputs(
            processor, row["prompt"], decode_images(row["images"], "row"), "row"
        )
        ids.append(row_ids)
        pixels.append(torch.as_tensor(row_pixels))
    if len({len(row_ids) for row_ids in ids}) != 1:
        raise ValueError("the prompts differ in length; this reference batches them without padding")
    return torch.tensor(ids), torch.cat(pixels), [row["reward_model"]["ground_truth"] for row in rows]


def rewards(tokenizer, sequences: torch.Tensor, prompt_length: int, answers: list[str]) -> torch.Tensor:
    texts = tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=True)
    found = [match.group(1) if (match := ANSWER.search(text)) else None for text in texts]
    return torch.tensor([float(given == answer) for given, answer in zip(found, answers, strict=True)])


def group_advantages(reward: torch.Tensor, samples: int) -> torch.Tensor:
    groups = reward.view(-1, samples)  # (prompts, samples)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1)


def response_mask(responses: torch.Tensor, eos_ids: list[int], image_id: int) -> torch.Tensor:
    """(B, R) 1 up to and including the first EOS; 0 for a row that sampled the image placeholder
    (LLaVA would read it as an image slot; rare, left out)."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids))
    live = (is_eos.cumsum(1) - is_eos.long()) == 0
    mask = live.float()
    mask[((responses == image_id) & live).any(1)] = 0
    return mask


def policy_loss(model, sequences, pixels, prompt_length, advantages, mask, temperature) -> torch.Tensor:
    responses = sequences[:, prompt_length:]  # (B, R)
    fed = sequences.clone()
    # LLaVA fills every placeholder with image features; a sampled one (its row left out by the
    # mask) is fed as another token so that the feature count matches the images
    fed[:, prompt_length:][responses == model.config.image_token_id] = 0
    logits = model(input_ids=fed, attention_mask=torch.ones_like(fed), pixel_values=pixels).logits
    log_probs = torch.log_softmax(logits[:, prompt_length - 1 : -1].float() / temperature, -1)  # (B, R, V)
    taken = log_probs.gather(-1, responses[..., None]).squeeze(-1)  # (B, R)
    return -(advantages[:, None] * taken * mask).sum() / mask.sum()


def accuracy(model, tokenizer, test: tuple) -> float:
    ids, pixels, answers = test
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                             max_new_tokens=24, do_sample=False)  # fmt: skip
    return float(rewards(tokenizer, out, ids.shape[1], answers).mean())


def grpo_step(model, processor, optimizer, rows: list[dict], args) -> str:
    ids, pixels, answers = encode(processor, rows)
    ids, pixels = ids.repeat_interleave(args.samples, 0), pixels.repeat_interleave(args.samples, 0)
    answers = [answer for answer in answers for _ in range(args.samples)]
    model.eval()
    with torch.no_grad():
        sequences = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                                   max_new_tokens=24, do_sample=True, temperature=args.temperature, top_k=0,
                                   top_p=1.0)  # fmt: skip
    reward = rewards(processor.tokenizer, sequences, ids.shape[1], answers)
    eos = model.generation_config.eos_token_id
    mask = response_mask(
        sequences[:, ids.shape[1] :], eos if isinstance(eos, list) else [eos], model.config.image_token_id
    )
    model.train()
    loss = policy_loss(
        model, sequences, pixels, ids.shape[1], group_advantages(reward, args.samples), mask, args.temperature
    )
    optimizer.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], 1.0)
    optimizer.step()
    return f"reward {reward.mean():.3f} grad_norm {norm:.3f}"


def main() -> None:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    args = parse_args()
    torch.manual_seed(args.seed)
    sampler = random.Random(args.seed)
    processor = AutoProcessor.from_pretrained(args.model)
    model = LlavaForConditionalGeneration.from_pretrained(args.model).float()
    for name, parameter in model.named_parameters():
        parameter.requires_grad = "vision_tower" not in name
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    train = pq.read_table(f"{args.data}/train.parquet").to_pylist()
    test = encode(processor, pq.read_table(f"{args.data}/test.parquet").to_pylist())
    print(f"step 0 held-out accuracy {accuracy(model, processor.tokenizer, test):.3f}", flush=True)
    for step in range(1, args.steps + 1):
        line = f"step {step} " + grpo_step(
            model, processor, optimizer, sampler.sample(train, args.prompts), args
        )
        if step % 5 == 0:
            line += f" held-out accuracy {accuracy(model, processor.tokenizer, test):.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
