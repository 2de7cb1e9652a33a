"""The Megatron-Core engine: model building, training, log-probs, checkpoints, weight streams.

`megatron/core/__init__.py` imports wandb when it is installed (Megatron-Core 0.16's optional
import in megatron.core.inference.contexts.dynamic_context, for its inference engine's metrics,
which no engine here uses): seconds of wandb's own imports in every worker process. While
megatron.core itself executes, `import wandb` fails here as if wandb were not installed, so
Megatron-Core skips it; afterwards wandb imports as usual (a run that logs to wandb,
hybridflow/utils/tracking.py, gets it). Nothing is imported by this package's own import.
"""

import importlib.abc
import importlib.machinery
import sys

MEGATRON_CORE = "megatron.core"
SKIPPED = "wandb"


class _SkipWandbLoader(importlib.abc.Loader):
    """megatron.core's own loader, run with wandb hidden from imports."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        if SKIPPED in sys.modules:  # imported by then: nothing left to save
            self.loader.exec_module(module)
            return
        sys.modules[SKIPPED] = None  # `import wandb` raises ImportError, which Megatron-Core catches
        try:
            self.loader.exec_module(module)
        finally:
            if sys.modules.get(SKIPPED, ...) is None:
                del sys.modules[SKIPPED]

    def __getattr__(self, name):  # get_source, get_resource_reader, ... as the real loader has them
        return getattr(self.loader, name)


class _SkipWandbFinder(importlib.abc.MetaPathFinder):
    """Finds megatron.core where the path finder does, with `_SkipWandbLoader` around its loader."""

    def find_spec(self, name, path=None, target=None):
        if name != MEGATRON_CORE or SKIPPED in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _SkipWandbLoader(spec.loader)
        return spec


if not any(isinstance(finder, _SkipWandbFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SkipWandbFinder())
