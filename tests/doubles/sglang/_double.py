"""A contract double of SGLang's offline engine, for CPU tests of the code that drives it.

Follows sglang 0.5.23 (the version requirements-gpu.txt pins), read from its wheel (paths under
`sglang/srt/`, line numbers of 0.5.23):
  - `entrypoints/engine.py`: `Engine(**server_args)`, `generate`, `begin_weight_update`,
    `end_weight_update`, `update_weights_from_tensor(named_tensors, load_format, flush_cache)`
    (1679-1700: `named_tensors` serialized once per TP rank, 1743-1759), `flush_cache`,
    `release_memory_occupation(tags)`, `resume_memory_occupation(tags)`, `shutdown`;
  - logging: without `log_level` the engine sets "error" (engine.py:294-296) and
    `configure_logger` (engine.py:1152, utils/common.py:2618-2638) calls
    `logging.basicConfig(level=..., force=True)` in the calling process: the root logger's
    handlers are replaced and its level set, so the caller's warnings are dropped from then on;
  - environment: `_set_envs_and_config` (engine.py:1878-1921) writes into the calling process's
    `os.environ` (inherited by the schedulers it spawns): NCCL_CUMEM_ENABLE and NCCL_NVLS_ENABLE
    (to 0 with the defaults, unless already set and no symm-mem / NVLS option asks otherwise) and
    CUDA_DEVICE_MAX_CONNECTIONS=8, always;
  - `managers/scheduler_components/weight_updater.py` (the scheduler side): updates outside a
    `begin_weight_update()` / `end_weight_update()` session return `(False, message)` without
    raising; a second begin or an end without begin return `(False, message)`; release asserts
    the engine is fully idle (339-341), adds the tags to a set; resume does
    `offload_tags.remove(tag)` (390), a KeyError for a tag that was not released;
  - released weights: `torch_memory_saver` pauses them without a CPU copy unless
    `enable_weights_cpu_backup` (model_runner_components/load_model_utils.py:307-325), so after
    a resume of "weights" their contents are undefined until reloaded;
  - any exception inside a scheduler (a failed assertion, the KeyError above, a CUDA error, a
    shape mismatch in `load_weights`) makes it SIGQUIT its parent (managers/scheduler.py:6369),
    whose handler kills the whole process tree, the process that built the engine included
    (tokenizer_manager.py:4072-4081, utils/common.py:2507-2550): nothing is returned. Modelled as
    `ProcessTreeKilled`, a BaseException, so no `except Exception` in the code under test
    survives it, as no code survives SIGKILL;
  - `model_executor/model_runner_components/weight_updater.py`: scheduler `i` of an engine with
    `tp_size=T` deserializes `named_tensors`, unwraps `LocalSerializedTensor.values[i]` (or the
    tensor itself) (444-458) and calls `model.load_weights`, which for Qwen2 (models/qwen2.py:
    651-719) skips an unknown name with a warning ("Parameter {name} not found in params_dict")
    and asserts the shape of a known one (model_loader/weight_utils.py:1574-1586);
  - `utils/common.py` `MultiprocessingSerializer` (3060-3099): pickles with ForkingPickler,
    unpickles with `SafeUnpickler` (3144-3370), which resolves only an exact allow-list of
    (module, name) globals and raises "Blocked unsafe global (...)" for any other;
  - `utils/patch_torch.py` `monkey_patch_torch_reductions`: a CUDA tensor pickles to an IPC
    handle naming its device by the ordinal in the sender process, or, once the sender patched
    torch's reductions, by UUID; the receiver opens an ordinal on *its own* device of that ordinal;
  - `managers/schedule_batch.py` (1509-1513, 1856-1876) and
    `managers/scheduler_components/output_streamer.py` (489-491, 612-640): `output_ids` run
    through the stop condition, so a request that stopped on EOS ends with the EOS id, and
    `output_token_logprobs` has one entry per output id, the EOS's included;
  - `sampling/sampling_params.py` (302-312): `sampling_seed` must be an int in
    [-2**63, 2**63 - 1] (ValueError otherwise); `sampling/sampling_batch_info.py`: it is read only
    with `enable_deterministic_inference`;
  - `constants.py`: the memory tags.

What it models where CUDA is absent: the schedulers' GPUs are `CUDA_VISIBLE_DEVICES` of the
process that builds the engine (inherited by SGLang's spawned scheduler processes), entries
`base_gpu_id + i * gpu_id_step`; an entry past the end fails as `torch.cuda.set_device` does. A
sender is a process that sees exactly one GPU (Ray's narrowing), so its tensors live on
`CUDA_VISIBLE_DEVICES[0]`. Tensors travel by value (pickled bytes), tagged with that device.

What it enforces beyond SGLang's own errors, so a test fails where the real engine would go
silently wrong: a handle opened on a GPU other than the one holding the tensor; generating after
a weight update without a cache flush (the radix cache would serve KV computed with the old
weights); generating from weights that were resumed without a CPU backup and not all reloaded.
Generation runs the transformers model of `model_path` on the weights received by scheduler 0.
"""

