"""Supervised warm start (`trainer.mode: sft`) on the same Megatron actor and rollout as RL.

Each step is one optimizer step of token-mean cross-entropy on the response tokens of a batch of
(prompt, reference answer) rows (`policy.train_sft`). Validation is the RL validation
(greedy generation through the rollout engine, scored by the rule reward), and with
`trainer.export_hf: true` the result is written to <output_dir>/hf for an RL run to start from:

    bash scripts/run_recipe.sh recipes/quickstart_sft.yaml

The rows and their batches come from hybridflow/data/sft_dataset.py; checkpoints, resume, metrics
and plots are the RL trainer's.
"""

from hybridflow.data.dataloader import ResumableDataLoader
from hybridflow.data.sft_dataset import SFTDataset, collate_sft
from hybridflow.protocol import DataProto
from hybridflow.trainer import metrics
from hybridflow.trainer.ppo_trainer import PPOTrainer


class SFTTrainer(PPOTrainer):
    """The RL trainer's loop, checkpoints and validation with a supervised step in place of the
    RL dataflow. Batch size is data.train_batch_size rows; lr and micro-batches are the actor's."""

    def _loader(self, files: list[str], max_samples: int | None, train: bool = False) -> ResumableDataLoader:
        if not train:  # validation prompts: greedy generation, as in RL
            return super()._loader(files, max_samples, train=False)
        data = self.cfg.data
        dataset = SFTDataset(
            files, self.tokenizer, data.max_prompt_length, self.cfg.rollout.response_length,
            data.prompt_key, max_samples, processor=self.processor,
        )  # fmt: skip
        return ResumableDataLoader(
            dataset,
            data.train_batch_size,
            collate_fn=lambda pairs: collate_sft(pairs, self.tokenizer.pad_token_id),
            shuffle=data.shuffle,
            seed=data.seed,
        )

    def step(self) -> dict[str, float]:
        """One supervised optimizer step on the loader's next batch; returns sft/loss,
        sft/grad_norm, sft/lr and timings."""
        timings = {}
        with metrics.timer("step", timings):
            batch = DataProto.from_single_dict(self.train_loader.next_batch())
            out = metrics.mean_worker_metrics(self.policy.train_sft(batch))
        tokens = batch.batch["response_mask"].sum().item()
        return {
            **out,
            "sft/response_tokens": tokens,
            **metrics.timing_metrics(timings),
            **metrics.throughput(batch, timings["step"]),
        }
