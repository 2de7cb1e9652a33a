"""Worker for test_rollout_sync.py: run under torchrun on 4 gloo processes (actor TP2 x PP2).

    python -m torch.distributed.run --nproc_per_node 4 tests/rollout/_sync_worker.py HF_DIR OUT_DIR MOE_DIR

One launch checks, printing "OK <check>" on rank 0 after each:
  sync-exact      after perturbing the actor and syncing (verify_weight_sync on), every weight of
                  every rank's hf engine equals the HF export of the actor bit for bit, and differs
                  from the original checkpoint;
  greedy-export   greedy generation through the manager (each rank generates a slice, outputs
                  gathered) equals transformers' greedy generation from the exported checkpoint,
                  on every rank, rows and uids in order;
  independent     one prompt repeated 8 times (a GRPO group spread over the 4 ranks) gets 8
                  different samples: ranks' slices do not share a random stream;
  sglang-cycle    rollout TP 2 (two engines, on ranks 0 and 2) through the sglang contract double
                  (tests/doubles): each rank sees one GPU, as under Ray; the first generate after
                  the engine is built works (the manager released it at build and resumes what it
                  released, weights before the stream, KV cache after), twice; scheduler i of each
                  engine runs on group member i's GPU and loads its tensors from that GPU only;
                  greedy output equals transformers' on the exported checkpoint;
  sglang-keep     with free_cache_engine false nothing is ever released or resumed;
  sglang-refused  an update SGLang refuses (outside a weight-update session) stops every rank with
                  a WeightSyncError naming the bucket and SGLang's message;
  verify-catches  a corrupted tensor on rank 1 stops every rank with a WeightSyncError naming it;
  dp2-chunks      re-initialised as TP2 x DP2 with the original weights, each data-parallel rank's
                  chunk comes back as transformers' greedy output of the original checkpoint.
  moe-tp2-ep2     a Qwen3-MoE actor at TP2 x EP2 syncs into randomly initialised hf engines
                  (verify_weight_sync on): every engine tensor, the per-expert views of
                  transformers' fused experts included, equals MOE_DIR's checkpoint bit for bit,
                  and greedy generation through the manager equals transformers' on MOE_DIR.
"""

import os
import sys
from pathlib import Path

# Every rank sees one GPU, as a Ray worker that asked for one does; "GPUs" 4-7 so that an index
# and a GPU name never coincide. The sglang contract double stands in for sglang on CPU.
os.environ["CUDA_VISIBLE_DEVICES"] = str(4 + int(os.environ["RANK"]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))

import numpy as np
import torch
import torch.distributed as dist
from actor_noise import perturb

from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.model import unwrap_model
from engines.megatron.parallel import init_megatron
from engines.megatron.weights import save_hf_checkpoint
from engines.placement import gather_engine_devices
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.hf_rollout import HFRolloutEngine, checkpoint_tensors
from engines.rollout.sglang_rollout import SGLangRolloutEngine
from engines.rollout.sharding_manager import ALL_TAGS, MegatronRolloutShardingManager
from engines.weight_sync.common import WeightSyncError
from hybridflow.protocol import DataProto

EOS, PAD = 1, 0
MAX_NEW = 8
CORRUPTED = "model.layers.1.mlp.down_proj.weight"


def rollout_cfg(**overrides) -> RolloutConfig:
    greedy = SamplingConfig(do_sample=False, temperature=0.0)
    fields = dict(response_length=MAX_NEW, val_sampling=greedy, weight_sync_bucket_mb=1)
    return RolloutConfig(**{**fields, **overrides})


def make_prompts(rows: int = 6, width: int = 5) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    lengths = [1 + (3 * row) % width for row in range(rows)]
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    ids = torch.randint(3, 100, mask.shape, generator=gen) * mask
    uids = np.array([f"uid-{row}" for row in range(rows)], dtype=object)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        {"uid": uids},
        {"validate": True},
    )


def generate_through(manager, engine, prompts: DataProto) -> DataProto:
    piece = manager.preprocess_data(prompts)
    out = engine.generate_sequences(piece) if engine is not None else None
    return manager.postprocess_data(out)


def reference_greedy(export_dir: Path, prompts: DataProto) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts.batch["input_ids"],
            attention_mask=prompts.batch["attention_mask"],
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    return out[:, prompts.batch["input_ids"].shape[1] :]


def check_greedy(out: DataProto, prompts: DataProto, expected: torch.Tensor) -> None:
    assert len(out) == len(prompts), (len(out), len(prompts))
    assert list(out.non_tensor_batch["uid"]) == list(prompts.non_tensor_batch["uid"])
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"])
    width = expected.shape[1]
    mask = out.batch["response_mask"][:, :width]
    assert torch.equal(out.batch["responses"][:, :width], expected.masked_fill(mask == 0, PAD))


