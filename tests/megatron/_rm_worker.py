"""torchrun worker: the reward-model role at pipeline parallel 2 against transformers.

Builds `RewardModelWorker` (no Ray: torchrun sets the SPMD env the worker group would), scores a
left-padded-prompt / right-padded-response batch, exports the value model, and on the last stage
compares `rm_scores` with transformers' `*ForSequenceClassification` on the export, which pools
the score head at each row's last non-pad token. Other stages must return None (they are not
collected). Prints "RM OK rank=<r>" when every check passed.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from tiny_hf import padded_batch

from engines.megatron.model import load_hf_config
from engines.megatron.weights import save_hf_checkpoint
from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.workers.reward_model import RewardModelWorker

PAD_ID = 0  # padded_batch's pad token; real tokens are drawn from [3, vocab)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, required=True)
    parser.add_argument("--export-dir", type=Path, required=True)
    args = parser.parse_args()

    cfg = RecipeConfig()
    cfg.reward_model.enable = True
    cfg.reward_model.path = str(args.hf_dir)
    cfg.reward_model.megatron.pipeline_model_parallel_size = 2
    cfg.reward_model.micro_batch_size = 2
    worker = RewardModelWorker(cfg)
    worker.init_model()

    hf_config = load_hf_config(args.hf_dir)
    response_lengths = [4, 1, 6, 6]
    batch = padded_batch([3, 5, 2, 4], response_lengths, 5, 6, hf_config.vocab_size, seed=1)
    out = worker.compute_rm_score(DataProto.from_dict(tensors=dict(batch)))
    save_hf_checkpoint(worker.chunks, hf_config, args.export_dir)  # collective: every rank calls it

    if parallel_state.is_pipeline_last_stage():
        from transformers import AutoModelForSequenceClassification

        reference = AutoModelForSequenceClassification.from_pretrained(
            args.export_dir, dtype=torch.float32, pad_token_id=PAD_ID
        )
        with torch.no_grad():
            logits = reference(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).logits  # (B, 1)
        expected = torch.zeros(batch["response_mask"].shape)  # (B, R)
        for row, length in enumerate(response_lengths):
            expected[row, length - 1] = logits[row, 0]
        torch.testing.assert_close(out.batch["rm_scores"], expected, atol=1e-5, rtol=1e-5)
    else:
        assert out is None, "a non-last pipeline stage must return None (it is not collected)"
    dist.barrier()
    print(f"RM OK rank={dist.get_rank()}", flush=True)


if __name__ == "__main__":
    main()
