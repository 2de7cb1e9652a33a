"""torchrun worker: the distillation teacher's log-probs (hybridflow/workers/teacher.py, the role the
trainer runs) against transformers on the same tokens, fp32, at the layout given.

Run by test_teacher_parity.py; also a debugging entry point:
    torchrun --nproc_per_node 2 tests/megatron/_teacher_parity_worker.py --teacher DIR --tp 2
The teacher is a Llama-architecture checkpoint sharing the quickstart tokenizer (another model
than the Qwen2 student). Every rank builds the `TeacherWorker` as the worker group would (without
Ray), scores a left/right-padded batch through padded micro-batches and then through packed ones,
and compares `teacher_log_prob` with transformers' log_softmax(logits / T) at the response tokens.
Prints "TEACHER PARITY OK <padded|packed> tp=.. rank=.." per passed check.
"""

import argparse

import torch
import torch.distributed as dist
from tiny_hf import padded_batch

from engines.megatron.config import MegatronConfig
from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.workers.teacher import TeacherWorker

PROMPT_LEN, RESPONSE_LEN, VOCAB = 6, 5, 263
TEMPERATURE = 0.7


def recipe(teacher_dir: str, tp: int) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.teacher.path = teacher_dir
    cfg.teacher.megatron = MegatronConfig(tensor_model_parallel_size=tp)
    cfg.teacher.log_prob_micro_batch_size = 2
    cfg.teacher.log_prob_max_token_len_per_gpu = 2 * (PROMPT_LEN + RESPONSE_LEN)
    cfg.rollout.sampling.temperature = TEMPERATURE
    return cfg


def transformers_log_probs(teacher_dir: str, batch: dict) -> torch.Tensor:
    """log p(response token) at TEMPERATURE from transformers' logits, (B, R)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits  # (B, P+R, V)
    logp = torch.log_softmax(logits[:, PROMPT_LEN - 1 : -1] / TEMPERATURE, dim=-1)  # (B, R, V)
    return logp.gather(-1, batch["responses"][..., None]).squeeze(-1)  # (B, R)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--tp", type=int, required=True)
    args = parser.parse_args()
    cfg = recipe(args.teacher, args.tp)
    worker = TeacherWorker(cfg)
    worker.init_model()
    batch = padded_batch([3, 6, 2, 5], [5, 2, 4, 1], PROMPT_LEN, RESPONSE_LEN, VOCAB, seed=3)
    expected = transformers_log_probs(args.teacher, batch)
    mask = batch["response_mask"].bool()
    for packed in (False, True):
        cfg.actor.update.use_dynamic_bsz = packed
        out = worker.compute_teacher_log_prob(DataProto.from_dict(dict(batch)))
        actual = out.batch["teacher_log_prob"].cpu()
        torch.testing.assert_close(actual[mask], expected[mask], atol=1e-5, rtol=1e-5)
        mode = "packed" if packed else "padded"
        print(f"TEACHER PARITY OK {mode} tp={args.tp} rank={dist.get_rank()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
