"""A contract double of SGLang's offline engine, for CPU tests of the code that drives it.

Follows sglang 0.5.23 (the version requirements-gpu.txt pins), read from its wheel:
  - `srt/entrypoints/engine.py`: `Engine(**server_args)`, `generate`, `begin_weight_update`,
    `end_weight_update`, `update_weights_from_tensor(named_tensors, load_format, flush_cache)`,
    `flush_cache`, `release_memory_occupation(tags)`, `resume_memory_occupation(tags)`, `shutdown`;
  - `srt/managers/scheduler_components/weight_updater.py` (the scheduler side): updates outside a
    `begin_weight_update()` / `end_weight_update()` session return `(False, message)` without
    raising; a second begin or an end without begin return `(False, message)`; release adds the
    tags to a set and resume does `offload_tags.remove(tag)`, which raises KeyError (killing the
    scheduler) for a tag that was not released; release asserts the engine is idle;
  - `srt/model_executor/model_runner_components/weight_updater.py`: scheduler `i` of an engine
    with `tp_size=T` unwraps `LocalSerializedTensor.values[i]` (or the tensor itself) and loads it;
  - `srt/utils/common.py` `MultiprocessingSerializer` and `srt/utils/patch_torch.py`
    `monkey_patch_torch_reductions`: a CUDA tensor pickles to an IPC handle naming its device by
    the ordinal in the sender process, or, once the sender patched torch's reductions, by UUID;
    the receiver opens an ordinal on *its own* device of that ordinal;
  - `srt/constants.py`: the memory tags; `sampling/sampling_batch_info.py`: `sampling_seed` is
    read only with `enable_deterministic_inference`.

What it models where CUDA is absent: the schedulers' GPUs are `CUDA_VISIBLE_DEVICES` of the
process that builds the engine (inherited by SGLang's spawned scheduler processes), entries
`base_gpu_id + i * gpu_id_step`; an entry past the end fails as `torch.cuda.set_device` does. A
sender is a process that sees exactly one GPU (Ray's narrowing), so its tensors live on
`CUDA_VISIBLE_DEVICES[0]`. Tensors travel by value (pickled), tagged with that device.

What it enforces beyond SGLang's own errors, so a test fails where the real engine would go
silently wrong or crash: a handle opened on a GPU other than the one holding the tensor; loading
into or generating from released memory; generating after a weight update without a cache
flush (the radix cache would serve KV computed with the old weights). Generation runs the
transformers model of `model_path` on the weights received by scheduler 0.
"""

import io
import os
import pickle
from dataclasses import dataclass, field

import torch

SERVER_ARGS = {  # the ServerArgs fields this double accepts (all exist in 0.5.23's ServerArgs)
    "model_path", "dtype", "tp_size", "mem_fraction_static", "load_format", "base_gpu_id",
    "gpu_id_step", "random_seed", "enable_memory_saver", "skip_tokenizer_init",
    "enable_deterministic_inference", "log_level",
}  # fmt: skip
SAMPLING_PARAMS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "sampling_seed",
    "skip_special_tokens",
    "stop",
}
ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]

_patched_reductions = False  # per process, as monkey_patch_torch_reductions is


def monkey_patch_torch_reductions() -> None:
    global _patched_reductions
    _patched_reductions = True


def _sender_gpu() -> str:
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if len(visible) != 1:
        raise NotImplementedError(
            f"the sglang double models senders that see exactly one GPU; CUDA_VISIBLE_DEVICES={visible}"
        )
    return visible[0]


@dataclass
class _Handle:
    """A pickled CUDA tensor: its device as the sender names it, and (here) its value."""

    by_uuid: bool
    device: str  # the GPU itself (by_uuid) or the sender's ordinal
    source_gpu: str
    value: torch.Tensor


