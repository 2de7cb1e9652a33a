"""The `hf` rollout engine: a transformers causal LM generating with `model.generate` (KV cache,
left-padded batches) on CPU or one CUDA device. The default where CUDA is absent.

Weights are either read from the model directory (`load_format: auto`) or randomly initialised
(`dummy`) and then overwritten in place by `update_weights`, which the sharding manager feeds with
the actor's tensors. Each call seeds sampling deterministically (see `engines.rollout.base`).

Weight names are the checkpoint's (what `save_pretrained` writes and SGLang loads). They equal
the module's parameter names except for mixture-of-experts models, whose experts transformers 5
fuses in memory (`mlp.experts.gate_up_proj` (E, 2f, h), `mlp.experts.down_proj` (E, h, f)) but
saves one tensor per expert: `checkpoint_tensors` maps those names to views of the fused ones.
"""

from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from engines.rollout.base import (
    WEIGHTS_TAG,
    SamplingPosition,
    SeededGenerationMixin,
    TopK,
    load_tokenizer,
    read_special_token_ids,
)
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.hf_routes import ROUTES_KEY, RouteRecorder
from engines.rollout.images import image_rows, is_vision_language
from engines.weight_sync.common import check_named_shapes, tensor_checksum, torch_dtype
from hybridflow.algorithms.sampling import Truncation, truncated_log_softmax
from hybridflow.protocol import PIXEL_VALUES_KEY, DataProto

# model_type -> (router name, one expert's tensor name, its (gate, up, down) names) in checkpoints.
CHECKPOINT_MOE_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.{w}.weight", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": (
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{e}.{w}.weight",
        ("w1", "w3", "w2"),
    ),
}


def _checkpoint_names(name: str, param: torch.Tensor, model_type: str) -> dict[str, torch.Tensor]:
    """`param` under its checkpoint name(s): fused expert tensors split into per-expert views."""
    if model_type not in CHECKPOINT_MOE_NAMES:
        return {name: param}
    router, expert, (gate, up, down) = CHECKPOINT_MOE_NAMES[model_type]
    data = param.detach()  # views share the parameter's storage: copying into them loads it
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix, width = name.removesuffix("mlp.experts.gate_up_proj"), data.shape[1] // 2
        views = {}
        for e in range(data.shape[0]):
            views[prefix + expert.format(e=e, w=gate)] = data[e, :width]  # (f, h)
            views[prefix + expert.format(e=e, w=up)] = data[e, width:]  # (f, h)
        return views
    if name.endswith("mlp.experts.down_proj"):
        prefix = name.removesuffix("mlp.experts.down_proj")
        return {prefix + expert.format(e=e, w=down): data[e] for e in range(data.shape[0])}  # (h, f)
    if name.endswith("mlp.gate.weight"):
        return {name.removesuffix("mlp.gate.weight") + router: param}
    return {name: param}


