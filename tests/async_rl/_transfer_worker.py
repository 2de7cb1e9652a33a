"""One end of a weight transfer (test_weight_transfer.py), run as its own process:

    python tests/async_rl/_transfer_worker.py send    SIZE MODEL_DIR
    python tests/async_rl/_transfer_worker.py receive PORT SIZE MODEL_DIR RANK ENGINE OUT_FILE

The sender hosts the group's store at a port the OS gave it and prints that port as its first line
of output (the receivers' PORT). It streams the model's tensors perturbed as policy versions 1
and 2 (`versioned_tensors`), in small buckets; each receiver holds a rollout engine (hf or vllm)
started from the unperturbed model, loads each transfer and, after the last, writes the versions
it served, its greedy responses to `PROMPTS` and its log-probs of them to OUT_FILE (torch.save).
"""

import sys
from pathlib import Path

import torch

from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.hf_rollout import checkpoint_tensors
from engines.weight_sync.transfer import WeightReceiver, WeightSender, sender_store, transfer_group
from hybridflow.protocol import DataProto

HOST = "127.0.0.1"
VERSIONS = (1, 2)
BUCKET_MB = 0.05  # several buckets for the tiny model
RESPONSE_LENGTH = 8


def versioned_tensors(model_dir: str, version: int) -> list[tuple[str, torch.Tensor]]:
    """The model's checkpoint tensors, each moved by seeded noise of the version (version 0: as is)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(version)
    out = []
    for name, tensor in checkpoint_tensors(model).items():
        noise = torch.randn(tensor.shape, generator=gen) * 0.05 * version
        out.append((name, (tensor.detach() + noise).contiguous()))
    return out


def rollout_cfg(engine: str) -> RolloutConfig:
    greedy = SamplingConfig(do_sample=False, temperature=0.0)
    return RolloutConfig(
        name=engine, response_length=RESPONSE_LENGTH, load_format="auto", val_sampling=greedy,
        calculate_log_probs=True, vllm={"max_model_len": 64} if engine == "vllm" else {},
    )  # fmt: skip


def prompts() -> DataProto:
    """Greedy (validation sampling) over 4 fixed prompts of 5 tokens."""
    ids = torch.randint(3, 100, (4, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    positions = torch.arange(5).expand(4, -1)
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    return DataProto.from_dict(tensors, meta_info={"validate": True, "n": 1})


def send(size: int, model_dir: str) -> None:
    store = sender_store(HOST)
    print(store.port, flush=True)  # held by the store from now on: the receivers meet there
    group = transfer_group(HOST, store.port, 0, size, "gloo", store=store)
    sender = WeightSender(group, bucket_mb=BUCKET_MB)
    for version in VERSIONS:
        sender.send(versioned_tensors(model_dir, version), version)
    sender.group.close()


def receive(port: int, size: int, model_dir: str, rank: int, engine_name: str, out_file: str) -> None:
    from engines.rollout.factory import create_rollout_engine

    engine = create_rollout_engine(rollout_cfg(engine_name), model_dir)
    receiver = WeightReceiver(transfer_group(HOST, port, rank, size, "gloo"))
    served = [receiver.load_into(engine) for _ in VERSIONS]
    out = engine.generate_sequences(prompts())
    result = {
        "served": served,
        "responses": out.batch["responses"],
        "log_probs": out.batch["rollout_log_probs"],
    }
    torch.save(result, out_file)
    receiver.group.close()
    engine.shutdown()  # last: vLLM's teardown destroys torch.distributed's default group


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "send":
        model_dir = sys.argv[3]
        send(int(sys.argv[2]), model_dir)
    else:
        model_dir = sys.argv[4]
        receive(int(sys.argv[2]), int(sys.argv[3]), model_dir, int(sys.argv[5]), sys.argv[6], sys.argv[7])
    print(f"OK {role} {Path(model_dir).name}", flush=True)
