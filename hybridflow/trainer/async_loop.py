"""Generation ahead of training: trainer.async_training.mode one_step, and async with
max_staleness N (docs/async.md).

`PPOTrainer.step()` is unchanged; this loop stands beside it, between the trainer and the actor
view of the disaggregated placement (hybridflow/trainer/disaggregated.py), keeping up to `depth`
batches generating ahead (one_step: 1; async: max_staleness):

    step k:  responses to P_k  <- the generation launched `depth` steps earlier (or generated now)
             launch generations until `depth` are in flight, each with the newest weights
             (the actor's version k-1 at the start of step k)
             log-probs, reward, advantages, update of batch k   (launched batches generate meanwhile)

Batch k+depth is generated with the weights of step k and trained on at step k+depth: a sample is
at most `depth` versions stale (exactly `depth` once the pipeline is full), so nothing has to be
dropped. depth 0 is the synchronous loop itself: no call differs. The prompts of launched batches
are drawn from the loader ahead; the trainer's `next_batch` hands them out in order.

A weight transfer to the rollout pool waits for the generations queued there before it (the
rollout worker runs one call at a time), so with depth > 1 a step also waits for the older
launched batches to finish: the overlap is one batch's generation per step, the staleness `depth`.
With partial rollouts the launched batches generate side by side and a transfer lands between two
of their decoding steps (hybridflow/workers/rollout_worker.py); nothing changes here: a sample's
version is its oldest token's, still at most `depth` behind.

Overlap: every generated row carries its rollout process's `generation_window` (B, 2), wall-clock
start and end; the loop keeps the windows of its own work on each step (from the batch's arrival
to the end of the actor's update) and reports, with each update, how many seconds of the batch's
generation ran during earlier steps' work (`timing/gen_overlap`, `perf/gen_overlap_share` of
`timing/rollout_gen`).

Checkpoints: what is in flight is saved (finished first), not discarded; see `save_checkpoint`.
"""

import time
from collections import deque
from pathlib import Path

import torch

from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.trainer.validation import PROMPT_KEYS

AHEAD_FILE = "generation_ahead.pt"  # in the actor's checkpoint directory


def generation_prompts(batch_dict: dict, n: int) -> DataProto:
    """The rows the trainer's `generate` sends to the engines for a batch of prompts."""
    prompts = DataProto.from_single_dict(batch_dict).pop(batch_keys=PROMPT_KEYS)
    prompts.meta_info["n"] = 1  # the driver repeats the prompts itself
    return prompts.repeat(n, interleave=True)


def overlap_seconds(window: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """Seconds of `window` (start, end) inside the disjoint intervals `others`."""
    start, end = window
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in others)


def generation_depth(cfg) -> int:
    """Batches generating ahead of the one trained: one_step 1, async max_staleness, sync 0."""
    settings = cfg.trainer.async_training
    return {"sync": 0, "one_step": 1, "async": settings.max_staleness}[settings.mode]


