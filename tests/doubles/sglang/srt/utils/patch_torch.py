"""`sglang.srt.utils.patch_torch` of the double."""

from sglang._double import monkey_patch_torch_reductions

__all__ = ["monkey_patch_torch_reductions"]
