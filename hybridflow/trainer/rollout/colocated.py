"""The hybrid engine as the driver sees it: rollout engines in the policy's own processes.

A sync reshards the actor's Megatron shards into the engines in memory
(`HybridPolicyWorker.sync_rollout_weights`: the worker streams the HF-named tensors unless its
engines hold that version already). The engines give their memory back to the policy before its
next computation, and with `rollout.free_cache_engine` that drops the weights too; the next sync
then streams them again.
"""

from hybridflow.protocol import DataProto
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.prompts import PromptBatches, StepPrompts
from hybridflow.trainer.rollout.unread import report_unread
from hybridflow.workers.protocols import HybridPolicyGroup


class ColocatedRollout:
    def __init__(self, group: HybridPolicyGroup):
        self.group = group  # the policy's workers, which also hold the engines

    def sync_weights(self, policy: Policy) -> None:
        self.group.sync_rollout_weights(policy.version)

    def responses(self, prompts: PromptBatches, steps_left: int) -> tuple[StepPrompts, DataProto]:
        step = prompts.next()
        return step, self.generate(step.rows)

    def generate(self, rows: DataProto) -> DataProto:
        return self.group.generate_sequences(rows)

    def metrics(self, batch: DataProto) -> dict[str, float]:
        return {}

    def save(self, path: str) -> None:
        """Each engine's sampling position, so a resumed run samples alike."""
        self.group.save_rollout_state(path)

    def load(self, path: str) -> None:
        """What `save` wrote; a rollout pool's prompts drawn ahead, which this one cannot take, named."""
        self.group.load_rollout_state(path)
        report_unread(path, reads=None)
