"""Generating ahead (trainer.async_training.mode one_step / async): a rollout pool kept up to
`depth` batches ahead of the batch trained on (one_step: 1; async: max_staleness - sync_every + 1).

    step k:  the driver syncs the weights of its last update (version k-1) into the pool
             responses to P_k  <- the generation launched `depth` steps earlier (or generated now)
             launch generations until `depth` are in flight, each with those newest weights
             log-probs, reward, advantages, update of batch k   (launched batches generate meanwhile)

Batch k+depth is generated with the weights of step k and trained on at step k+depth: a sample is
at most `depth` versions stale (exactly `depth` once the pipeline is full, fewer after refused
updates), so nothing has to be dropped. depth 0 is the synchronous loop itself. The prompts of
launched batches are drawn from the loader ahead (`PromptBatches.draw_ahead`); the step takes them
in order, the same objects, so a step's responses are those launched for its rows.

With trainer.async_training.sync_every k the step's sync transfers only once the engines trail the
policy by k updates (`pool.sync_due`), so a batch launched at a step may be generated with weights
up to k - 1 updates older than that step's: its staleness is at most depth + k - 1, which is k in
one_step and max_staleness in async (its depth shrinks by k - 1 for that; the recipe check refuses
sync_every > max_staleness). Validation (`generate`) first brings the engines the newest weights.

A weight transfer to the pool waits for the generations queued there before it (a rollout worker
runs one call at a time), so with depth > 1 a step also waits for the older launched batches: the
overlap is one batch's generation per step, the staleness `depth`. With partial rollouts the
launched batches generate side by side and a transfer lands between two of their decoding steps
(hybridflow/workers/rollout_worker.py); a sample's version is its oldest token's, still at most
`depth` behind.

Overlap: every generated row carries its rollout process's `generation_window` (B, 2), wall-clock
start and end; the loop keeps the windows of the driver's work on each step (from the batch's
arrival to its `metrics`, after the update) and reports how many seconds of the batch's generation
ran during earlier steps' work (`timing/gen_overlap`, `perf/gen_overlap_share` of
`timing/rollout_gen`).

DAPO's dynamic sampling (hybridflow/trainer/dynamic_sampling.py) calls `responses` again within a
step for each refill round: it takes the next launched batch and launches one behind it with the
step's weights. A batch is then taken no later than without refills, so still at most `depth`
versions stale, and the step's work window starts at its first batch.

Checkpoints: what is in flight is saved (finished first), not discarded; see `save`.
"""

import time
from collections import deque
from pathlib import Path

import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.prompts import PromptBatches, StepPrompts
from hybridflow.trainer.rollout.pool import LaunchedCall, PoolRollout
from hybridflow.trainer.rollout.unread import AHEAD_FILE  # in the rollout's checkpoint directory


def overlap_seconds(window: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """Seconds of `window` (start, end) inside the disjoint intervals `others`."""
    start, end = window
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in others)


def generation_depth(cfg) -> int:
    """Batches generating ahead of the one trained: one_step 1, async max_staleness less the
    engines' lag (sync_every - 1), sync 0."""
    settings = cfg.trainer.async_training
    return {"sync": 0, "one_step": 1, "async": settings.batches_ahead()}[settings.mode]


class GeneratingAhead:
    def __init__(self, pool: PoolRollout, depth: int, prompts: PromptBatches, sync_every: int = 1):
        self.pool = pool
        self.depth = depth
        self.sync_every = sync_every  # updates between weight transfers (trainer.async_training)
        self.prompts = prompts  # the loader's batches; launched ones wait in `prompts.ahead`
        # the rows of each launched generation and its responses (finished ones after a checkpoint)
        self.pending: deque[tuple[DataProto, LaunchedCall | DataProto]] = deque()
        self.work_windows: list[tuple[float, float]] = []  # the driver's work on each step (wall clock)
        self.step_start: float | None = None  # when the step's first batch arrived (wall clock)

    def sync_weights(self, policy: Policy) -> None:
        self.pool.sync_weights(policy, self.sync_every)

    def responses(self, prompts: PromptBatches, steps_left: int) -> tuple[StepPrompts, DataProto]:
        """The next step's prompts (drawn ahead, `self.prompts`) and their responses: launched for
        these very rows earlier (generated now at the start); then the next steps' generations are
        launched."""
        step = prompts.next()
        responses = self.collect(step.rows) if self.pending else self.pool.generate(step.rows)
        self.fill(steps_left)
        if self.step_start is None:  # not a dynamic-sampling refill round, whose step began earlier
            self.step_start = time.time()
        return step, responses

    def generate(self, rows: DataProto) -> DataProto:
        """Now, with the newest weights (transferred first where sync_every left the engines behind);
        the launched generations are left alone."""
        self.pool.newest_weights()
        return self.pool.generate(rows)

    def collect(self, rows: DataProto) -> DataProto:
        launched, responses = self.pending.popleft()
        if launched is not rows:
            raise RuntimeError("generating ahead: the step's rows are not the ones launched for it")
        return self.pool.collect(responses)

    def fill(self, steps_left: int) -> None:
        """Launch the next steps' generations with the current weights, up to `depth` in flight
        and never beyond the last step."""
        while len(self.pending) < min(self.depth, steps_left):
            rows = self.prompts.draw_ahead().rows
            self.pending.append((rows, self.pool.launch(rows)))

    def metrics(self, batch: DataProto) -> dict[str, float]:
        """The pool's staleness metrics and the overlap of the batch's generation with the
        driver's work on earlier steps; this step's work ends here."""
        overlap = self.generation_overlap(batch)
        self.work_windows.append((self.step_start, time.time()))
        self.step_start = None
        return {**self.pool.metrics(batch), **overlap}

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

    def save(self, path: str) -> None:
        """In flight is saved, not discarded: the launched generations are waited for and written
        with the checkpoint (their prompts were drawn from the loader already), so a resumed run
        trains on the very samples the uninterrupted one does."""
        self.pending = deque((rows, self.pool.collect(responses)) for rows, responses in self.pending)
        self.pool.save(path)
        torch.save(
            {"ahead": list(self.prompts.ahead), "pending": list(self.pending)}, Path(path) / AHEAD_FILE
        )

    def load(self, path: str) -> None:
        self.pool.load(path, reads=AHEAD_FILE)
        saved = Path(path) / AHEAD_FILE
        if saved.is_file():  # absent in a synchronous run's checkpoint: nothing was ahead
            state = torch.load(saved, weights_only=False)  # our own file: DataProtos, prompt rows
            self.prompts.ahead, self.pending = deque(state["ahead"]), deque(state["pending"])