def check_sync_exact(engine: HFRolloutEngine, export_dir: Path, original_dir: Path) -> None:
    from safetensors.torch import load_file

    def load(directory: Path) -> dict[str, torch.Tensor]:
        tensors = {}
        for file in sorted(directory.glob("*.safetensors")):
            tensors.update(load_file(file))
        return tensors

    exported, original = load(export_dir), load(original_dir)
    params = checkpoint_tensors(engine.model)
    assert set(params) == set(exported), sorted(set(params) ^ set(exported))
    for name, param in params.items():
        assert param.dtype == exported[name].dtype and torch.equal(param, exported[name]), name
        if original_dir != export_dir:
            assert not torch.equal(param, original[name]), f"{name} did not move"


class CorruptingEngine(HFRolloutEngine):
    """Loads weights like the hf engine, then changes one element of CORRUPTED (a bad transport)."""

    @torch.no_grad()
    def update_weights(self, named_tensors):
        bucket = list(named_tensors)
        super().update_weights(bucket)
        if any(name == CORRUPTED for name, _ in bucket):
            self.model.get_parameter(CORRUPTED).view(-1)[7] += 1e-3


def check_data_parallel_chunks(hf_dir: Path, engine, cfg: RolloutConfig, prompts: DataProto) -> None:
    """Actor at TP2 x DP2: chunk d goes to both ranks of data-parallel rank d, as dispatch does."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    megatron_cfg = MegatronConfig(tensor_model_parallel_size=2)
    ranks = init_megatron(megatron_cfg)
    chunks = build_model(hf_dir, megatron_cfg, for_training=False)
    chunk = prompts.chunk(ranks.dp_size)[ranks.dp]
    manager = MegatronRolloutShardingManager(chunks, unwrap_model(chunks[0]).hf_config, engine, cfg)
    manager.load_weights()
    with manager.generating():
        check_greedy(generate_through(manager, engine, chunk), chunk, reference_greedy(hf_dir, chunk))


def sglang_engine(hf_dir: Path, cfg: RolloutConfig, engine_cls=SGLangRolloutEngine):
    """The engine of this rank's rollout group on its first rank (the placement the worker uses)."""
    devices = gather_engine_devices(cfg.tensor_model_parallel_size, device_count=0)
    return None if devices is None else engine_cls(hf_dir, cfg, devices)


def reference_greedy_per_row(export_dir: Path, prompts: DataProto) -> torch.Tensor:
    """Greedy continuations of each unpadded prompt (SGLang serves requests unpadded), (B, MAX_NEW)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    rows = torch.full((len(prompts), MAX_NEW), PAD)
    with torch.no_grad():
        for row in range(len(prompts)):
            prompt = prompts.batch["input_ids"][row][prompts.batch["attention_mask"][row].bool()][None]
            out = model.generate(
                input_ids=prompt, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS,
                pad_token_id=PAD, use_cache=False,
            )[0, prompt.shape[1] :]  # fmt: skip
            rows[row, : len(out)] = out
    return rows


def check_sglang_cycle(chunks, hf_config, hf_dir: Path, export_dir: Path, prompts: DataProto) -> None:
    from safetensors.torch import load_file

    cfg = rollout_cfg(name="sglang", tensor_model_parallel_size=2)
    engine = sglang_engine(hf_dir, cfg)
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, cfg)
    expected = reference_greedy_per_row(export_dir, prompts)
    for _ in range(2):
        manager.load_weights()
        with manager.generating():
            if engine is not None:
                assert not engine.engine.offload_tags, engine.engine.offload_tags
            check_greedy(generate_through(manager, engine, prompts), prompts, expected)
        if engine is not None:
            assert engine.engine.offload_tags == set(ALL_TAGS)
    if engine is None:
        return
    double = engine.engine
    rank = dist.get_rank()
    assert double.scheduler_gpus == [str(4 + rank), str(5 + rank)], double.scheduler_gpus
    assert double.calls.release == [ALL_TAGS] * 3, double.calls.release
    assert double.calls.resume == [["weights"], ["kv_cache", "cuda_graph"]] * 2, double.calls.resume
    exported = {}
    for file in export_dir.glob("*.safetensors"):
        exported.update(load_file(file))
    for scheduler, gpu in enumerate(double.scheduler_gpus):
        received = double.received[scheduler]
        assert set(received) == set(exported), sorted(set(received) ^ set(exported))
        assert {r.source_gpu for r in received.values()} == {gpu}, (scheduler, gpu)
        assert all(torch.equal(received[name].tensor, exported[name]) for name in exported)


def check_sglang_keeps_memory(chunks, hf_config, hf_dir: Path, prompts: DataProto) -> None:
    cfg = rollout_cfg(name="sglang", tensor_model_parallel_size=2, free_cache_engine=False)
    engine = sglang_engine(hf_dir, cfg)
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, cfg)
    for _ in range(2):
        manager.load_weights()
        with manager.generating():
            generate_through(manager, engine, prompts)
    if engine is not None:
        calls = engine.engine.calls
        assert (calls.release, calls.resume, calls.begin, calls.end) == ([], [], 2, 2), calls


class SessionlessEngine(SGLangRolloutEngine):
    """Updates without opening SGLang's weight-update session (what a pre-0.5.21 driver does)."""

    def begin_weight_update(self) -> None:
        pass