def _rebuild_handle(by_uuid: bool, device: str, source_gpu: str, raw, dtype: torch.dtype, shape) -> _Handle:
    value = torch.from_numpy(raw.copy()).view(dtype).reshape(shape)
    return _Handle(by_uuid, device, source_gpu, value)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            gpu = _sender_gpu()
            raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            device = gpu if _patched_reductions else "0"  # a UUID, or the ordinal in the sender
            return _rebuild_handle, (_patched_reductions, device, gpu, raw, obj.dtype, tuple(obj.shape))
        return NotImplemented


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False) -> bytes:
        if output_str:
            raise NotImplementedError("the double serializes to bytes only")
        buf = io.BytesIO()
        _Pickler(buf).dump(obj)
        return buf.getvalue()

    @staticmethod
    def deserialize(data: bytes):
        return pickle.loads(data)


@dataclass
class LocalSerializedTensor:
    """One serialized tensor per TP rank; rank i loads values[i]."""

    values: list[bytes]

    def get(self, rank: int):
        return MultiprocessingSerializer.deserialize(self.values[rank])


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class Received:
    """What one scheduler loaded for one name: the tensor and the GPU it came from."""

    tensor: torch.Tensor
    source_gpu: str


@dataclass
class _Session:
    loaded_weights: bool = False


@dataclass
class _Calls:
    release: list = field(default_factory=list)
    resume: list = field(default_factory=list)
    begin: int = 0
    end: int = 0
    updates: int = 0
    flushes: int = 0


