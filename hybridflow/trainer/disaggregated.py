"""The driver's view of the actor with the rollout on its own pool (trainer.placement=disaggregated).

`DisaggregatedActorRollout` stands where the colocated actor-rollout worker group stands: every
call goes to the actor group, except generation, which goes to the rollout pool after the actor's
newest weights have been transferred there. The actor's policy version counts its updates; each
generated sample carries the version that produced it (`policy_version`), and each trained batch's
versions are appended to `<output_dir>/policy_versions.jsonl`:

    {"trained_on": 3, "sample_versions": [2, 2, 3, ...]}   # staleness = trained_on - version

and each step's metrics gain `async/staleness_mean`, `async/staleness_max`, the histogram
`async/staleness/<s>` (share of samples s updates old) and `timing/weight_transfer`. With partial
rollouts a sample's version is that of its oldest token, and `async/mixed_version_share` is the
share of samples whose tokens come from more than one version (`rollout_versions`, per token).
"""

import json
import time
from collections import Counter
from pathlib import Path

import torch

from hybridflow.protocol import DataProto, DataProtoFuture

VERSION_FILE = "policy_version.json"  # in the actor's checkpoint directory


def staleness_metrics(trained_on: int, sample_versions: list[int]) -> dict[str, float]:
    """How many updates behind the trained policy the batch's samples are: mean, max, and the
    share of samples at each staleness (a histogram, `async/staleness/<s>`)."""
    staleness = [trained_on - version for version in sample_versions]
    shares = {f"async/staleness/{s}": n / len(staleness) for s, n in sorted(Counter(staleness).items())}
    return {
        "async/staleness_mean": sum(staleness) / len(staleness),
        "async/staleness_max": float(max(staleness)),
        **shares,
    }


def mixed_version_share(versions: torch.Tensor) -> float:
    """Share of rows sampled by more than one policy version; `versions` (B, R) holds each response
    token's version, -1 where no token was sampled."""
    sampled = versions >= 0  # (B, R)
    newest = versions.max(dim=1).values  # (B,)
    oldest = versions.masked_fill(~sampled, torch.iinfo(versions.dtype).max).min(dim=1).values  # (B,)
    return (newest > oldest).float().mean().item()


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
        self.transfer_seconds = 0.0  # since the last update

    def __getattr__(self, name: str):
        return getattr(self.actor, name)

    def transfer_weights(self) -> int:
        """The actor's weights into every rollout engine; the version they now serve."""
        start = time.perf_counter()
        self.rollout.start_receive_weights()
        self.actor.send_weights(self.version)
        served = set(self.rollout.finish_transfer())
        if served != {self.version}:
            sent = self.version
            raise RuntimeError(f"rollout engines serve {sorted(served)}, not the version sent ({sent})")
        self.served = self.version
        self.transfer_seconds += time.perf_counter() - start
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
        """The actor's update; its metrics gain the batch's staleness and the seconds spent on weight
        transfers since the previous update (`timing/weight_transfer`)."""
        versions = self.record_versions(batch)
        output = self.actor.update_actor(batch)
        extra = {**staleness_metrics(self.version, versions), "timing/weight_transfer": self.transfer_seconds}
        if "rollout_versions" in batch.batch:  # partial rollouts
            extra["async/mixed_version_share"] = mixed_version_share(batch.batch["rollout_versions"])
        output.meta_info.setdefault("metrics", {}).update({key: [value] for key, value in extra.items()})
        self.version += 1
        self.transfer_seconds = 0.0
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

    def record_versions(self, batch: DataProto) -> list[int]:
        versions = batch.batch["policy_version"].tolist()
        with self.versions_file.open("a") as out:
            out.write(json.dumps({"trained_on": self.version, "sample_versions": versions}) + "\n")
        return versions
