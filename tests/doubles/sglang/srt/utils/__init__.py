"""`sglang.srt.utils` of the double."""

from sglang._double import MultiprocessingSerializer

__all__ = ["MultiprocessingSerializer"]
