"""Multi-turn rollouts with tools (docs/agents.md). Controller side: nothing here imports
Megatron-Core, vLLM, SGLang or torch."""
