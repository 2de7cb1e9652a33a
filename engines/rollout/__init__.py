"""Rollout engines and the hybrid engine's switch to generation (the weight sync: `engines.weight_sync`).

Import the submodule you need; this package imports nothing on its own, so that the recipe schema
can import `engines.rollout.config` cheaply and SGLang is only imported where an engine is built.

- `config`: `RolloutConfig`, `SamplingConfig`
- `base`: the `RolloutEngine` interface, output layout, seeds
- `factory`: `create_rollout_engine`, `check_rollout_available`
- `hf_rollout`: transformers `generate` engine (CPU or CUDA)
- `sglang_rollout`: SGLang offline engine (CUDA only)
- `sharding_manager`: `MegatronRolloutShardingManager` (engine memory released and resumed, actor
  weights in through `engines.weight_sync`, data resharded)
"""
