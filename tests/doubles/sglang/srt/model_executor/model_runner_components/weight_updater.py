"""`sglang.srt.model_executor.model_runner_components.weight_updater` of the double. The class is
defined here, under the module path SGLang's SafeUnpickler allows (utils/common.py:3352-3355)."""

from dataclasses import dataclass

from sglang._double import MultiprocessingSerializer


@dataclass
class LocalSerializedTensor:
    """One serialized tensor per TP rank; rank i loads values[i] (weight_updater.py:450-458)."""

    values: list[bytes]

    def get(self, rank: int):
        return MultiprocessingSerializer.deserialize(self.values[rank])


__all__ = ["LocalSerializedTensor"]
