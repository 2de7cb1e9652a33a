"""LoRA adapters alone into the engine (`actor.lora.sync=adapters`, vLLM; docs/lora.md).

    sync = AdapterWeightSync(colocated_sync, adapter_sync_config(actor_chunks, hf_config))
    stats = sync.sync()                   # collective over all ranks; -> SyncStats

The first sync streams the frozen base weights (the colocated stream inside `adapters_disabled`,
which then yields the unmerged base tensors); every sync, that first one included, gathers the
adapters whole on every rank (`lora.iter_lora_tensors`, peft names) and each engine loads them as
its new LoRA adapter (engines/rollout/vllm_lora.py). A failure there stops every rank with a
WeightSyncError.
"""

import time

from engines.weight_sync.colocated import ColocatedWeightSync, SyncStats, raise_on_every_rank
from engines.weight_sync.common import tensor_nbytes


def adapter_sync_config(actor_chunks, hf_config) -> dict | None:
    """peft's adapter config of the actor's adapters when they are synced alone
    (`actor.lora.sync=adapters`), else None (the weights are synced merged)."""
    from engines.megatron.lora import peft_adapter_config
    from engines.megatron.model import unwrap_model

    lora = getattr(unwrap_model(actor_chunks[0]), "lora_config", None)
    if lora is None or not lora.rank or lora.sync != "adapters":
        return None
    return peft_adapter_config(lora, str(hf_config.source_dir))


class AdapterWeightSync:
    """The base weights once through `base`, then the actor's LoRA adapters at every sync."""

    def __init__(self, base: ColocatedWeightSync, adapter_config: dict):
        self.base = base
        self.adapter_config = adapter_config  # peft's adapter_config.json, as the engine loads it
        self._base_synced = False

    def sync(self) -> SyncStats:
        """Bring the engine to the actor's weights (collective over all ranks)."""
        from engines.megatron.lora import adapters_disabled

        start = time.perf_counter()
        base = SyncStats(tensors=0, bytes=0, seconds=0.0)
        if not self._base_synced:
            with adapters_disabled(self.base.actor_chunks):  # the stream is then the unmerged base
                base = self.base.sync()
            self._base_synced = True
        count, nbytes = self._send_adapters()
        if self.base.cfg.verify_weight_sync:
            self.base.verify_log_probs()
        seconds = time.perf_counter() - start
        return SyncStats(tensors=base.tensors + count, bytes=base.bytes + nbytes, seconds=seconds)

    def _send_adapters(self) -> tuple[int, int]:
        """Gather the whole adapters (peft names) on every rank and load them into this rank's
        engine as its new LoRA adapter; the tensor count and bytes sent."""
        from engines.megatron.lora import iter_lora_tensors

        tensors = dict(iter_lora_tensors(self.base.actor_chunks))
        failure = None
        if self.base.engine is not None:
            try:
                self.base.engine.load_adapter(tensors, self.adapter_config)
            except (ValueError, RuntimeError) as err:
                failure = f"loading the LoRA adapters into {self.base.cfg.name}: {err}"
        raise_on_every_rank(failure, "adapter sync")
        return len(tensors), sum(tensor_nbytes(tensor) for tensor in tensors.values())