def checkpoint_tensors(model, remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    """The model's parameters (or views of them) under the names its checkpoint uses."""
    if is_vision_language(model.config):
        return _vision_language_checkpoint_names(model, remove_duplicate)
    tensors = {}
    for name, param in model.named_parameters(remove_duplicate=remove_duplicate):
        tensors.update(_checkpoint_names(name, param, model.config.model_type))
    return tensors


def _vision_language_checkpoint_names(model, remove_duplicate: bool) -> dict[str, torch.Tensor]:
    """transformers 5 keeps a VLM's parts under other names in memory than in its checkpoints
    (LLaVA: `model.language_model.*` in memory, `language_model.model.*` saved);
    `revert_weight_conversion` is the renaming `save_pretrained` applies, and hands back the
    parameters themselves, so loading into its values loads the model."""
    from transformers.core_model_loading import revert_weight_conversion

    params = dict(model.named_parameters(remove_duplicate=remove_duplicate))
    renamed = revert_weight_conversion(model, params)
    own = {id(param) for param in params.values()}
    if not all(id(tensor) in own for tensor in renamed.values()):
        raise TypeError(f"{model.config.model_type}: its checkpoint names need converted tensors, not views")
    return renamed


class SampledLogProbs:
    """Records log p(token) of each sampled token in the distribution it was drawn from, one step
    at a time: generate passes each step's raw logits (custom processors run before its
    temperature, top-k and top-p warpers, transformers/generation/utils.py `_get_logits_processor`),
    and the token drawn from them is the last column of the next step's ids. The recorder applies
    the temperature and `truncation` (the same top-k then top-p, hybridflow/algorithms/sampling.py)
    itself. Holds one step's (B, V) log-probs, where `output_logits` would keep (B, L, V) until
    generate returns; leaves the logits unchanged. With `top_k` K > 0 it also keeps each step's K
    likeliest tokens of the same log-probs (-inf for those the filters drop)."""

    def __init__(self, temperature: float, top_k: int = 0, truncation: Truncation | None = None):
        self.temperature, self.top_k, self.truncation = temperature, top_k, truncation or Truncation()
        self.pending: torch.Tensor | None = None  # (B, V): the last step's log-probs, token not yet drawn
        self.columns: list[torch.Tensor] = []  # L of (B,)
        self.top_columns: list[tuple[torch.Tensor, torch.Tensor]] = []  # L of (values, ids), each (B, K)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take(input_ids[:, -1])  # the token drawn from the previous step's distribution
        self.pending = truncated_log_softmax(scores.float() / self.temperature, self.truncation)  # (B, V)
        return scores

    def _take(self, drawn: torch.Tensor) -> None:
        if self.pending is not None:
            self.columns.append(self.pending.gather(-1, drawn[:, None]).squeeze(-1))  # (B,)
            if self.top_k:
                self.top_columns.append(self.pending.topk(self.top_k, dim=-1))  # (B, K) sorted, descending
            self.pending = None

    def log_probs(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, L) log-probs of the generated tokens, once generate returned `sequences` (B, P+L)."""
        self._take(sequences[:, -1])
        if not self.columns:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self.columns, dim=1)  # (B, L)

    def top_k_tokens(self) -> TopK | None:
        """(B, L, K) ids and log-probs of each step's K likeliest tokens, on CPU (None with K = 0);
        call it after `log_probs`, which takes the last step."""
        if not self.top_k:
            return None
        values = torch.stack([values for values, _ in self.top_columns], dim=1)  # (B, L, K)
        ids = torch.stack([ids for _, ids in self.top_columns], dim=1)  # (B, L, K)
        return TopK(ids.cpu(), values.cpu())


class HFRolloutEngine(SeededGenerationMixin):
    """Batched generation with a transformers model held in this process."""

    def __init__(self, model_path: str | Path, cfg: RolloutConfig, device: str | torch.device | None = None):
        from transformers import AutoConfig

        model_path = Path(model_path)
        if not (model_path / "config.json").is_file():
            raise ValueError(
                f"rollout model path {model_path} has no config.json (expected a Hugging Face model dir)"
            )
        self.cfg = cfg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        hf_config = AutoConfig.from_pretrained(model_path)
        self.eos_token_ids, self.pad_token_id = read_special_token_ids(model_path, hf_config)
        self.model = _load_model(model_path, hf_config, cfg).to(self.device).eval()
        self.model.generation_config = _plain_generation_config(self.eos_token_ids, self.pad_token_id)
        self.route_recorder = RouteRecorder(self.model) if cfg.return_routed_experts else None
        uses_stop = bool(cfg.sampling.stop or cfg.val_sampling.stop)
        self.tokenizer = load_tokenizer(model_path) if uses_stop else None
        self.position = SamplingPosition()

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The shared output (engines/rollout/base.py), plus `routed_experts` (B, P+R, L, k) with
        rollout.return_routed_experts (engines/rollout/hf_routes.py)."""
        out = super().generate_sequences(prompts)
        if self.route_recorder is not None and len(out):
            out.batch[ROUTES_KEY] = self.route_recorder.routes(out.batch["input_ids"].shape[1])
        return out

    def _generate(self, prompts: DataProto, sampling: SamplingConfig, seed: int):
        """Generated ids (B, L) and, with calculate_log_probs, their log-probs (B, L) and with
        top_k_log_probs their `TopK` (B, L, K), on CPU."""
        from transformers import LogitsProcessorList

        input_ids = prompts.batch["input_ids"]  # (B, P)
        if len(prompts) == 0:
            return self._empty_output()
        generation_config = self._generation_config(sampling)
        recorder = None
        if self.cfg.calculate_log_probs:
            temperature = sampling.temperature if sampling.do_sample else 1.0
            truncation = Truncation(**sampling.filters())
            recorder = SampledLogProbs(temperature, self.cfg.top_k_log_probs, truncation)
        routes = self.route_recorder.recording(len(prompts)) if self.route_recorder else nullcontext()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), routes:
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=prompts.batch["attention_mask"].to(self.device),
                generation_config=generation_config,
                tokenizer=self.tokenizer,
                logits_processor=LogitsProcessorList([recorder] if recorder else []),
                **self._image_inputs(prompts),
            )
        responses = out.sequences[:, input_ids.shape[1] :]  # (B, L)
        log_probs = recorder.log_probs(out.sequences).cpu() if recorder else None  # (B, L)
        return responses.cpu(), log_probs, (recorder.top_k_tokens() if recorder else None)

    def _image_inputs(self, prompts: DataProto) -> dict[str, torch.Tensor]:
        """`pixel_values` (N, 3, H, W) of every row's images in row order, which is the order of
        the image tokens in the batch (LLaVA fills them in that order); {} without images."""
        rows = image_rows(prompts, self.model.config)
        if rows is None:
            return {}
        images = [torch.as_tensor(row) for row in rows if len(row)]
        if not images:
            return {}
        return {PIXEL_VALUES_KEY: torch.cat(images).to(self.device, self.model.dtype)}

    def _empty_output(self):
        """`_generate`'s output for no prompt rows: the same keys, with no positions."""
        empty, k = torch.zeros(0, 0, dtype=torch.long), self.cfg.top_k_log_probs
        log_probs = empty.float() if self.cfg.calculate_log_probs else None
        top_k = TopK(torch.zeros(0, 0, k, dtype=torch.long), torch.zeros(0, 0, k)) if k else None  # (0, 0, K)
        return empty, log_probs, top_k

    def _generation_config(self, sampling: SamplingConfig):
        from transformers import GenerationConfig

        settings: dict[str, Any] = dict(
            max_new_tokens=self.cfg.max_new_tokens(sampling),
            do_sample=sampling.do_sample,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
        )
        if sampling.do_sample:
            # top_k=0 switches transformers' top-k filter off (None would mean its default, 50).
            settings.update(
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0)
            )
        if sampling.stop:
            settings["stop_strings"] = list(sampling.stop)
        return GenerationConfig(**settings)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self._params()
        bucket = list(named_tensors)
        check_named_shapes(bucket, {name: tuple(param.shape) for name, param in params.items()})
        for name, tensor in bucket:
            params[name].copy_(tensor)

    def flush_cache(self) -> None:
        """Nothing to drop: `generate` builds a fresh KV cache on every call."""

    def weight_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        params = self._params()
        if names is None:
            names = list(checkpoint_tensors(self.model))
        unknown = [name for name in names if name not in params]
        if unknown:
            raise ValueError(f"weight_checksums: {unknown[:5]} are not parameters of the rollout model")
        return {name: tensor_checksum(params[name]) for name in names}

    def _params(self) -> dict[str, torch.Tensor]:
        # Tied weights appear under each of their names, so either name can be synced. Built per
        # call: expert views must follow the parameters when release_memory moves them.
        return checkpoint_tensors(self.model, remove_duplicate=False)

    # ------------------------------------------------------------------ memory and RNG
    def begin_weight_update(self) -> None:
        """Nothing to open: `update_weights` writes the parameters in place."""

    def end_weight_update(self) -> None:
        """Nothing to close."""

    def release_memory(self, tags: list[str] | None = None) -> None:
        """On CUDA, move the weights to host memory so the actor can use the device; on CPU a no-op.
        Only the "weights" tag means anything here (the KV cache lives only during `generate`)."""
        if self.device.type == "cuda" and (tags is None or WEIGHTS_TAG in tags):
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        if self.device.type == "cuda" and (tags is None or WEIGHTS_TAG in tags):
            self.model.to(self.device)

    def shutdown(self) -> None:
        """Nothing to stop: the model lives in this process and goes with it."""


def _load_model(model_path: Path, hf_config, cfg: RolloutConfig):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    dtype = torch_dtype(cfg.dtype)
    auto = AutoModelForImageTextToText if is_vision_language(hf_config) else AutoModelForCausalLM
    if cfg.load_format == "auto":
        return auto.from_pretrained(model_path, dtype=dtype)
    return auto.from_config(hf_config, dtype=dtype)


def _plain_generation_config(eos_token_ids: list[int], pad_token_id: int):
    """A generation config carrying only the special ids, so that sampling defaults shipped with a
    checkpoint (repetition penalty, top_k, ...) never override the recipe's."""
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=eos_token_ids, pad_token_id=pad_token_id)
