"""The driver's policy handle: the actor worker group as the training loop uses it.

    policy.log_probs(batch)        old log-probs and entropy of the responses
    policy.update(batch)           PPO epochs; `version` counts the updates applied
    policy.save(path) / load(path) / export_hf(out_dir)

`version` is the number of updates that changed the weights: an update all of whose optimizer
steps the guards refused (a NaN / inf grad norm, or beyond max_update_ratio) leaves it as it
was, so no rollout engine re-syncs for it and no sample is counted staler for it. The rollout
handle reads it when it syncs (hybridflow/trainer/rollout/). The frozen reference lives in the
same workers; its handle is `handles.Reference` over this group.
"""

import json
from pathlib import Path

from hybridflow.protocol import DataProto
from hybridflow.utils.nonfinite import REFUSED_SUFFIX, SKIPPED_SUFFIX
from hybridflow.workers.protocols import HybridPolicyGroup, TransferPolicyGroup

VERSION_FILE = "policy_version.json"  # in the policy's checkpoint directory


def update_applied(worker_metrics: dict[str, list[float]], role: str = "actor") -> bool:
    """Whether any optimizer step of an update was applied. Every step reports `<role>/
    nonfinite_skipped` (0 or 1); the steps with a finite grad norm checked against a bound also
    report `<role>/update_refused` (0 or 1)."""
    skipped = worker_metrics.get(role + SKIPPED_SUFFIX, [])
    refused = worker_metrics.get(role + REFUSED_SUFFIX, [])
    return len(skipped) == 0 or sum(skipped) + sum(refused) < len(skipped)


class Policy:
    def __init__(self, group: HybridPolicyGroup | TransferPolicyGroup):
        self.group = group  # the policy workers (hybridflow/workers/policy.py and subclasses)
        self.version = 0

    def log_probs(self, batch: DataProto) -> DataProto:
        return self.group.compute_log_prob(batch)

    def update(self, batch: DataProto) -> DataProto:
        """PPO epochs over the batch; metrics in meta_info["metrics"]."""
        output = self.group.update_actor(batch)
        if update_applied(output.meta_info.get("metrics", {})):
            self.version += 1
        return output

    def train_sft(self, batch: DataProto) -> DataProto:
        """One supervised step (the SFT mode); metrics in meta_info["metrics"]."""
        output = self.group.train_sft(batch)
        if update_applied(output.meta_info.get("metrics", {}), role="sft"):
            self.version += 1
        return output

    def send_weights(self) -> list | None:
        """The current weights to a rollout pool's transfer group, as `version` (collective); each
        rank's answer (rank 0's: what it sent, a DeltaStats)."""
        return self.group.send_weights(self.version)

    def save(self, path: str) -> None:
        """Model, optimizer, LR schedule and RNG (a Megatron dist checkpoint) and the version."""
        self.group.save_checkpoint(path)
        (Path(path) / VERSION_FILE).write_text(json.dumps({"version": self.version}))

    def load(self, path: str) -> None:
        """What `save` wrote; a checkpoint without a version (older runs) counts from 0 again."""
        self.group.load_checkpoint(path)
        version_file = Path(path) / VERSION_FILE
        self.version = json.loads(version_file.read_text())["version"] if version_file.is_file() else 0

    def export_hf(self, out_dir: str) -> None:
        self.group.export_hf(out_dir)
