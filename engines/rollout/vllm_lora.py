"""Adapter-only weight sync into vLLM (`actor.lora.sync: adapters`, docs/lora.md): the engine
keeps the actor's frozen base weights from the first sync and, after each update, receives only
the LoRA tensors, loaded in memory as a vLLM LoRA adapter that every generate call names.

Written against vLLM 0.32.0:

  - the engine is started with `enable_lora=True`, `max_lora_rank` (one of vLLM's `MaxLoRARanks`,
    vllm/config/lora.py, at least the actor's rank: a smaller adapter is zero-padded) and
    `max_loras = max_cpu_loras = 1` (one adapter version at a time);
  - vLLM loads adapters from a directory (`WorkerLoRAManager._load_adapter`,
    vllm/lora/worker_manager.py, calls `LoRAModel.from_local_checkpoint`). Here, on the worker
    through `collective_rpc` (in this process, no copy), the same steps run on tensors already in
    memory: `PEFTHelper.from_dict(adapter_config)` and its `validate_legal`, then
    `LoRAModel.from_lora_tensors` (vllm/lora/lora_model.py), which takes peft's names; the
    adapter manager (`LRUCacheLoRAModelManager`, vllm/lora/model_manager.py) drops the previous
    version and registers the new one under a new int id;
  - `LLM.generate(..., lora_request=LoRARequest(name, id, path))`: the worker finds the id
    registered and only activates it (`LRUCacheWorkerLoRAManager.add_adapter`); the path is never
    read. An id that is not registered would be loaded from that path and fail loudly
    (LoRAAdapterNotFoundError), never generate without the adapter;
  - on CUDA between rollouts the engine sleeps at level 1 (weights kept in host memory), not 2:
    the base weights are sent once (`sleep_level`);
  - a reload of base weights (`finalize_layerwise_reload`) is followed by
    `model_runner.reset_lora_state()` (what vLLM's own weight-transfer path runs,
    v1/worker/gpu_worker.py), which removes every adapter: the engine then generates with the
    base weights it was sent until the next adapter arrives.

Nothing here imports vLLM at module level: the config validation calls the plain functions.
"""

from typing import Any

import torch

# vLLM 0.32's MaxLoRARanks (vllm/config/lora.py): max_lora_rank must be one of these.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Engine settings the rollout derives from actor.lora with adapter sync; rollout.vllm must not set them.
LORA_ENGINE_ARGS = ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")
# LoRARequest requires a path; vLLM reads it only for an id it has not registered (docstring).
IN_MEMORY_PATH = "hybridflow://in-memory-adapter"


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of rank `rank`."""
    fitting = [value for value in VLLM_MAX_LORA_RANKS if value >= rank]
    if rank < 1 or not fitting:
        raise ValueError(
            f"actor.lora.rank={rank} with actor.lora.sync=adapters: vLLM 0.32 serves LoRA ranks 1 .. "
            f"{VLLM_MAX_LORA_RANKS[-1]}; use a rank in that range or actor.lora.sync=merged"
        )
    return fitting[0]


def lora_engine_args(rank: int, user_args: dict) -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments that let the engine load the actor's adapters; ValueError
    when the recipe's `rollout.vllm` (`user_args`) sets one of them."""
    problem = _taken_lora_args(user_args)
    if problem:
        raise ValueError(problem)
    slots = {"max_loras": 1, "max_cpu_loras": 1}  # one version at a time (the previous one is dropped)
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(rank), **slots}


def sleep_level(lora_rank: int) -> int:
    """vLLM's sleep level between rollouts on CUDA: 2 drops the weights (every sync resends them
    all); with adapters synced alone the base weights arrive once, so level 1 keeps them in host
    memory and `wake_up` brings them back (vllm/entrypoints/llm.py `LLM.sleep`)."""
    return 1 if lora_rank else 2


