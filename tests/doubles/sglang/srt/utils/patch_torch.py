"""`sglang.srt.utils.patch_torch` of the double: after `monkey_patch_torch_reductions()` a CUDA
tensor pickles through `_rebuild_cuda_tensor_modified`, whose handle names its GPU by UUID."""

from sglang._double import Handle, patch_reductions, rebuild_handle


def monkey_patch_torch_reductions() -> None:
    patch_reductions()


def _rebuild_cuda_tensor_modified(device: str, source_gpu: str, raw: bytes, dtype, shape) -> Handle:
    return rebuild_handle(True, device, source_gpu, raw, dtype, shape)


__all__ = ["monkey_patch_torch_reductions"]
