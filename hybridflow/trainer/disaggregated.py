"""The driver's view of the actor with the rollout on its own pool (trainer.placement=disaggregated).

`DisaggregatedActorRollout` stands where the colocated actor-rollout worker group stands: every
call goes to the actor group, except generation, which goes to the rollout pool after the actor's
newest weights have been transferred there. The actor's policy version counts its updates; each
generated sample carries the version that produced it (`policy_version`), and each trained batch's
versions are appended to `<output_dir>/policy_versions.jsonl`:

    {"trained_on": 3, "sample_versions": [2, 2, 3, ...]}   # staleness = trained_on - version
"""

import json
from pathlib import Path

from hybridflow.protocol import DataProto, DataProtoFuture

VERSION_FILE = "policy_version.json"  # in the actor's checkpoint directory


def connect_transfer(actor, rollout) -> None:
    """Build the transfer group: the actor's rank 0 and one member per rollout process."""
    host, port = actor.transfer_address()
    rollout.start_join_transfer(host, port, 1 + rollout.world_size)
    actor.join_transfer(host, port, 1 + rollout.world_size)
    rollout.finish_transfer()


class DisaggregatedActorRollout:
    def __init__(self, actor, rollout, output_dir: str):
        self.actor = actor
        self.rollout = rollout
        self.versions_file = Path(output_dir) / "policy_versions.jsonl"
        self.version = 0  # of the actor's weights: the number of updates so far
        self.served: int | None = None  # of the rollout engines' weights

    def __getattr__(self, name: str):
        return getattr(self.actor, name)

    def transfer_weights(self) -> int:
        """The actor's weights into every rollout engine; the version they now serve."""
        self.rollout.start_receive_weights()
        self.actor.send_weights(self.version)
        served = set(self.rollout.finish_transfer())
        if served != {self.version}:
            sent = self.version
            raise RuntimeError(f"rollout engines serve {sorted(served)}, not the version sent ({sent})")
        self.served = self.version
        return self.served

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if self.served != self.version:
            self.transfer_weights()
        return self.rollout.generate_sequences(prompts)

    def generate_sequences_async(self, prompts: DataProto) -> DataProtoFuture:
        """Generation with the newest weights, running on the rollout pool while the driver goes on."""
        if self.served != self.version:
            self.transfer_weights()
        return self.rollout.generate_sequences_async(prompts)

    def update_actor(self, batch: DataProto) -> DataProto:
        self.record_versions(batch)
        output = self.actor.update_actor(batch)
        self.version += 1
        return output

    def save_checkpoint(self, path: str) -> None:
        """The actor's checkpoint, the engines' sampling positions and the policy version."""
        self.actor.save_checkpoint(path)
        self.rollout.save_rng_state(path)
        (Path(path) / VERSION_FILE).write_text(json.dumps({"version": self.version}))

    def load_checkpoint(self, path: str) -> None:
        """The state `save_checkpoint` wrote; the engines get the weights before they next generate.
        Without a recorded version (a colocated run's checkpoint) versions count from 0 again."""
        self.actor.load_checkpoint(path)
        self.rollout.load_rng_state(path)
        version_file = Path(path) / VERSION_FILE
        self.version = json.loads(version_file.read_text())["version"] if version_file.is_file() else 0
        self.served = None

    def record_versions(self, batch: DataProto) -> None:
        versions = batch.batch["policy_version"].tolist()
        with self.versions_file.open("a") as out:
            out.write(json.dumps({"trained_on": self.version, "sample_versions": versions}) + "\n")
