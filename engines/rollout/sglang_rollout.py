"""The `sglang` rollout engine: SGLang's offline engine (`sglang.Engine`) held in a worker process.

CUDA only; written against sglang 0.5.23 (the version `requirements-gpu.txt` pins). One engine
serves a rollout group of `rollout.tensor_model_parallel_size` ranks: the group's first rank builds
it, with CUDA_VISIBLE_DEVICES set to the group's GPUs (`engines.placement.engine_devices`), so
that SGLang's scheduler i runs on the GPU of group member i.

SGLang calls used, as 0.5.23 defines them (`entrypoints/engine.py`,
`managers/scheduler_components/weight_updater.py`):
  - `generate(input_ids=, sampling_params=, return_logprob=)`;
  - `release_memory_occupation(tags)` / `resume_memory_occupation(tags)` with tags "weights",
    "kv_cache", "cuda_graph" (needs `enable_memory_saver=True`). The scheduler keeps a set of
    released tags and resuming a tag that is not released raises in the scheduler (which then
    dies), so the sharding manager tracks the state and never does it;
  - `begin_weight_update()` / `end_weight_update()` around the updates, each returning
    `(success, message)`; `update_weights_from_tensor(named_tensors, flush_cache=False)` returns
    `(success, message)` and refuses (success False, no exception) outside a session;
  - `flush_cache()` returns an object with `success`;
  - weights arrive as CUDA-IPC handles, one per TP rank (`LocalSerializedTensor(values=[...])`),
    each made by SGLang's `MultiprocessingSerializer` in the process that holds the tensor on
    the GPU of the scheduler that loads it, after `monkey_patch_torch_reductions()` (handles then
    name the GPU by UUID, not by an index that means another GPU in the receiving process).

Sampling: SGLang reads per-request `sampling_seed` only with `enable_deterministic_inference`
(sglang `sampling/sampling_batch_info.py`), and refuses one outside int64
(`sampling/sampling_params.py` 302-312). With `rollout.enable_deterministic_inference: true`
each row's seed (`row_seed`) is sent and a resumed run samples as the uninterrupted one would (at
the cost of SGLang's batch-invariant kernels, slower generation); otherwise sampling is not
reproducible and the engine says so once in the log.

Outputs: `output_ids` run through the stop condition, so a response that stopped on EOS ends
with it, and `output_token_logprobs` has one entry per output id (`managers/schedule_batch.py`
1509-1513, `managers/scheduler_components/output_streamer.py` 489-491 and 612-640).

What building the engine does to this process, and what is undone: SGLang's `configure_logger`
calls `logging.basicConfig(..., force=True)` (level "error" unless `log_level` is given), which
would drop every warning of this worker from then on, and `_set_envs_and_config` writes
CUDA_DEVICE_MAX_CONNECTIONS=8 (and NCCL settings) into `os.environ` for the schedulers it spawns
(`entrypoints/engine.py` 294-296, 1152, 1878-1921). The engine is built with `log_level` at this
process's level (unless `rollout.sglang.log_level` says otherwise), and afterwards the root
logger's handlers and level and the variables of `engines.process_env.PROCESS_ENV_KEYS` are put
back as they were, so this rank's Megatron settings stay those of the other ranks.
"""

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from engines.placement import EngineDevices
from engines.process_env import PROCESS_ENV_KEYS
from engines.rollout.base import (
    SamplingPosition,
    SeededGenerationMixin,
    load_tokenizer,
    read_special_token_ids,
    row_seed,
)
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.weight_sync.common import WeightSyncError
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)


