"""The policy worker for trainer.placement=disaggregated: no rollout engine; it sends its weights
to the rollout pool's engines (engines/weight_sync/transfer.py).

Every actor rank walks the weight stream (`iter_hf_tensors` is collective over the model-parallel
group: each rank gathers full tensors); rank 0 sends them, the others only take part.
"""

from hybridflow.single_controller import Dispatch, register
from hybridflow.single_controller.worker import free_port
from hybridflow.workers.policy import PolicyWorker


class TransferPolicyWorker(PolicyWorker):
    sender = None  # rank 0's WeightSender once the transfer group is joined

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def transfer_address(self) -> tuple[str, int]:
        """Where the transfer group meets: this node's address and a free port (rank 0 hosts it)."""
        return self.master_addr, free_port()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_transfer(self, host: str, port: int, size: int) -> None:
        """Rank 0 hosts the transfer group's rendezvous and becomes its sender."""
        if self.rank != 0:
            return
        import torch

        from engines.weight_sync.transfer import WeightSender, transfer_group

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        group = transfer_group(host, port, 0, size, backend)
        self.sender = WeightSender(group, bucket_mb=self.config.rollout.weight_sync_bucket_mb)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights(self, version: int) -> None:
        """The current weights to every rollout engine, as policy `version` (collective)."""
        from engines.megatron.weights import iter_hf_tensors

        stream = iter_hf_tensors(self.actor_chunks, self.hf_config)
        if self.sender is not None:
            self.sender.send(stream, version)
        else:
            for _ in stream:  # the stream's gathers need every model-parallel rank
                pass
