"""`sglang.srt.model_executor.model_runner_components.weight_updater` of the double."""

from sglang._double import LocalSerializedTensor

__all__ = ["LocalSerializedTensor"]