class SGLangRolloutEngine(SeededGenerationMixin):
    """Generation and in-place weight updates through SGLang's offline engine."""

    def __init__(self, model_path: str | Path, cfg: RolloutConfig, devices: EngineDevices):
        import sglang
        from transformers import AutoConfig

        model_path = Path(model_path)
        self.cfg = cfg
        self.eos_token_ids, self.pad_token_id = read_special_token_ids(
            model_path, AutoConfig.from_pretrained(model_path)
        )
        uses_stop = bool(cfg.sampling.stop or cfg.val_sampling.stop)
        self.tokenizer = load_tokenizer(model_path) if uses_stop else None
        if len(devices.visible_devices) != cfg.tensor_model_parallel_size:
            raise ValueError(
                f"an engine with rollout.tensor_model_parallel_size={cfg.tensor_model_parallel_size} "
                f"needs that many GPUs, got {list(devices.visible_devices)}"
            )
        # CUDA_VISIBLE_DEVICES is inherited by SGLang's schedulers; the rest is what SGLang changes
        # in this process (see the module docstring).
        with _cuda_visible_devices(devices.cuda_visible_devices), _process_logging_and_env_kept():
            self.engine = sglang.Engine(
                model_path=str(model_path),
                dtype=cfg.dtype,
                tp_size=cfg.tensor_model_parallel_size,
                mem_fraction_static=cfg.gpu_memory_utilization,
                load_format=cfg.load_format,
                base_gpu_id=devices.base_gpu_id,
                random_seed=cfg.seed,
                enable_memory_saver=True,  # release/resume_memory_occupation need it
                enable_deterministic_inference=cfg.enable_deterministic_inference,
                skip_tokenizer_init=not uses_stop,  # stop strings are matched on text, so they need it
                **{"log_level": _process_log_level(), **cfg.sglang},  # the recipe's ServerArgs win
            )
        if not cfg.enable_deterministic_inference:
            logger.warning(
                "SGLang sampling is not reproducible (per-request seeds need "
                "rollout.enable_deterministic_inference: true); a resumed run samples differently"
            )
        self.position = SamplingPosition()

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts: DataProto, sampling: SamplingConfig, seed: int):
        """Generated ids (B, L) padded with the pad id, their log-probs (B, L) or None, and no top-K
        (rollout.top_k_log_probs is refused for sglang)."""
        input_ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        requests = [row[row_mask.bool()].tolist() for row, row_mask in zip(input_ids, mask, strict=True)]
        if not requests:
            return torch.zeros(0, 0, dtype=torch.long), None, None
        params = [self._sampling_params(sampling, row_seed(seed, row)) for row in range(len(requests))]
        outputs = self.engine.generate(
            input_ids=requests, sampling_params=params, return_logprob=self.cfg.calculate_log_probs
        )
        ids = [list(out["output_ids"]) for out in outputs]  # EOS included when a request stopped on it
        length = max(len(row) for row in ids)
        responses = torch.full((len(ids), length), self.pad_token_id, dtype=torch.long)  # (B, L)
        for row, row_ids in enumerate(ids):
            responses[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        log_probs = _output_log_probs(outputs, ids, length) if self.cfg.calculate_log_probs else None
        return responses, log_probs, None

    def _sampling_params(self, sampling: SamplingConfig, seed: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.cfg.max_new_tokens(sampling),
            "temperature": sampling.temperature if sampling.do_sample else 0.0,  # 0: SGLang's greedy
            "top_p": sampling.top_p if sampling.do_sample else 1.0,
            "top_k": sampling.top_k if sampling.do_sample else -1,
            "skip_special_tokens": False,
        }
        if self.cfg.enable_deterministic_inference:
            params["sampling_seed"] = seed
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        return params

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> None:
        _check_result("begin_weight_update", self.engine.begin_weight_update())

    def end_weight_update(self) -> None:
        _check_result("end_weight_update", self.engine.end_weight_update())

    def update_weights_from_rank_payloads(self, payloads: list[list[tuple[str, bytes]]]) -> None:
        """Load one bucket: `payloads[i]` is TP rank i's (name, serialized tensor) list, made by
        `serialize_bucket` in the process on that rank's GPU."""
        from sglang.srt.model_executor.model_runner_components.weight_updater import (
            LocalSerializedTensor,
        )

        names = [name for name, _ in payloads[0]]
        for rank, payload in enumerate(payloads):
            if [name for name, _ in payload] != names:
                raise WeightSyncError(f"TP rank {rank} sent other tensors than rank 0 in the same bucket")
        named = [
            (name, LocalSerializedTensor(values=[payload[i][1] for payload in payloads]))
            for i, name in enumerate(names)
        ]
        # One cache flush after the whole sync (flush_cache) rather than one per bucket.
        _check_result(
            "update_weights_from_tensor", self.engine.update_weights_from_tensor(named, flush_cache=False)
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors from this process alone (an engine of one GPU)."""
        self.update_weights_from_rank_payloads([serialize_bucket(named_tensors)])

    def flush_cache(self) -> None:
        result = self.engine.flush_cache()
        if not getattr(result, "success", True):
            raise WeightSyncError(f"SGLang flush_cache failed: {getattr(result, 'message', result)}")

    def weight_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        raise NotImplementedError(
            "SGLang exposes no exact read-back of its fused, TP-sharded parameters; "
            "rollout.verify_weight_sync is available with rollout.name=hf"
        )

    # ------------------------------------------------------------------ memory and RNG
    def release_memory(self, tags: list[str] | None = None) -> None:
        self.engine.release_memory_occupation(tags=tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.engine.resume_memory_occupation(tags=tags)

    def shutdown(self) -> None:
        self.engine.shutdown()


def serialize_bucket(bucket: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, bytes]]:
    """This process's tensors as SGLang IPC payloads; the tensors must stay alive until loaded."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # handles name the GPU by UUID (see the module docstring)
    return [(name, MultiprocessingSerializer.serialize(tensor.detach())) for name, tensor in bucket]


def _check_result(call: str, result) -> None:
    """Raise WeightSyncError with SGLang's message when a `(success, message)` call failed."""
    success, message = result
    if not success:
        raise WeightSyncError(f"SGLang {call} failed: {message}")


@contextmanager
def _cuda_visible_devices(value: str) -> Iterator[None]:
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


def _output_log_probs(outputs: list[dict], ids: list[list[int]], length: int) -> torch.Tensor:
    """(B, L) log-probs of the output ids, one SGLang entry per id (the EOS's included)."""
    log_probs = torch.zeros(len(ids), length)
    for row, out in enumerate(outputs):
        values = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        if len(values) != len(ids[row]):
            raise RuntimeError(
                f"SGLang returned {len(values)} log-probs for {len(ids[row])} output ids (row {row})"
            )
        log_probs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return log_probs


def _process_log_level() -> str:
    """This process's logging level as a ServerArgs `log_level` ("warning", "info", ...)."""
    return logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()


@contextmanager
def _process_logging_and_env_kept() -> Iterator[None]:
    """Put back the root logger's handlers and level, and the Megatron process settings, that
    building an SGLang engine replaces (see the module docstring)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    env = {key: os.environ.get(key) for key in PROCESS_ENV_KEYS}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
