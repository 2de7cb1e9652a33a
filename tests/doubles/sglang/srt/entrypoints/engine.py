"""`sglang.srt.entrypoints.engine` of the double."""

from sglang._double import Engine, FlushCacheReqOutput

__all__ = ["Engine", "FlushCacheReqOutput"]
