"""A seeded, resumable batch iterator over a dataset.

The order of epoch e is a permutation drawn from `seed + e`, so it is the same on every run; the
position (epoch, batch index) is a `state_dict` that checkpoints save, and `load_state_dict`
continues with exactly the batches a run without interruption would have seen.
"""

from collections.abc import Callable, Iterator

import torch


class ResumableDataLoader:
    """Yields `collate_fn([dataset[i] ...])` for `batch_size` indices at a time; a last
    incomplete batch is dropped (every step trains on a full batch)."""

    def __init__(self, dataset, batch_size: int, collate_fn: Callable, shuffle: bool = True, seed: int = 0):
        if batch_size > len(dataset):
            raise ValueError(
                f"batch size {batch_size} exceeds the {len(dataset)} prompts of the dataset; "
                "lower data.train_batch_size or add data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.batch_index = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.dataset) // self.batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def __iter__(self) -> Iterator[dict]:
        """The remaining batches of the current epoch; the position advances before each batch is
        handed out, so a checkpoint taken after training on it resumes at the next one."""
        order = self.epoch_order(self.epoch)
        while self.batch_index < len(self):
            start = self.batch_index * self.batch_size
            self.batch_index += 1
            yield self.collate_fn([self.dataset[i] for i in order[start : start + self.batch_size]])
        self.epoch += 1
        self.batch_index = 0

    def next_batch(self) -> dict:
        """The next batch, going on to the next epoch when this one is used up (a trainer's step
        may draw several: dynamic sampling, batches generated ahead)."""
        batch = next(iter(self), None)
        return batch if batch is not None else next(iter(self))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"checkpointed data order used seed {state['seed']} but data.seed is {self.seed}; "
                "resume with the same data.seed"
            )
        self.epoch = state["epoch"]
        self.batch_index = state["batch_index"]
