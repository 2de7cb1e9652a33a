"""A rollout pool of its own (trainer.placement=disaggregated), as the driver sees it.

A sync transfers the policy's weights from the actor's rank 0 to every rollout engine over the
transfer group (hybridflow/workers/rollout_worker.py, engines/weight_sync/transfer.py), only when the engines
do not serve the policy's version already. Each generated sample carries the version that produced
it (`policy_version`), and each trained batch's versions are appended to
`<output_dir>/policy_versions.jsonl`:

    {"trained_on": 3, "sample_versions": [2, 2, 3, ...]}   # staleness = trained_on - version

`metrics` gives `async/staleness_mean`, `async/staleness_max`, the histogram `async/staleness/<s>`
(share of samples s updates old) and, with partial rollouts (a sample's version is that of its
oldest token), `async/mixed_version_share`: the share of samples whose tokens come from more than
one version (`rollout_versions`, per token).

A rollout process that dies (killed, out of memory, a lost node) ends the run with one
`RolloutProcessDied` naming the process and the call, whatever call meets it first: a generation,
its collection, or a transfer (whose sender then fails on the closed connection: the pool is
asked whether a process died before that error is believed).
"""

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.single_controller.errors import WorkerError
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.prompts import PromptBatches, StepPrompts
from hybridflow.utils.imports import first_line


class RolloutProcessDied(RuntimeError):
    """A rollout pool process died; the run stops (the last complete checkpoint stays)."""


def process_died(err: WorkerError) -> bool:
    """Whether a worker-group error is Ray's word that the worker process died."""
    import ray.exceptions

    return isinstance(err, ray.exceptions.RayActorError)


@contextmanager
def naming_dead_processes() -> Iterator[None]:
    """A rollout process's death, met by any call in the block, as one RolloutProcessDied."""
    try:
        yield
    except WorkerError as err:
        if not process_died(err):
            raise
        raise RolloutProcessDied(
            f"rollout pool process {err.rank} died during `{err.method}` (trainer.rollout_pool): "
            f"{first_line(err.cause)}; rerun the same command to resume from the last checkpoint"
        ) from err


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


def connect_transfer(policy_group, rollout_group) -> None:
    """Build the transfer group: the actor's rank 0 and one member per rollout process."""
    host, port = policy_group.transfer_address()
    rollout_group.start_join_transfer(host, port, 1 + rollout_group.world_size)
    policy_group.join_transfer(host, port, 1 + rollout_group.world_size)
    rollout_group.finish_transfer()


class PoolRollout:
    def __init__(self, group, output_dir: str):
        self.group = group  # the rollout workers
        self.versions_file = Path(output_dir) / "policy_versions.jsonl"
        self.served: int | None = None  # the version the engines serve

    def sync_weights(self, policy: Policy) -> None:
        if self.served == policy.version:
            return
        self.served = None  # a failed transfer leaves the engines serving no known version
        with naming_dead_processes():
            self.group.start_receive_weights()
            self.send(policy)
            served = set(self.group.finish_transfer())
        if served != {policy.version}:
            raise RuntimeError(
                f"rollout engines serve {sorted(served)}, not the version sent ({policy.version})"
            )
        self.served = policy.version

    def send(self, policy: Policy) -> None:
        """The policy's side of a transfer; when it fails, a dead receiver is the cause named."""
        try:
            policy.send_weights()
        except WorkerError:
            self.group.ping()  # raises for a dead rollout process (the sender's error is its echo)
            raise

    def responses(self, prompts: PromptBatches, steps_left: int) -> tuple[StepPrompts, DataProto]:
        step = prompts.next()
        return step, self.generate(step.rows)

    def generate(self, rows: DataProto) -> DataProto:
        with naming_dead_processes():
            return self.group.generate_sequences(rows)

    def launch(self, rows: DataProto) -> DataProtoFuture:
        """Generation on the pool while the driver goes on (the rollout generating ahead)."""
        return self.group.generate_sequences_async(rows)

    def collect(self, launched: DataProtoFuture | DataProto) -> DataProto:
        """A launched generation's responses, once finished."""
        if not isinstance(launched, DataProtoFuture):
            return launched
        with naming_dead_processes():
            return launched.get()

    def metrics(self, batch: DataProto) -> dict[str, float]:
        """The batch's staleness against the version trained on (the one served since the last
        sync), recorded in policy_versions.jsonl."""
        versions = batch.batch["policy_version"].tolist()
        with self.versions_file.open("a") as out:
            out.write(json.dumps({"trained_on": self.served, "sample_versions": versions}) + "\n")
        metrics = staleness_metrics(self.served, versions)
        if "rollout_versions" in batch.batch:  # partial rollouts
            metrics["async/mixed_version_share"] = mixed_version_share(batch.batch["rollout_versions"])
        return metrics

    def save(self, path: str) -> None:
        """Each engine's sampling position."""
        self.group.save_rng_state(path)

    def load(self, path: str) -> None:
        self.group.load_rng_state(path)
        self.served = None
