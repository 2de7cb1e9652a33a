"""Contract double of sglang 0.5.23 for CPU tests (see `_double.py`); put `tests/doubles` on the
path of a test process to use it in place of the real package."""

from sglang.srt.entrypoints.engine import Engine

__version__ = "0.5.23"
__all__ = ["Engine"]
