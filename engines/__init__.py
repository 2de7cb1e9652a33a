"""Compute engines: Megatron-Core training (`engines.megatron`) and rollout (`engines.rollout`).

Only this package imports Megatron-Core or SGLang, and only inside the submodules that need them.
"""
