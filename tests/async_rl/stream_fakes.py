"""Fake rollout engines on a virtual clock behind the real PoolRollout and StreamingRollout, for
the stream-mode tests (tests/async_rl/test_stream_rollout.py, test_pool_records.py): a group
finishes `length(problem)` ticks after it starts, its tokens of the version served when it was
submitted; a training step (`train_step`) advances the clock by TRAIN_TICKS, a direct call on
every rank (validation) by VALIDATION_TICKS while the groups in flight generate on."""

from types import SimpleNamespace

import numpy as np
import ray.exceptions
import torch

from hybridflow.protocol import DataProto
from hybridflow.single_controller.errors import worker_error
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.ppo_trainer import PPOTrainer
from hybridflow.trainer.prompts import PromptBatches
from hybridflow.trainer.rollout.pool import PoolRollout
from hybridflow.trainer.rollout.stream import StreamingRollout, StreamSettings

PROMPTS, N, TRAIN_TICKS = 4, 2, 10  # prompts per step (train_batch_size), samples per prompt
VALIDATION_TICKS = 10 * TRAIN_TICKS  # long enough for some of the long groups in flight to end


def length(problem: int) -> int:
    """Ticks a group of `problem` generates: mostly short, every fifth one very long."""
    return 12 * TRAIN_TICKS if problem % 5 == 4 else 1 + problem % 3


class Engines:
    """The rollout pool's processes on a virtual clock; `serving` is the version last transferred."""

    def __init__(self, ranks: int = 2):
        self.ranks, self.clock, self.serving = ranks, 0, None
        self.calls: dict[int, dict] = {}  # handle -> rank, rows, version, end
        self.submitted: list[dict] = []  # every call, in submission order
        self.dead: set[int] = set()  # ranks whose process died
        self.handles = 0

    def submit(self, rows: DataProto) -> tuple[int, int]:
        rank = self.handles % self.ranks
        self.handles += 1
        problem = int(rows.batch["input_ids"][0, -1])
        end = self.clock + length(problem)
        call = {"rank": rank, "rows": rows, "version": self.serving, "start": self.clock, "end": end}
        self.calls[self.handles] = call
        self.submitted.append(call)
        return self.handles, rank

    def wait(self, handles: list, block: bool = True) -> list:
        if block:
            self.clock = max(self.clock, min(self.calls[h]["end"] for h in handles))
        return [h for h in handles if self.calls[h]["end"] <= self.clock]

    def kill(self, rank: int) -> None:
        """The process of `rank` dies: its calls in flight are lost."""
        self.dead.add(rank)
        for call in self.calls.values():
            call["lost"] = call.get("lost", False) or call["rank"] == rank

    def result(self, handle) -> DataProto:
        call = self.calls.pop(handle)
        if call["rank"] in self.dead or call.get("lost"):
            raise worker_error(ray.exceptions.RayActorError(), call["rank"], "generate_sequences")
        rows = call["rows"]
        problem = rows.batch["input_ids"][:, -1:].clone()  # (n, 1): the problem the rows ask
        window = torch.tensor([[float(call["start"]), float(call["end"])]]).repeat(len(rows), 1)  # (n, 2)
        batch = {
            "prompts": rows.batch["input_ids"],
            "responses": problem,
            "policy_version": torch.full((len(rows),), call["version"]),  # (n,)
            "generation_window": window,
        }
        return DataProto.from_dict(batch, meta_info=dict(rows.meta_info))  # as the engines' output

    def forget(self, handle) -> None:
        self.calls.pop(handle, None)


class RolloutGroup:
    """The pool's side of a transfer (the engines serve the version sent) and its checkpoint."""

    def __init__(self, engines: Engines):
        self.engines = engines

    def start_receive_weights(self) -> None:
        pass

    def send(self, version: int) -> None:
        self.engines.serving = version

    def finish_transfer(self) -> list[int]:
        return [self.engines.serving]

    def generate_sequences(self, rows: DataProto) -> DataProto:
        """A call on every rank (validation): VALIDATION_TICKS, during which the groups in flight
        generate on; responses of the version served."""
        self.engines.clock += VALIDATION_TICKS
        versions = torch.full((len(rows),), self.engines.serving)  # (B,)
        batch = {"responses": rows.batch["input_ids"][:, -1:], "policy_version": versions}
        return DataProto.from_dict(batch, meta_info=dict(rows.meta_info))

    def dead_ranks(self) -> list[int]:
        return sorted(self.engines.dead)

    def save_rng_state(self, path: str) -> None:
        pass

    def advance_rng_state(self, position: dict) -> None:
        pass

    def load_rng_state(self, path: str) -> list[dict]:
        return [{"calls": 0, "val_calls": 0}] * self.engines.ranks


class RecoveringPool(PoolRollout):
    """A pool whose dead processes restart (`recover()`, the restarted ranks)."""

    def recover(self, cause: BaseException | None = None) -> list[int]:
        restarted = sorted(self.group.engines.dead)
        self.group.engines.dead.clear()
        return restarted


class Loader:
    """Batch i asks problems PROMPTS i .. PROMPTS i + PROMPTS - 1 (each its own ground truth);
    the prompt width grows with i, so groups of different batches need padding to be joined."""

    def __init__(self):
        self.batches = 0

    def next_batch(self) -> dict:
        problems = torch.arange(PROMPTS) + PROMPTS * self.batches
        self.batches += 1
        ids = problems[:, None].repeat(1, 2 + self.batches % 3)  # (P, W)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(ids.size(1)).repeat(PROMPTS, 1),
            "ground_truth": np.array([str(p) for p in problems.tolist()], dtype=object),
        }


def stream_trainer(tmp_path, stale_groups="drop", bound=1, pool_cls=PoolRollout, loader=None):
    engines = Engines()
    group = RolloutGroup(engines)
    policy = Policy(SimpleNamespace(send_weights=group.send))
    pool = pool_cls(group, str(tmp_path))
    settings = StreamSettings(N, PROMPTS, bound, stale_groups, pad_token_id=0)
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(sampling=SimpleNamespace(n=N)),
        algorithm=SimpleNamespace(adv_estimator="grpo"),
    )
    return SimpleNamespace(
        cfg=cfg,
        global_step=0,
        total_steps=12,
        prompts=PromptBatches(loader or Loader(), N, with_rows=False),
        rollout=StreamingRollout(pool, engines, settings, clock=lambda: float(engines.clock)),
        policy=policy,
        engines=engines,
    )


def train_step(trainer) -> tuple[DataProto, dict]:
    """The loop's lines that concern the rollout: sync, responses, an update, the metrics."""
    trainer.global_step += 1
    trainer.rollout.sync_weights(trainer.policy)
    batch = PPOTrainer.generate(trainer, {})
    trainer.engines.clock += TRAIN_TICKS  # the step trains; the groups in flight generate on
    trainer.policy.version += 1
    return batch, trainer.rollout.metrics(batch)


def check_batch(batch: DataProto, trained_on: int, bound: int) -> list[int]:
    """Whole groups on their own rows, no sample staler than `bound`; the batch's problems."""
    answers = [str(p) for p in batch.batch["responses"][:, 0].tolist()]
    assert answers == list(batch.non_tensor_batch["ground_truth"]), "responses of other rows"
    uids = batch.non_tensor_batch["uid"]
    assert len(set(uids)) == PROMPTS and all(list(uids).count(u) == N for u in uids)
    staleness = trained_on - batch.batch["policy_version"]
    assert int(staleness.max()) <= bound and int(staleness.min()) >= 0
    return batch.batch["responses"][::N, 0].tolist()
