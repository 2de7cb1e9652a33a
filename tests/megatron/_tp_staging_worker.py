"""torchrun worker for test_tp_staging.py: a Megatron actor at TP2 on 2 gloo processes.

    python -m torch.distributed.run --nproc_per_node 2 tests/megatron/_tp_staging_worker.py HF_DIR

Checks, printing "OK <check> rank=<r>" on every rank:
  staged          the shared-memory TP gather applies (one host, CPU) and its stream equals the
                  checkpoint bit for bit: names, order, dtypes, values;
  staged-update   after noise on every rank's shards, a second stream over the same staging (views,
                  as the colocated sync reads them) equals the collective gather's stream bit for
                  bit and differs from the checkpoint: the staging is refilled, never stale.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.model import load_hf_config, unwrap_model
from engines.megatron.parallel import init_megatron
from engines.megatron.weights import iter_hf_tensors, tp_staging


def assert_same_stream(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), (what, list(got), list(want))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (what, name)


@torch.no_grad()
def add_noise(chunks) -> None:
    """Different noise on each TP rank's shards; the same on replicated parameters."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    for index, param in enumerate(unwrap_model(chunks[0]).parameters()):
        split = getattr(param, "tensor_model_parallel", False)
        noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(2 * index + split * rank))
        param.add_(0.05 * noise.to(param.dtype))


def main(hf_dir: Path) -> None:
    cfg = MegatronConfig(tensor_model_parallel_size=2)
    hf_config = load_hf_config(hf_dir)
    init_megatron(cfg, hf_config)
    chunks = build_model(hf_dir, cfg, for_training=False)
    rank = dist.get_rank()
    checkpoint = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        checkpoint.update(load_file(shard))
    order = list(dict(iter_hf_tensors(chunks, hf_config)))  # the collective gather's order
    staging = tp_staging(chunks, hf_config)
    assert staging is not None, "two CPU ranks on one host: the shared-memory gather must apply"
    staged = dict(iter_hf_tensors(chunks, hf_config, staging=staging))
    assert_same_stream(staged, {name: checkpoint[name] for name in order}, "staged")
    print(f"OK staged rank={rank}", flush=True)

    add_noise(chunks)
    reference = dict(iter_hf_tensors(chunks, hf_config))
    views = dict(iter_hf_tensors(chunks, hf_config, copies=False, staging=staging))
    assert_same_stream(views, reference, "staged-update")
    changed = [name for name in order if not torch.equal(views[name], checkpoint[name])]
    assert changed == order, f"unchanged after the noise: {sorted(set(order) - set(changed))}"
    print(f"OK staged-update rank={rank}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
