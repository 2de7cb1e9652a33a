"""The policy worker for trainer.placement=disaggregated: no rollout engine; it sends its weights
to the rollout pool's engines (engines/weight_sync/transfer.py).

Every actor rank walks the weight stream (`iter_hf_tensors` is collective over the model-parallel
group: each rank gathers full tensors); rank 0 sends them, the others only take part.

After a rollout process died, rank 0 closes its end of the broken transfer group (`leave_transfer`:
closing its connections ends a survivor's receive under way) and joins a new one; the restarted
engine is then checked against the actor's log-probs of fixed tokens (`probe_log_probs`).
"""

from hybridflow.single_controller import Dispatch, register
from hybridflow.workers.policy import PolicyWorker


class TransferPolicyWorker(PolicyWorker):
    sender = None  # rank 0's WeightSender once the transfer group is joined
    transfer_store = None  # rank 0's rendezvous store, from transfer_address until join_transfer

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def transfer_address(self) -> tuple[str, int]:
        """Where the transfer group meets: this node's address and the port of the store rank 0
        hosts there from now on (held until join_transfer builds the group on it)."""
        from engines.weight_sync.transfer import sender_store

        self.transfer_store = sender_store(self.master_addr)
        return self.master_addr, self.transfer_store.port

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_transfer(self, host: str, port: int, size: int) -> None:
        """Rank 0 hosts the transfer group's rendezvous and becomes its sender."""
        if self.rank != 0:
            return
        import torch

        from engines.weight_sync.delta import delta_dtype
        from engines.weight_sync.transfer import WeightSender, transfer_group

        if self.transfer_store is None:
            raise RuntimeError("join_transfer on rank 0 needs transfer_address first: rank 0 hosts its store")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store, self.transfer_store = self.transfer_store, None  # the group holds it from here
        group = transfer_group(host, port, 0, size, backend, store=store)
        rollout = self.config.rollout
        self.sender = WeightSender(group, rollout.weight_sync_bucket_mb, delta_dtype=delta_dtype(rollout))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights(self, version: int):
        """The current weights to every rollout engine, as policy `version` (collective); rank 0
        answers what it sent (a DeltaStats), the others None."""
        from engines.megatron.weights import iter_hf_tensors

        stream = iter_hf_tensors(self.actor_chunks, self.hf_config)
        if self.sender is None:
            for _ in stream:  # the stream's gathers need every model-parallel rank
                pass
            return None
        self.sender.send(stream, version)
        return self.sender.stats

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def leave_transfer(self) -> None:
        """Rank 0 closes its transfer group (its connections close) and a store it still holds from
        `transfer_address`; `join_transfer` builds a new one."""
        if self.sender is not None:
            self.sender.group.close()
        self.sender = self.transfer_store = None

    def teardown(self) -> None:
        """Close the transfer group (TransferGroup.close: not left to the process's exit)."""
        self.leave_transfer()
        super().teardown()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def probe_log_probs(self) -> tuple[list[list[int]], object] | None:
        """Fixed token sequences and the actor's log-probs of their response tokens (B, R) at
        temperature 1 (collective; the last pipeline stage's rank 0 answers, the others None)."""
        from engines.megatron.forward import compute_log_prob
        from engines.weight_sync.colocated import log_prob_probe

        probe = log_prob_probe(self.hf_config.vocab_size)
        result = compute_log_prob(self.actor_chunks, probe, len(probe), calculate_entropy=False)
        if result is None:
            return None
        return probe.batch["input_ids"].tolist(), result.batch["old_log_probs"]
