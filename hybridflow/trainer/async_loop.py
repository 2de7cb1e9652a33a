"""trainer.async_training.mode=one_step: the next batch is generated while the actor trains on
this one (docs/async.md).

`PPOTrainer.step()` is unchanged; this loop stands beside it, between the trainer and the actor
view of the disaggregated placement (hybridflow/trainer/disaggregated.py):

    step k:  responses to P_k  <- the generation launched during step k-1 (step 1: generated now)
             launch P_k+1 on the rollout pool with the weights the step starts from (version k-1)
             log-probs, reward, advantages, update of batch k   (P_k+1 generates meanwhile)

So batch k+1 is generated with the weights of step k and trained on at step k+1, one update
later: every sample after the first batch is exactly one version stale. The prompts of P_k+1 are
drawn from the loader during step k; the trainer's `next_batch` hands them to step k+1.
"""

import torch

from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.trainer.validation import PROMPT_KEYS


def generation_prompts(batch_dict: dict, n: int) -> DataProto:
    """The rows the trainer's `generate` sends to the engines for a batch of prompts."""
    prompts = DataProto.from_single_dict(batch_dict).pop(batch_keys=PROMPT_KEYS)
    prompts.meta_info["n"] = 1  # the driver repeats the prompts itself
    return prompts.repeat(n, interleave=True)


class OneStepOffPolicy:
    """The trainer's actor view in one_step mode; generation calls of the step's batch are answered
    by the generation launched one step earlier."""

    def __init__(self, trainer, actor_rollout):
        self.trainer = trainer
        self.actor_rollout = actor_rollout
        self.draw_batch = trainer.next_batch  # the loader's next batch
        self.prefetched: dict | None = None  # the next step's prompts, drawn already
        self.pending: tuple[DataProto, DataProtoFuture] | None = None  # their rows, their responses

    @classmethod
    def attach(cls, trainer) -> "OneStepOffPolicy":
        """Put the loop between `trainer` and its actor view, and behind its `next_batch`."""
        loop = cls(trainer, trainer.roles.actor_rollout)
        trainer.roles.actor_rollout = loop
        trainer.next_batch = loop.next_batch
        return loop

    def __getattr__(self, name: str):
        return getattr(self.actor_rollout, name)

    def next_batch(self) -> dict:
        batch_dict, self.prefetched = self.prefetched, None
        return batch_dict if batch_dict is not None else self.draw_batch()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The step's responses (validation and baselines: generated now, with the newest weights)."""
        if prompts.meta_info.get("validate", False):
            return self.actor_rollout.generate_sequences(prompts)
        responses = self.collect(prompts) if self.pending else self.actor_rollout.generate_sequences(prompts)
        if self.trainer.global_step < self.trainer.total_steps:
            self.launch_next()
        return responses

    def collect(self, prompts: DataProto) -> DataProto:
        """The launched generation's output, once it is checked to be for these very prompts."""
        (launched, future), self.pending = self.pending, None
        if not torch.equal(launched.batch["input_ids"], prompts.batch["input_ids"]):
            raise RuntimeError("one_step: the step's prompts are not the ones generated for it")
        return future.get()

    def launch_next(self) -> None:
        """Draw the next step's prompts and start generating them with the current weights."""
        self.prefetched = self.draw_batch()
        prompts = generation_prompts(self.prefetched, self.trainer.cfg.rollout.sampling.n)
        self.pending = (prompts, self.actor_rollout.generate_sequences_async(prompts))