def check_sglang_refused_update(chunks, hf_config, hf_dir: Path) -> None:
    cfg = rollout_cfg(name="sglang", tensor_model_parallel_size=2)
    engine = sglang_engine(hf_dir, cfg, SessionlessEngine)
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, cfg)
    try:
        manager.load_weights()
        raise AssertionError("the refused update was not caught")
    except WeightSyncError as err:
        text = str(err)
        assert "bucket 0 (" in text and "must run between begin_weight_update()" in text, text


def check_moe_sync(moe_dir: Path, prompts: DataProto) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    megatron_cfg = MegatronConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    init_megatron(megatron_cfg)
    chunks = build_model(moe_dir, megatron_cfg, for_training=False)
    cfg = rollout_cfg(verify_weight_sync=True, load_format="dummy")
    engine = HFRolloutEngine(moe_dir, cfg, device="cpu")
    router = "model.layers.0.mlp.gate.weight"
    random_init = checkpoint_tensors(engine.model)[router].clone()
    manager = MegatronRolloutShardingManager(chunks, unwrap_model(chunks[0]).hf_config, engine, cfg)
    manager.load_weights()
    with manager.generating():
        assert not torch.equal(checkpoint_tensors(engine.model)[router], random_init)
        check_sync_exact(engine, moe_dir, moe_dir)
        check_greedy(generate_through(manager, engine, prompts), prompts, reference_greedy(moe_dir, prompts))


def say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"OK {message}", flush=True)


def main(hf_dir: Path, out_dir: Path, moe_dir: Path) -> None:
    megatron_cfg = MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    init_megatron(megatron_cfg)
    chunks = build_model(hf_dir, megatron_cfg, for_training=False)
    hf_config = unwrap_model(chunks[0]).hf_config
    perturb(chunks)
    export_dir = out_dir / "export"
    save_hf_checkpoint(chunks, hf_config, export_dir)
    prompts = make_prompts()
    expected = reference_greedy(export_dir, prompts)

    cfg = rollout_cfg(verify_weight_sync=True)
    engine = HFRolloutEngine(hf_dir, cfg, device="cpu")
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, cfg)
    manager.load_weights()
    with manager.generating():
        check_sync_exact(engine, export_dir, hf_dir)
        say("sync-exact")
        check_greedy(generate_through(manager, engine, prompts), prompts, expected)
        say("greedy-export")
        group = make_prompts()[[0] * 8]
        group.meta_info.pop("validate")
        samples = generate_through(manager, engine, group).batch["responses"]
        assert len({tuple(row.tolist()) for row in samples}) == 8, samples
        say("independent")

    check_sglang_cycle(chunks, hf_config, hf_dir, export_dir, prompts)
    say("sglang-cycle")
    check_sglang_keeps_memory(chunks, hf_config, hf_dir, prompts)
    say("sglang-keep")
    check_sglang_refused_update(chunks, hf_config, hf_dir)
    say("sglang-refused")

    corrupting = (CorruptingEngine if dist.get_rank() == 1 else HFRolloutEngine)(hf_dir, cfg, device="cpu")
    bad_manager = MegatronRolloutShardingManager(chunks, hf_config, corrupting, cfg)
    try:
        bad_manager.load_weights()
        raise AssertionError("the corrupted sync was not caught")
    except WeightSyncError as err:
        assert CORRUPTED in str(err) and "rank 1" in str(err), str(err)
    say("verify-catches")

    check_data_parallel_chunks(hf_dir, engine, cfg, prompts)
    say("dp2-chunks")
    check_moe_sync(moe_dir, prompts)
    say("moe-tp2-ep2")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