class Engine:
    """`sglang.Engine` as 0.5.23 behaves, with CPU generation through transformers."""

    def __init__(self, **server_args):
        unknown = sorted(set(server_args) - SERVER_ARGS)
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got unexpected keyword arguments {unknown}")
        from transformers import AutoConfig, AutoModelForCausalLM

        self.server_args = server_args
        tp, base, step = (
            server_args.get("tp_size", 1),
            server_args.get("base_gpu_id", 0),
            server_args.get("gpu_id_step", 1),
        )
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        if not visible:
            raise NotImplementedError("the sglang double needs CUDA_VISIBLE_DEVICES to name the GPUs")
        ordinals = [base + i * step for i in range(tp)]
        if ordinals[-1] >= len(visible):
            raise RuntimeError(
                f"CUDA error: invalid device ordinal (scheduler TP rank {len(visible)} of {tp} asks for GPU "
                f"{ordinals[-1]} but CUDA_VISIBLE_DEVICES={','.join(visible)})"
            )
        self.visible = visible
        self.scheduler_gpus = [visible[o] for o in ordinals]
        path = server_args["model_path"]
        if server_args.get("load_format", "auto") == "dummy":
            self.model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path), dtype=torch.float32
            )
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.eval()
        self.params = dict(self.model.named_parameters())
        self.deterministic = bool(server_args.get("enable_deterministic_inference", False))
        self.offload_tags: set[str] = set()
        self.received: list[dict[str, Received]] = [{} for _ in range(tp)]
        self.calls = _Calls()
        self._session: _Session | None = None
        self._cache_stale = False
        self._alive = True

    # ------------------------------------------------------------------ memory
    def release_memory_occupation(self, tags: list[str] | None = None):
        self._check_alive()
        self.calls.release.append(list(tags) if tags else None)
        for tag in tags or ALL_TAGS:
            self.offload_tags.add(tag)

    def resume_memory_occupation(self, tags: list[str] | None = None):
        self._check_alive()
        self.calls.resume.append(list(tags) if tags else None)
        for tag in tags or ALL_TAGS:
            if tag not in self.offload_tags:
                self._alive = False  # the scheduler raised KeyError in offload_tags.remove and died
                raise KeyError(f"{tag!r}: resume_memory_occupation of memory that was not released")
            self.offload_tags.remove(tag)

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self, selector: str = "all"):
        self._check_alive()
        self.calls.begin += 1
        if self._session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session = _Session()
        return True, "Success"

    def end_weight_update(self):
        self._check_alive()
        self.calls.end += 1
        if self._session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session = None
        return True, "Success"

    def update_weights_from_tensor(
        self, named_tensors, load_format: str | None = None, flush_cache: bool = True
    ):
        self._check_alive()
        self.calls.updates += 1
        if load_format is not None:
            raise NotImplementedError(f"the double loads load_format=None only, got {load_format!r}")
        if self._session is None:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        if "weights" in self.offload_tags:
            self._alive = False
            raise RuntimeError("CUDA error: an illegal memory access was encountered (weights are released)")
        for rank, gpu in enumerate(self.scheduler_gpus):
            for name, payload in named_tensors:
                handle = payload.get(rank) if isinstance(payload, LocalSerializedTensor) else payload
                self.received[rank][name] = Received(self._open(handle, gpu), _source(handle))
        with torch.no_grad():
            for name, _ in named_tensors:
                if name not in self.params:
                    self._alive = False
                    raise KeyError(f"{name!r} is not a parameter of {type(self.model).__name__}")
                self.params[name].copy_(self.received[0][name].tensor)
        self._session.loaded_weights = True
        self._cache_stale = True
        if flush_cache:
            self.flush_cache()
        return True, "Success"

    def _open(self, handle, scheduler_gpu: str) -> torch.Tensor:
        if not isinstance(handle, _Handle):  # a tensor passed in this process
            return handle
        opened_on = handle.device if handle.by_uuid else self.visible[int(handle.device)]
        if opened_on != handle.source_gpu:
            raise RuntimeError(
                f"CUDA IPC handle of a tensor on GPU {handle.source_gpu} opened on GPU {opened_on} by the "
                f"scheduler on GPU {scheduler_gpu}: the sender did not call monkey_patch_torch_reductions()"
            )
        return handle.value

    def flush_cache(self):
        self._check_alive()
        self.calls.flushes += 1
        self._cache_stale = False
        return FlushCacheReqOutput(success=True)

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids=None, sampling_params=None, return_logprob: bool = False, **kwargs):
        self._check_alive()
        if kwargs:
            raise TypeError(
                f"the double takes input_ids, sampling_params, return_logprob, not {sorted(kwargs)}"
            )
        if self.offload_tags & {"weights", "kv_cache"}:
            self._alive = False
            raise RuntimeError(
                f"CUDA error: illegal memory access (generate with {sorted(self.offload_tags)} released)"
            )
        if self._cache_stale:
            raise AssertionError(
                "generate after a weight update without flush_cache: the radix cache holds stale KV"
            )
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        return [self._generate_one(ids, p, return_logprob) for ids, p in zip(input_ids, params, strict=True)]

    @torch.no_grad()
    def _generate_one(self, prompt: list[int], params: dict, return_logprob: bool) -> dict:
        unknown = sorted(set(params) - SAMPLING_PARAMS)
        if unknown:
            raise ValueError(f"unknown sampling params {unknown}")
        eos = self.model.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        gen = torch.Generator()
        if self.deterministic and params.get("sampling_seed") is not None:
            gen.manual_seed(params["sampling_seed"])
        else:
            gen.seed()
        ids, out, logprobs = list(prompt), [], []
        for _ in range(params["max_new_tokens"]):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            temperature = params.get("temperature", 1.0)
            log_p = torch.log_softmax(logits / (temperature or 1.0), -1)
            token = (
                int(logits.argmax())
                if temperature == 0
                else int(torch.multinomial(log_p.exp(), 1, generator=gen))
            )
            if token in eos:
                return _output(out, logprobs, {"type": "stop", "matched": token}, return_logprob)
            out.append(token)
            logprobs.append((float(log_p[token]), token, None))
            ids.append(token)
        return _output(out, logprobs, {"type": "length", "length": len(out)}, return_logprob)

    def shutdown(self):
        self._alive = False

    def _check_alive(self):
        if not self._alive:
            raise RuntimeError("the SGLang engine's scheduler is dead (an earlier call crashed it)")


def _source(handle) -> str:
    return handle.source_gpu if isinstance(handle, _Handle) else "caller"


def _output(ids: list[int], logprobs: list, finish: dict, return_logprob: bool) -> dict:
    meta = {"finish_reason": finish}
    if return_logprob:
        meta["output_token_logprobs"] = logprobs
    return {"output_ids": ids, "meta_info": meta}
