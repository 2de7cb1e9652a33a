"""Subprocess (the sglang contract double importable as `sglang`): does a resumed SGLang engine
sample as the uninterrupted one? Prints "SEEDS <json>" with, for deterministic inference on and
off, whether the resumed engine's second batch equals the uninterrupted engine's, and whether
consecutive calls differ.
"""

import json
import logging
import os
import sys
from pathlib import Path

import torch
from tiny_hf import make_tiny_hf_checkpoint

from engines.placement import EngineDevices
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.sglang_rollout import SGLangRolloutEngine
from hybridflow.protocol import DataProto


def prompts() -> DataProto:
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = (ids > 0).long()
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    )


def responses(engine) -> list:
    return engine.generate_sequences(prompts()).batch["responses"].tolist()


def run(checkpoint: Path, deterministic: bool) -> dict:
    cfg = RolloutConfig(
        name="sglang",
        response_length=12,
        sampling=SamplingConfig(n=2, do_sample=True, temperature=1.0),
        enable_deterministic_inference=deterministic,
        load_format="auto",  # the checkpoint's weights in both engines (dummy: random per engine)
    )
    devices = EngineDevices(visible_devices=("0",), base_gpu_id=0)
    uninterrupted = SGLangRolloutEngine(checkpoint, cfg, devices)
    first = responses(uninterrupted)
    state = uninterrupted.get_rng_state()  # what a checkpoint after the first step stores
    second = responses(uninterrupted)
    resumed = SGLangRolloutEngine(checkpoint, cfg, devices)
    resumed.set_rng_state(state)
    return {"resumed_equal": responses(resumed) == second, "calls_differ": first != second}


def main(checkpoint: Path) -> None:
    logging.basicConfig(level=logging.WARNING)
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    report = {str(flag): run(checkpoint, flag) for flag in (True, False)}
    print("SEEDS " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(make_tiny_hf_checkpoint(Path(sys.argv[1])))
