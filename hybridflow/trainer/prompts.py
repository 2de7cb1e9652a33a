"""The training prompts, batch by batch, in the loader's order: what a step generates from.

A `StepPrompts` is one loader batch made ready for generation once, where it is drawn: the step's
rows (one per prompt, with its `uid` and ground truth) and the rows the engines generate from
(n per prompt, grouped). A rollout that generates ahead draws batches before their step comes
(`PromptBatches.draw_ahead`) and the step later takes the very same object (`next`), so the
rows generated and the rows scored are one thing, never rebuilt and compared.
"""

from collections import deque
from dataclasses import dataclass

from hybridflow.data.dataloader import ResumableDataLoader
from hybridflow.protocol import DataProto
from hybridflow.trainer.core import new_uids
from hybridflow.trainer.validation import pop_prompts


@dataclass
class StepPrompts:
    batch: DataProto  # one row per prompt: uid, ground truth, data source, ...
    prompts: DataProto  # the prompt tensors, one row per prompt (ReMax's greedy baseline)
    rows: DataProto  # what the engines generate from: n rows per prompt, grouped


def step_prompts(batch_dict: dict, n: int, with_rows: bool) -> StepPrompts:
    """A loader batch as a step generates from it: fresh uids (one group per prompt), the prompt
    tensors popped, repeated n times; `with_rows` shares the rows' other fields with the engines
    (agent loops that read each row's messages)."""
    batch = DataProto.from_single_dict(batch_dict)
    batch.non_tensor_batch["uid"] = new_uids(len(batch))
    prompts = pop_prompts(batch, with_rows)
    prompts.meta_info["n"] = 1  # the driver repeats the prompts itself
    return StepPrompts(batch, prompts, prompts.repeat(n, interleave=True))


class PromptBatches:
    """The loader's batches in order; batches drawn ahead of their step wait in `ahead` (saved with
    the rollout that drew them)."""

    def __init__(self, loader: ResumableDataLoader, n: int, with_rows: bool):
        self.loader, self.n, self.with_rows = loader, n, with_rows
        self.ahead: deque[StepPrompts] = deque()

    def next(self) -> StepPrompts:
        """The next step's prompts: the oldest drawn ahead, else the loader's next batch."""
        return self.ahead.popleft() if self.ahead else self.draw()

    def draw_ahead(self) -> StepPrompts:
        """Draw the next batch now for a later step; `next` hands it out in its turn."""
        self.ahead.append(self.draw())
        return self.ahead[-1]

    def draw(self) -> StepPrompts:
        return step_prompts(self.loader.next_batch(), self.n, self.with_rows)
