"""What each step trained on, one JSON line per sample (trainer.save_samples):
<output_dir>/samples/step_<k>.jsonl, each line

    {"step": 3, "uid": "...", "prompt": "...", "response": "...", "ground_truth": "42",
     "score": 1.0, "advantage": 0.71, "policy_version": 2}

`uid` names the sample's group (the samples of one prompt share it), `score` is the sequence's
reward, `advantage` its mean over the response tokens, `policy_version` the version that generated
it (a rollout pool's engines stamp it; absent elsewhere). Texts are decoded as the reward function
reads them: the prompt without padding, the response's sampled tokens (an agent's turns joined by
newlines, tool output left out).

A step's file is written once its update is done, through a temporary file: a file is a step
trained whole. A fresh start moves an earlier run's folder aside (samples.<k>); a resumed run
deletes the files an interrupted run wrote after its checkpoint and writes those steps again.
"""

import json
import os
from pathlib import Path

from hybridflow.protocol import DataProto
from hybridflow.reward.manager import model_texts
from hybridflow.utils.tracking import move_aside

SAMPLES_DIR = "samples"


class SampleLog:
    def __init__(self, output_dir: Path, resumed_step: int | None):
        self.folder = output_dir / SAMPLES_DIR
        if resumed_step is None:
            move_aside(self.folder)
        else:  # the steps after the checkpoint are trained again, and a file cut short by the kill goes
            for path in self.folder.glob("step_*.jsonl"):
                if step_of(path) > resumed_step:
                    path.unlink()
            for path in self.folder.glob(".step_*.jsonl.partial"):
                path.unlink()
        self.folder.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, batch: DataProto, tokenizer) -> None:
        lines = "".join(json.dumps(record) + "\n" for record in sample_records(step, batch, tokenizer))
        partial = self.folder / f".step_{step}.jsonl.partial"
        partial.write_text(lines)
        os.replace(partial, self.folder / f"step_{step}.jsonl")


def read_samples(output_dir: Path) -> list[list[dict]]:
    """A run's samples/ files: each step's records, in step order."""
    paths = sorted((Path(output_dir) / SAMPLES_DIR).glob("step_*.jsonl"), key=step_of)
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in paths]


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").removesuffix(".jsonl"))


def sample_records(step: int, batch: DataProto, tokenizer) -> list[dict]:
    """One record per row of the trained `batch` (see the module's docstring)."""
    tensors, non_tensor = batch.batch, batch.non_tensor_batch
    response_mask = tensors["response_mask"]  # (B, R)
    width = tensors["input_ids"].size(1) - response_mask.size(1)
    prompt_ids, prompt_mask = tensors["input_ids"][:, :width], tensors["attention_mask"][:, :width]  # (B, P)
    mask = response_mask.float()
    advantages = (tensors["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    prompts = [tokenizer.decode(ids[keep.bool()]) for ids, keep in zip(prompt_ids, prompt_mask, strict=True)]
    columns = {
        "prompt": prompts,
        "response": model_texts(tensors["responses"], response_mask, tokenizer),
        "score": tensors["token_level_scores"].sum(-1).tolist(),
        "advantage": advantages.tolist(),
    }
    if "uid" in non_tensor:
        columns["uid"] = [str(uid) for uid in non_tensor["uid"]]
    if "reward_model" in non_tensor:
        columns["ground_truth"] = [str(info.get("ground_truth")) for info in non_tensor["reward_model"]]
    if "policy_version" in tensors:
        columns["policy_version"] = tensors["policy_version"].tolist()  # (B,)
    rows = range(len(batch))
    return [{"step": step, **{key: values[row] for key, values in columns.items()}} for row in rows]