import io
import logging
import os
import pickle
from dataclasses import dataclass, field
from typing import ClassVar

import torch

logger = logging.getLogger("sglang.srt.models.qwen2")

SERVER_ARGS = {  # the ServerArgs fields this double accepts (all exist in 0.5.23's ServerArgs)
    "model_path", "dtype", "tp_size", "mem_fraction_static", "load_format", "base_gpu_id",
    "gpu_id_step", "random_seed", "enable_memory_saver", "skip_tokenizer_init",
    "enable_deterministic_inference", "log_level", "enable_weights_cpu_backup", "enable_symm_mem",
    "enable_nccl_nvls",
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
INT64 = (-(2**63), 2**63 - 1)

_patched_reductions = False  # per process, as monkey_patch_torch_reductions is


class ProcessTreeKilled(BaseException):
    """SGLang killed the process tree of the engine, the process that built it included."""


def patch_reductions() -> None:
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
class Handle:
    """An opened CUDA tensor: its device as the sender named it, and (here) its value."""

    by_uuid: bool
    device: str  # the GPU itself (by_uuid) or the sender's ordinal
    source_gpu: str
    value: torch.Tensor


def rebuild_handle(by_uuid: bool, device: str, source_gpu: str, raw: bytes, dtype, shape) -> Handle:
    value = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()
    return Handle(by_uuid, device, source_gpu, value)


def _rebuild_by_ordinal(device: str, source_gpu: str, raw: bytes, dtype, shape) -> Handle:
    """Stands in for torch's `rebuild_cuda_tensor` (no CUDA here to open the handle with)."""
    return rebuild_handle(False, device, source_gpu, raw, dtype, shape)


class _Pickler(pickle.Pickler):
    """ForkingPickler's view of a CUDA tensor: a rebuild function (torch's, or SGLang's patched one)
    and the handle's fields; raw bytes stand in for the IPC memory handle."""

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        gpu = _sender_gpu()
        raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if _patched_reductions:
            from sglang.srt.utils.patch_torch import _rebuild_cuda_tensor_modified

            return _rebuild_cuda_tensor_modified, (gpu, gpu, raw, obj.dtype, tuple(obj.shape))
        return torch.multiprocessing.reductions.rebuild_cuda_tensor, (
            "0",
            gpu,
            raw,
            obj.dtype,
            tuple(obj.shape),
        )  # the ordinal in the sender, which sees its one GPU as device 0


class SafeUnpickler(pickle.Unpickler):
    """The allow-list of SGLang's SafeUnpickler (utils/common.py:3148-3356) that these payloads can
    meet; any other global is refused with SGLang's message."""

    ALLOWED_GLOBALS: ClassVar[set[tuple[str, str]]] = {
        *(("builtins", name) for name in ("bool", "bytearray", "bytes", "dict", "float", "int", "list")),
        *(("builtins", name) for name in ("set", "str", "tuple", "frozenset", "complex", "slice")),
        ("collections", "OrderedDict"),
        ("copyreg", "__newobj__"),
        ("copyreg", "__newobj_ex__"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch", "dtype"),
        *(("torch", name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32")),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
        ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED_GLOBALS:
            raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_by_ordinal
        return super().find_class(module, name)


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
        return SafeUnpickler(io.BytesIO(data)).load()


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


def _configure_logger(log_level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )


def _set_envs_and_config(server_args: dict) -> None:
    symm_mem = bool(server_args.get("enable_symm_mem", False))
    nvls = bool(server_args.get("enable_nccl_nvls", False))
    if "NCCL_CUMEM_ENABLE" not in os.environ or symm_mem:
        os.environ["NCCL_CUMEM_ENABLE"] = str(int(symm_mem))  # memory saver on: no KV-shard scratch
    if "NCCL_NVLS_ENABLE" not in os.environ or nvls or symm_mem:
        os.environ["NCCL_NVLS_ENABLE"] = str(int(nvls or symm_mem))
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"


class Engine:
    """`sglang.Engine` as 0.5.23 behaves, with CPU generation through transformers."""

    def __init__(self, **server_args):
        unknown = sorted(set(server_args) - SERVER_ARGS)
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got unexpected keyword arguments {unknown}")
        server_args.setdefault("log_level", "error")
        self.server_args = server_args
        _configure_logger(server_args["log_level"])
        _set_envs_and_config(server_args)
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
        self.model = _load_model(server_args["model_path"], server_args.get("load_format", "auto"))
        self.params = dict(self.model.named_parameters())
        self.deterministic = bool(server_args.get("enable_deterministic_inference", False))
        self.offload_tags: set[str] = set()
        self.received: list[dict[str, Received]] = [{} for _ in range(tp)]
        self.calls = _Calls()
        self.undefined_weights: set[str] = set()  # resumed without a CPU backup, not reloaded since
        self.in_flight = 0  # requests being generated
        self.shut_down = False
        self._session: _Session | None = None
        self._cache_stale = False
        self._alive = True

    # ------------------------------------------------------------------ memory
    def release_memory_occupation(self, tags: list[str] | None = None):
        self._check_alive()
        self.calls.release.append(list(tags) if tags else None)
        if self.in_flight:
            self._kill("AssertionError: release_memory_occupation should be called only when server is idle.")
        for tag in tags or ALL_TAGS:
            self.offload_tags.add(tag)

    def resume_memory_occupation(self, tags: list[str] | None = None):
        self._check_alive()
        self.calls.resume.append(list(tags) if tags else None)
        for tag in tags or ALL_TAGS:
            if tag not in self.offload_tags:
                self._kill(f"KeyError: {tag!r} (resume_memory_occupation of memory that was not released)")
            self.offload_tags.remove(tag)
            if tag == "weights" and self._weights_lost_on_release():
                self._undefine_weights()

    def _weights_lost_on_release(self) -> bool:
        args = self.server_args
        return bool(args.get("enable_memory_saver")) and not args.get("enable_weights_cpu_backup")

    @torch.no_grad()
    def _undefine_weights(self) -> None:
        for param in self.params.values():
            param.fill_(float("nan"))  # what the paused memory holds is unspecified
        self.undefined_weights = set(self.params)

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
        payload = MultiprocessingSerializer.serialize(named_tensors)  # one per TP rank upstream
        if self._session is None:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        if "weights" in self.offload_tags:
            self._kill("CUDA error: an illegal memory access was encountered (weights are released)")
        for rank, gpu in enumerate(self.scheduler_gpus):
            self._load_on_scheduler(rank, gpu, payload)
        self._session.loaded_weights = True
        self._cache_stale = True
        if flush_cache:
            self.flush_cache()
        return True, "Success"

    def _load_on_scheduler(self, rank: int, gpu: str, payload: bytes) -> None:
        """What scheduler `rank` does: deserialize, unwrap its own handle, `model.load_weights`."""
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

        for name, item in MultiprocessingSerializer.deserialize(payload):
            handle = item.get(rank) if isinstance(item, LocalSerializedTensor) else item
            tensor = self._open(handle, gpu)
            if name not in self.params:
                logger.warning(f"Parameter {name} not found in params_dict")
                continue
            if tensor.shape != self.params[name].shape:
                self._kill(
                    f"AssertionError: Attempted to load weight ({tensor.size()}) into parameter "
                    f"({self.params[name].size()})"
                )
            self.received[rank][name] = Received(tensor, handle.source_gpu)
            if rank == 0:
                with torch.no_grad():
                    self.params[name].copy_(tensor)
                self.undefined_weights.discard(name)

    def _open(self, handle: Handle, scheduler_gpu: str) -> torch.Tensor:
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
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        for p in params:
            _verify_sampling_params(p)
        if self.offload_tags & {"weights", "kv_cache"}:
            released = sorted(self.offload_tags)
            self._kill(f"CUDA error: illegal memory access (generate with {released} released)")
        if self._cache_stale:
            raise AssertionError(
                "generate after a weight update without flush_cache: the radix cache holds stale KV"
            )
        if self.undefined_weights:
            raise AssertionError(
                f"generate from weights resumed without a CPU backup and not reloaded since: "
                f"{sorted(self.undefined_weights)[:5]} ({len(self.undefined_weights)} tensors)"
            )
        self.in_flight += len(input_ids)
        try:
            pairs = zip(input_ids, params, strict=True)
            return [self._generate_one(ids, p, return_logprob) for ids, p in pairs]
        finally:
            self.in_flight -= len(input_ids)

    @torch.no_grad()
    def _generate_one(self, prompt: list[int], params: dict, return_logprob: bool) -> dict:
        eos = self.model.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        gen = torch.Generator()
        if self.deterministic and params.get("sampling_seed") is not None:
            gen.manual_seed(params["sampling_seed"] % 2**64)  # torch takes [0, 2**64)
        else:
            gen.seed()
        ids, out, logprobs = list(prompt), [], []
        for _ in range(params["max_new_tokens"]):
            self._check_alive()
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            temperature = params.get("temperature", 1.0)
            log_p = torch.log_softmax(logits / (temperature or 1.0), -1)
            token = (
                int(logits.argmax())
                if temperature == 0
                else int(torch.multinomial(log_p.exp(), 1, generator=gen))
            )
            out.append(token)  # the EOS too: output_ids run through the stop condition
            logprobs.append((float(log_p[token]), token, None))
            if token in eos:
                return _output(out, logprobs, {"type": "stop", "matched": token}, return_logprob)
            ids.append(token)
        return _output(out, logprobs, {"type": "length", "length": len(out)}, return_logprob)

    def shutdown(self):
        self._alive = False
        self.shut_down = True

    def _kill(self, scheduler_error: str):
        self._alive = False
        raise ProcessTreeKilled(
            f"an SGLang scheduler raised {scheduler_error}; SGLang SIGKILLed the process tree of the engine"
        )

    def _check_alive(self):
        if not self._alive:
            raise ProcessTreeKilled("the SGLang engine is gone (shut down, or its process tree killed)")


def _load_model(path: str, load_format: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _verify_sampling_params(params: dict) -> None:
    unknown = sorted(set(params) - SAMPLING_PARAMS)
    if unknown:
        raise ValueError(f"unknown sampling params {unknown}")
    seed = params.get("sampling_seed")
    if seed is not None and not isinstance(seed, int):
        raise ValueError(f"sampling_seed must be an integer, got {type(seed).__name__}.")
    if seed is not None and not INT64[0] <= seed <= INT64[1]:
        raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")


def _output(ids: list[int], logprobs: list, finish: dict, return_logprob: bool) -> dict:
    meta = {"finish_reason": finish}
    if return_logprob:
        meta["output_token_logprobs"] = logprobs
    return {"output_ids": ids, "meta_info": meta}
