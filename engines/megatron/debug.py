"""Drive the Megatron engine on one Hugging Face checkpoint from a plain torchrun command.

    torchrun --nproc_per_node 4 -m engines.megatron.debug --hf /path/to/model --tp 2 --pp 2 \\
        [--compare-hf] [--export /tmp/out]

Builds the model for the layout, runs `compute_log_prob` on a random left/right-padded batch and
prints timings and log-prob statistics from the last pipeline stage. `--compare-hf` also runs
transformers on the same batch (on every last-stage rank) and prints the largest log-prob
difference; `--export` writes the model back as a HF directory with `save_hf_checkpoint`.
"""

import argparse
import time

import torch
import torch.distributed as dist

from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.forward import compute_log_prob
from engines.megatron.model import load_hf_config
from engines.megatron.parallel import init_megatron
from engines.megatron.weights import save_hf_checkpoint
from hybridflow.protocol import DataProto


def random_padded_batch(args, vocab_size: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts of random length, right-padded responses of random length."""
    gen = torch.Generator().manual_seed(args.seed)
    total = args.prompt_len + args.response_len
    input_ids = torch.zeros(args.batch, total, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i in range(args.batch):
        p = int(torch.randint(1, args.prompt_len + 1, (1,), generator=gen))
        r = int(torch.randint(1, args.response_len + 1, (1,), generator=gen))
        real = slice(args.prompt_len - p, args.prompt_len + r)
        input_ids[i, real] = torch.randint(0, vocab_size, (p + r,), generator=gen)
        mask[i, real] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, args.prompt_len :],
        "response_mask": mask[:, args.prompt_len :],
    }


def hf_log_probs(hf_dir, batch, response_len: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    logp = torch.log_softmax(logits[:, -response_len - 1 : -1].float(), dim=-1)  # (B, R, V)
    return logp.gather(-1, batch["responses"][..., None]).squeeze(-1)  # (B, R)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hf", required=True, help="Hugging Face model directory")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-hf", action="store_true")
    parser.add_argument("--export", default=None, help="write the model back as a HF directory here")
    args = parser.parse_args()

    cfg = MegatronConfig(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, params_dtype=args.dtype
    )
    hf_config = load_hf_config(args.hf)
    ranks = init_megatron(cfg, hf_config)
    start = time.perf_counter()
    chunks = build_model(args.hf, cfg, for_training=False)
    built = time.perf_counter()
    batch = random_padded_batch(args, hf_config.vocab_size)
    out = compute_log_prob(chunks, DataProto.from_dict(tensors=batch), args.micro_batch_size)
    done = time.perf_counter()
    tag = f"[rank {dist.get_rank()} {ranks}]"
    print(f"{tag} build {built - start:.2f}s, compute_log_prob {done - built:.2f}s", flush=True)
    if out is not None:
        mask = batch["response_mask"].bool()
        logp, entropy = out.batch["old_log_probs"], out.batch["entropys"]
        print(f"{tag} mean log-prob {logp[mask].mean():.4f}, mean entropy {entropy[mask].mean():.4f}")
        if args.compare_hf:
            diff = (logp - hf_log_probs(args.hf, batch, args.response_len))[mask].abs().max()
            print(f"{tag} max |log-prob - transformers| = {diff:.3e}", flush=True)
    if args.export:
        save_hf_checkpoint(chunks, hf_config, args.export)
        if dist.get_rank() == 0:
            print(f"{tag} exported to {args.export}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
