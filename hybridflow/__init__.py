"""hybridflow: RL post-training for LLMs with a single controller over Megatron-Core workers.

Importing this package must not import Megatron-Core, SGLang or initialise CUDA; engines are
imported inside the workers that build them.
"""

from hybridflow.protocol import DataProto, DataProtoFuture

__all__ = ["DataProto", "DataProtoFuture"]
__version__ = "0.1.0"
