"""Every accommodation that lets Megatron-Core run on a CPU-only build of torch, in one place.

Each function here does nothing (or defers to Megatron-Core's own call) when CUDA is present,
so the GPU path runs Megatron-Core untouched. What is accommodated, and why (measured in
docs/megatron-on-cpu.md beside the repo):

- Megatron's schedules, p2p communication, tensor-parallel mappings and checkpointing allocate
  with `device="cuda"` / `torch.cuda.current_device()` and call `torch.cuda.synchronize()`.
  `install()` replaces `torch.cuda.current_device` / `torch.cuda.synchronize` by CPU
  equivalents for the process; `cuda_calls_on_cpu()` is a scope in which a `TorchFunctionMode`
  rewrites CUDA device arguments (and `Tensor.cuda()`) to the CPU. Wrap calls into Megatron-Core
  in it (model construction, the schedules, dist_checkpointing); it is a scope rather than
  process-wide because a function mode puts every torch call through Python (transformers
  `generate` in the same process ran twice as slow under it).
- `seed_all(seed)`: `model_parallel_cuda_manual_seed` asserts on a CPU build; on CPU the torch
  generator is seeded directly (dropout is 0 in RL fine-tuning, so no per-rank RNG streams are
  needed).
- Activation recompute: Megatron's checkpoint functions save the RNG states before the forward and
  restore them around the recompute in backward (`_get_all_rng_states` / `_set_all_rng_states` in
  megatron/core/tensor_parallel/random.py): torch's CPU generator, the CUDA generator and its
  tracker's states. The CUDA generator's state asserts on a CPU build; `install()` points
  Megatron's `_get_cuda_rng_state` / `_set_cuda_rng_state` at an empty state and a no-op, so the
  recompute saves and restores torch's CPU generator, the one a CPU run draws from.
- MoE router without Transformer Engine, on CPU and CUDA alike: `moe_utils.RouterGatingLinearFunction`
  tests `te_general_gemm is not None`, but Megatron-Core 0.16.1 only defines that name when TE
  imports (megatron/core/transformer/moe/moe_utils.py), so the router raises NameError (seen on an
  H200 without TE, 2026-11-26). `define_missing_te_gemm()`, which `init_megatron` calls on every
  device, defines it as None, the value the function's torch.mm fallback expects. MoE without TE
  then runs Megatron's own SequentialMLP experts (and, on CPU, its all-gather token dispatcher
  over gloo). This is the one accommodation here that also acts with CUDA.
- MoE all-to-all token dispatcher: it creates a `torch.cuda.Stream` in its constructor and
  copies the token counts to the host on that stream (`_maybe_dtoh_and_synchronize` in
  megatron/core/transformer/moe/token_dispatcher.py). On CPU everything is already on the host
  and ordered: `install()` points `torch.cuda.Stream` / `current_stream` / `stream` at
  `HostStream`, a stream that is always synchronised. The same copy turns the split sizes into
  numpy arrays (what `all_to_all_single` accepts) only for CUDA tensors, so on CPU the
  dispatcher's `maybe_move_tensor_to_cpu` is replaced by `host_tensor`, which converts host
  tensors the same way.
- The core attention: Megatron's local `DotProductAttention` allocates on CUDA; the SDPA module
  in `engines/megatron/attention.py` replaces it through the layer spec (Megatron's extension
  point). It is used on GPU too when Transformer Engine is absent (see model.py).
"""

from contextlib import contextmanager, nullcontext

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _names_cuda(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return False


class CudaArgumentsToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to "cpu" and makes `Tensor.cuda()` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if any(_names_cuda(a) for a in args):
            args = tuple("cpu" if _names_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class HostStream:
    """The part of `torch.cuda.Stream` Megatron's all-to-all dispatcher uses, for host execution:
    work is already complete when queued, so waiting and events do nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        return None

    def record_event(self, event=None) -> "HostStream":
        return self

    def synchronize(self) -> None:
        return None


_HOST_STREAM = HostStream()


def _current_stream(device=None) -> HostStream:
    return _HOST_STREAM


def _stream(stream=None):
    return nullcontext()


def host_tensor(tensor, as_numpy: bool = False, record_stream: bool = False):
    """`moe_utils.maybe_move_tensor_to_cpu` for tensors already on the host: numpy when asked."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


_NO_DEVICE_RNG_STATE = torch.empty(0, dtype=torch.uint8)


def _no_device_rng_state(*args, **kwargs) -> torch.Tensor:
    """Megatron's `_get_cuda_rng_state` without a CUDA generator: an empty state."""
    return _NO_DEVICE_RNG_STATE


def _set_no_device_rng_state(*args, **kwargs) -> None:
    """Megatron's `_set_cuda_rng_state` without a CUDA generator: nothing to restore."""
    return None


def _current_device_cpu() -> str:
    return "cpu"


def _synchronize_noop(device=None) -> None:
    return None


def install() -> None:
    """Point `torch.cuda.current_device` / `synchronize` at the CPU, and the rest above (idempotent;
    a no-op with CUDA)."""
    global _installed
    if _installed or cuda_available():
        return
    torch.cuda.current_device = _current_device_cpu
    torch.cuda.synchronize = _synchronize_noop
    torch.cuda.Stream = HostStream
    torch.cuda.current_stream = _current_stream
    torch.cuda.stream = _stream
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = host_tensor
    megatron_random._get_cuda_rng_state = _no_device_rng_state
    megatron_random._set_cuda_rng_state = _set_no_device_rng_state
    _installed = True


def define_missing_te_gemm() -> None:
    """Megatron-Core 0.16.1's MoE router reads `te_general_gemm`, defined only when TE imports."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextmanager
def cuda_calls_on_cpu():
    """Scope in which torch calls naming CUDA run on the CPU (nothing happens with CUDA)."""
    if cuda_available():
        yield
        return
    install()
    with CudaArgumentsToCpu():
        yield


def seed_all(seed: int) -> None:
    """Seed torch the way Megatron-Core would: its CUDA RNG tracker on GPU, torch's generator on CPU."""
    if cuda_available():
        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    torch.manual_seed(seed)


def transformer_config_overrides() -> dict:
    """TransformerConfig settings that differ on CPU: build parameters on the CPU, not on CUDA."""
    return {"use_cpu_initialization": not cuda_available()}
