"""Settings of the rollout engines (SGLang's names where SGLang has one)."""

from dataclasses import dataclass, field


@dataclass
class SamplingConfig:
    """How responses are sampled; validation uses its own (greedy by default)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    do_sample: bool = True


@dataclass
class RolloutConfig:
    """Which engine generates, and how weights reach it."""

    name: str = "hf"  # "hf" (transformers generate, CPU or CUDA) | "sglang" (CUDA only)
    tensor_model_parallel_size: int = 1
    dtype: str = "float32"
    response_length: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    val_sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(n=1, temperature=0.0, do_sample=False)
    )
    weight_sync_bucket_mb: int = 512
    verify_weight_sync: bool = False  # checksum every tensor on both sides at every sync
    gpu_memory_utilization: float = 0.5  # SGLang mem_fraction_static
    free_cache_engine: bool = True  # release the engine's memory after generation
