"""The prompts a checkpoint's rollout part holds, drawn from the loader ahead of its data position,
in a file of the async mode that saved them: one_step / async (`AHEAD_FILE`: batches drawn ahead,
their responses generated) or stream (`STREAM_FILE`: groups finished, generating or not submitted).

A run resumed in another mode does not take them (a batch of one mode is not a group of the other,
and a synchronous run has no queue): they are not trained, and the data loader resumes after them.
`report_unread` says so in one warning line naming the file, the mode and the count.
"""

from pathlib import Path

import torch

AHEAD_FILE = "generation_ahead.pt"  # mode one_step / async (hybridflow/trainer/rollout/ahead.py)
STREAM_FILE = "stream.pt"  # mode stream (hybridflow/trainer/rollout/stream.py)


def ahead_prompts(state: dict) -> int:
    """Prompts of the batches drawn ahead (`PromptBatches.ahead`, one row per prompt)."""
    return sum(len(step.batch) for step in state["ahead"])


def stream_prompts(state: dict) -> int:
    """Prompts of the stream's groups: finished, and to generate (in flight or not submitted)."""
    return len(state["finished"]) + len(state["unsent"])


MODES = {  # file -> (the mode that writes it, its count of prompts)
    AHEAD_FILE: ("one_step / async", ahead_prompts),
    STREAM_FILE: ("stream", stream_prompts),
}


def report_unread(path: str, reads: str | None) -> None:
    """One warning per file of drawn-ahead prompts in `path` other than `reads` (the one the
    resumed run's mode takes; None for the synchronous loop) that holds any."""
    for name, (mode, count) in MODES.items():
        saved = Path(path) / name
        if name == reads or not saved.is_file():
            continue
        prompts = count(torch.load(saved, weights_only=False))  # our own file: DataProtos, prompt rows
        if prompts:
            print(
                f"warning: the checkpoint holds {prompts} prompts drawn ahead by "
                f"trainer.async_training.mode {mode} ({saved}); the resumed run's mode does not take "
                "them: they are not trained (the data loader resumes after them)",
                flush=True,
            )
