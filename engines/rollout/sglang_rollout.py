"""The `sglang` rollout engine: SGLang's offline engine (`sglang.Engine`) held in a worker process.

CUDA only. One engine serves a rollout group of `rollout.tensor_model_parallel_size` ranks: the
group's first rank builds it, and SGLang starts one scheduler process per GPU, on GPUs
`base_gpu_id .. base_gpu_id + tp - 1`, which that process must be able to see. The other ranks
of the group hold no engine (the sharding manager moves their prompts and outputs).

SGLang calls used, as its `Engine` documents them: `generate(input_ids=, sampling_params=,
return_logprob=)`, `update_weights_from_tensor(named_tensors, flush_cache=)`, `flush_cache()`,
`release_memory_occupation()` / `resume_memory_occupation()` (needs `enable_memory_saver=True`),
`shutdown()`. Sampling is seeded per request with `sampling_seed` (call seed, row index).
"""

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from engines.rollout.base import (
    SeededGenerationMixin,
    check_rollout_available,
    load_tokenizer,
    read_special_token_ids,
)
from engines.rollout.config import RolloutConfig, SamplingConfig
from hybridflow.protocol import DataProto

# Distinct per-row seeds from one call seed: seed * stride + row never collides for rows < stride.
_ROW_SEED_STRIDE = 1 << 20


class SGLangRolloutEngine(SeededGenerationMixin):
    """Generation and in-place weight updates through SGLang's offline engine."""

    def __init__(self, model_path: str | Path, cfg: RolloutConfig, base_gpu_id: int | None = None):
        check_rollout_available("sglang")
        import sglang
        from transformers import AutoConfig

        model_path = Path(model_path)
        self.cfg = cfg
        self.eos_token_ids, self.pad_token_id = read_special_token_ids(
            model_path, AutoConfig.from_pretrained(model_path)
        )
        uses_stop = bool(cfg.sampling.stop or cfg.val_sampling.stop)
        self.tokenizer = load_tokenizer(model_path) if uses_stop else None
        self.engine = sglang.Engine(
            model_path=str(model_path),
            dtype=cfg.dtype,
            tp_size=cfg.tensor_model_parallel_size,
            mem_fraction_static=cfg.gpu_memory_utilization,
            load_format=cfg.load_format,
            base_gpu_id=torch.cuda.current_device() if base_gpu_id is None else base_gpu_id,
            random_seed=cfg.seed,
            enable_memory_saver=True,  # release/resume_memory_occupation need it
            skip_tokenizer_init=not uses_stop,  # stop strings are matched on text, so they need it
            **cfg.sglang,  # the recipe's other ServerArgs fields
        )
        self._calls = 0

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts: DataProto, sampling: SamplingConfig, seed: int):
        """Generated ids (B, L) padded with the pad id, and their log-probs (B, L) or None."""
        input_ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        requests = [row[row_mask.bool()].tolist() for row, row_mask in zip(input_ids, mask, strict=True)]
        if not requests:
            return torch.zeros(0, 0, dtype=torch.long), None
        params = [
            self._sampling_params(sampling, seed * _ROW_SEED_STRIDE + row) for row in range(len(requests))
        ]
        outputs = self.engine.generate(
            input_ids=requests, sampling_params=params, return_logprob=self.cfg.calculate_log_probs
        )
        ids = [_output_ids_with_eos(out) for out in outputs]
        length = max(len(row) for row in ids)
        responses = torch.full((len(ids), length), self.pad_token_id, dtype=torch.long)
        for row, row_ids in enumerate(ids):
            responses[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        log_probs = None
        if self.cfg.calculate_log_probs:
            log_probs = torch.zeros(len(ids), length)
            for row, out in enumerate(outputs):
                values = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
                log_probs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return responses, log_probs

    def _sampling_params(self, sampling: SamplingConfig, seed: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.cfg.max_new_tokens(sampling),
            "temperature": sampling.temperature if sampling.do_sample else 0.0,  # 0: SGLang's greedy
            "top_p": sampling.top_p if sampling.do_sample else 1.0,
            "top_k": sampling.top_k if sampling.do_sample else -1,
            "sampling_seed": seed,
            "skip_special_tokens": False,
        }
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        return params

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # One cache flush after the whole sync (flush_cache) rather than one per bucket.
        self.engine.update_weights_from_tensor(list(named_tensors), flush_cache=False)

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def weight_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        raise NotImplementedError(
            "SGLang exposes no exact read-back of its fused, TP-sharded parameters; "
            "rollout.verify_weight_sync is available with rollout.name=hf"
        )

    # ------------------------------------------------------------------ memory and RNG
    def release_memory(self) -> None:
        self.engine.release_memory_occupation()

    def resume_memory(self) -> None:
        self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _output_ids_with_eos(output: dict) -> list[int]:
    """A request's generated ids, ending with the EOS id when it stopped on one."""
    ids = list(output["output_ids"])
    finish = output["meta_info"].get("finish_reason") or {}
    matched = finish.get("matched") if finish.get("type") == "stop" else None
    if isinstance(matched, int) and (not ids or ids[-1] != matched):
        ids.append(matched)
    return ids