class GenerationAhead:
    """The trainer's actor view in one_step / async mode: a step's generation call is answered by
    the generation launched for its prompts `depth` steps earlier."""

    def __init__(self, trainer, actor_rollout, depth: int):
        self.trainer = trainer
        self.actor_rollout = actor_rollout
        self.depth = depth
        self.draw_batch = trainer.next_batch  # the loader's next batch
        self.prefetched: deque[dict] = deque()  # the next steps' prompts, drawn already
        # their rows and responses (finished ones after a checkpoint)
        self.pending: deque[tuple[DataProto, DataProtoFuture | DataProto]] = deque()
        self.work_windows: list[tuple[float, float]] = []  # the driver's work on each step (wall clock)
        self.step_start = 0.0  # when the step's batch arrived (wall clock)

    @classmethod
    def attach(cls, trainer) -> "GenerationAhead":
        """Put the loop between `trainer` and its actor view, and behind its `next_batch`."""
        loop = cls(trainer, trainer.roles.actor_rollout, generation_depth(trainer.cfg))
        trainer.roles.actor_rollout = loop
        trainer.next_batch = loop.next_batch
        return loop

    def __getattr__(self, name: str):
        return getattr(self.actor_rollout, name)

    def next_batch(self) -> dict:
        return self.prefetched.popleft() if self.prefetched else self.draw_batch()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The step's responses (validation and baselines: generated now, with the newest weights)."""
        if prompts.meta_info.get("validate", False):
            return self.actor_rollout.generate_sequences(prompts)
        responses = self.collect(prompts) if self.pending else self.actor_rollout.generate_sequences(prompts)
        self.fill()
        self.step_start = time.time()
        return responses

    def update_actor(self, batch: DataProto) -> DataProto:
        """The actor's update; its metrics gain the overlap of the batch's generation."""
        overlap = self.generation_overlap(batch)
        output = self.actor_rollout.update_actor(batch)
        self.work_windows.append((self.step_start, time.time()))
        metrics = output.meta_info.setdefault("metrics", {})
        metrics.update({key: [value] for key, value in overlap.items()})
        return output

    def generation_overlap(self, batch: DataProto) -> dict[str, float]:
        """Seconds of the batch's generation (first start to last end over the rollout processes)
        that ran while the driver worked on earlier steps."""
        windows = batch.batch["generation_window"]  # (B, 2)
        start, end = windows[:, 0].min().item(), windows[:, 1].max().item()
        # batches are launched in order: no later batch's generation starts before this one's
        self.work_windows = [window for window in self.work_windows if window[1] > start]
        overlap = overlap_seconds((start, end), self.work_windows)
        seconds = end - start
        return {
            "timing/rollout_gen": seconds,
            "timing/gen_overlap": overlap,
            "perf/gen_overlap_share": overlap / seconds if seconds > 0 else 0.0,
        }

    def collect(self, prompts: DataProto) -> DataProto:
        """The oldest launched generation's output, once it is checked to be for these very prompts."""
        launched, responses = self.pending.popleft()
        if not torch.equal(launched.batch["input_ids"], prompts.batch["input_ids"]):
            raise RuntimeError("generation ahead: the step's prompts are not the ones generated for it")
        return self.collect_later(responses)

    def launched_up_to(self) -> int:
        """The last step whose prompts are generated or generating."""
        return self.trainer.global_step + len(self.pending)

    def fill(self) -> None:
        """Launch the next steps' generations with the current weights, up to `depth` in flight
        and never beyond the last step."""
        while (
            len(self.pending) < self.depth
            and self.trainer.global_step + len(self.pending) < self.trainer.total_steps
        ):
            batch_dict = self.draw_batch()
            self.prefetched.append(batch_dict)
            prompts = generation_prompts(batch_dict, self.trainer.cfg.rollout.sampling.n)
            self.pending.append((prompts, self.actor_rollout.generate_sequences_async(prompts)))

    def save_checkpoint(self, path: str) -> None:
        """In flight is saved, not discarded: the launched generations are waited for and written
        with the checkpoint (their prompts were drawn from the loader already), so a resumed run
        trains on the very samples the uninterrupted one does."""
        self.pending = deque((prompts, self.collect_later(responses)) for prompts, responses in self.pending)
        self.actor_rollout.save_checkpoint(path)
        state = {"prefetched": list(self.prefetched), "pending": list(self.pending)}
        torch.save(state, Path(path) / AHEAD_FILE)

    @staticmethod
    def collect_later(responses: DataProtoFuture | DataProto) -> DataProto:
        return responses.get() if isinstance(responses, DataProtoFuture) else responses

    def load_checkpoint(self, path: str) -> None:
        self.actor_rollout.load_checkpoint(path)
        saved = Path(path) / AHEAD_FILE
        if saved.is_file():  # absent in a synchronous run's checkpoint: nothing was ahead
            state = torch.load(saved, weights_only=False)  # our own file: DataProtos, prompt rows
            self.prefetched, self.pending = deque(state["prefetched"]), deque(state["pending"])