def adapter_sync_problems(
    rank: int, rollout_name: str, vllm_args: dict, agent_loop: str, placement: str
) -> list[str]:
    """What stops `actor.lora.sync=adapters` with these settings (empty when nothing does)."""
    if rank == 0:
        return ["actor.lora.sync=adapters needs adapters: set actor.lora.rank > 0, or sync=merged"]
    if rollout_name != "vllm":
        why = {
            "hf": "the hf engine has no LoRA loading",
            "sglang": "SGLang's LoRA loading is not wired to the weight sync yet",
        }.get(rollout_name, "only vLLM's LoRA loading is wired")
        fix = "use rollout.name=vllm or actor.lora.sync=merged"
        return [f"actor.lora.sync=adapters with rollout.name={rollout_name}: {why}; {fix}"]
    problems = []
    if rank > VLLM_MAX_LORA_RANKS[-1]:
        problems.append(f"actor.lora.rank={rank} is above vLLM's largest LoRA rank {VLLM_MAX_LORA_RANKS[-1]}")
    if taken := _taken_lora_args(vllm_args):
        problems.append(taken)
    if agent_loop != "single_turn":
        problems.append(
            f"actor.lora.sync=adapters with rollout.agent.loop={agent_loop}: request-level generation "
            "does not pass the adapter to vLLM yet; use actor.lora.sync=merged"
        )
    if placement != "colocated":
        problems.append(
            f"actor.lora.sync=adapters with trainer.placement={placement}: the weight transfer to "
            "separate rollout devices sends merged weights only; use actor.lora.sync=merged"
        )
    return problems


def _taken_lora_args(user_args: dict) -> str | None:
    taken = [key for key in LORA_ENGINE_ARGS if key in user_args]
    if not taken:
        return None
    return (
        f"rollout.vllm sets {taken}, which actor.lora.sync=adapters derives from actor.lora "
        "(enable_lora, max_lora_rank >= rank, one adapter slot); remove them"
    )


class AdapterSlot:
    """The one adapter version a vLLM engine generates with: `request` is None until the first
    adapter is loaded (and again after a base-weight reload), then names the current version."""

    def __init__(self):
        self.version = 0
        self.request = None

    def load(self, llm, tensors: dict[str, torch.Tensor], adapter_config: dict) -> None:
        """Register the adapters (peft names and shapes, whole) as the next version, replacing the
        previous one so that vLLM's adapter cache never grows."""
        from vllm.lora.request import LoRARequest

        version = self.version + 1
        llm.collective_rpc(_replace_adapter, args=(tensors, adapter_config, version))
        self.version = version
        self.request = LoRARequest(f"actor_v{version}", version, IN_MEMORY_PATH)

    def clear(self) -> None:
        """Forget the adapter (the engine dropped it with its base-weight reload)."""
        self.request = None


def _replace_adapter(worker, tensors: dict[str, torch.Tensor], adapter_config: dict, adapter_id: int) -> None:
    """On vLLM's worker: build the adapter from in-memory tensors, as `_load_adapter` does from a
    directory, and make it the only registered one."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager  # LRUCacheWorkerLoRAManager
    peft_helper = PEFTHelper.from_dict({**adapter_config, "vllm_max_position_embeddings": None})
    peft_helper.validate_legal(manager.lora_config)
    adapter = manager._lora_model_cls.from_lora_tensors(
        adapter_id,
        tensors,
        peft_helper,
        device="cpu",  # vLLM's own loader builds adapters on CPU too; activation copies them
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
    )
    unexpected = _unexpected_modules(manager, adapter.loras)
    if unexpected:  # vLLM would skip them silently when activating the adapter
        raise ValueError(f"LoRA adapters on modules {unexpected[:3]} that vLLM's model has no LoRA layer for")
    manager.remove_all_adapters()
    if not manager._adapter_manager.add_adapter(adapter):
        raise RuntimeError(f"vLLM did not register LoRA adapter {adapter_id}")


def _unexpected_modules(manager, module_names) -> list[str]:
    """The adapted modules whose last name part the model has no LoRA layer for: the check
    `LoRAModel.from_local_checkpoint` runs on a directory's tensors (vllm/lora/lora_model.py), with
    the expected names `WorkerLoRAManager._load_adapter` builds (packed modules unpacked)."""
    models = manager._adapter_manager
    expected = set()
    for module in models.supported_lora_modules:
        expected.update(models.packed_modules_mapping.get(module, [module]))
    return [name for name in module_names if name.rsplit(".", 1)[-1] not in expected]


def reset_adapters(worker) -> None:
    """On vLLM's worker after a base-weight reload: drop every adapter (vLLM's own weight-transfer
    path does the same, v1/worker/gpu_worker.py); a no-op without LoRA."""
    worker.model_runner.reset_lora_state()
