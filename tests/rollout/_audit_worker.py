"""Worker for test_rollout_audit.py: 2 gloo processes, actor TP2, SGLang rollout TP2 through the
contract double (one engine, built on rank 0, its schedulers on the two ranks' "GPUs" 4 and 5).

    python -m torch.distributed.run --nproc_per_node 2 tests/rollout/_audit_worker.py HF_DIR NARROW_DIR

Prints "OK <check>" on rank 0 after each:
  process-env      (D8) `init_parallel_state` gives both ranks CUDA_DEVICE_MAX_CONNECTIONS=1 and
                   SGLang's NCCL settings before Megatron starts, and a value exported on one
                   rank only stops both ranks with a ValueError naming it;
  stream-mismatch  (D5) the rollout model (`hf_config.source_dir`, here one with a narrower MLP)
                   would not take the actor's tensors: building the manager raises a
                   WeightSyncError naming the tensor and both shapes on both ranks, and the
                   engine got nothing and is alive (a wrong shape inside SGLang's load kills the
                   engine's whole process tree instead, as the double does);
  hook-order       (D6) the offload hooks run where the actor's state can leave: before the
                   engine's weights are resumed, after the sync and before the KV cache is
                   resumed, and after the engine's memory is released, on both ranks.
  load-before-generate  `generating()` refuses (RuntimeError naming `load_weights`, the engine
                   untouched) on a new manager and after a block that released the engine's
                   memory; with free_cache_engine false one `load_weights` serves two blocks,
                   and nothing is released or resumed.
"""

import os
import sys
from dataclasses import replace
from pathlib import Path

# Every rank sees one GPU, as a Ray worker that asked for one does; the double stands in for sglang.
os.environ["CUDA_VISIBLE_DEVICES"] = str(4 + int(os.environ["RANK"]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))

import torch.distributed as dist

from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.model import unwrap_model
from engines.placement import gather_engine_devices
from engines.process_env import PROCESS_ENV_KEYS, check_env_agrees
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.sglang_rollout import SGLangRolloutEngine
from engines.rollout.sharding_manager import MegatronRolloutShardingManager, OffloadHooks
from engines.weight_sync.common import WeightSyncError
from hybridflow.single_controller import Worker
from hybridflow.workers.megatron_setup import init_parallel_state

ROLLOUT = RolloutConfig(
    name="sglang",
    tensor_model_parallel_size=2,
    response_length=4,
    val_sampling=SamplingConfig(do_sample=False, temperature=0.0),
    weight_sync_bucket_mb=1,
)
EVENTS: list[str] = []


def say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"OK {message}", flush=True)


def check_process_env() -> None:
    values = {key: os.environ.get(key) for key in PROCESS_ENV_KEYS}
    assert values == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_GRAPH_MIXING_SUPPORT": None,
    }, values
    exported = {**os.environ, "NCCL_NVLS_ENABLE": str(dist.get_rank())}  # "0" on rank 0, "1" on rank 1
    try:
        check_env_agrees(exported)
        raise AssertionError("differing NCCL_NVLS_ENABLE was not refused")
    except ValueError as err:
        assert "NCCL_NVLS_ENABLE: ['0', '1'] (by rank)" in str(err), str(err)


def engine_of(model_dir: Path, engine_cls=SGLangRolloutEngine, cfg: RolloutConfig = ROLLOUT):
    devices = gather_engine_devices(cfg.tensor_model_parallel_size, device_count=0)
    return None if devices is None else engine_cls(model_dir, cfg, devices)


def check_stream_mismatch(chunks, hf_config, narrow_dir: Path) -> None:
    engine = engine_of(narrow_dir)
    try:
        manager = MegatronRolloutShardingManager(
            chunks, replace(hf_config, source_dir=str(narrow_dir)), engine, ROLLOUT
        )
        manager.load_weights()
        raise AssertionError("the manager sent a stream the rollout model does not take")
    except WeightSyncError as err:
        text = str(err)
        assert (
            "model.layers.0.mlp.gate_proj.weight' has shape (128, 64), the rollout model's (96, 64)" in text
        )
        assert "weight sync check on rank 0" in text, text  # the same error on every rank
    if engine is not None:
        assert engine.engine.calls.updates == 0 and not engine.engine.received[0], engine.engine.calls
        engine.engine.flush_cache()  # alive
        engine.shutdown()


class RecordingEngine(SGLangRolloutEngine):
    """The sglang engine, noting each call the manager makes in EVENTS."""

    def release_memory(self, tags=None):
        EVENTS.append(f"release:{','.join(tags or [])}")
        super().release_memory(tags)

    def resume_memory(self, tags=None):
        EVENTS.append(f"resume:{','.join(tags or [])}")
        super().resume_memory(tags)

    def begin_weight_update(self):
        EVENTS.append("begin")
        super().begin_weight_update()

    def update_weights_from_rank_payloads(self, payloads):
        if EVENTS[-1] != "update":
            EVENTS.append("update")
        super().update_weights_from_rank_payloads(payloads)

    def end_weight_update(self):
        EVENTS.append("end")
        super().end_weight_update()

    def flush_cache(self):
        EVENTS.append("flush")
        super().flush_cache()


def check_hook_order(chunks, hf_config, hf_dir: Path) -> None:
    engine = engine_of(hf_dir, RecordingEngine)
    hooks = OffloadHooks(
        before_resume=lambda: EVENTS.append("before_resume"),
        after_sync=lambda: EVENTS.append("after_sync"),
        after_release=lambda: EVENTS.append("after_release"),
    )
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, ROLLOUT, offload_hooks=hooks)
    EVENTS.clear()
    manager.load_weights()
    with manager.generating():
        EVENTS.append("generate")
    if engine is None:
        assert EVENTS == ["before_resume", "after_sync", "generate", "after_release"], EVENTS
        return
    assert EVENTS == [
        "before_resume",
        "resume:weights",
        "begin",
        "update",
        "end",
        "after_sync",
        "resume:kv_cache,cuda_graph",
        "flush",
        "generate",
        "release:weights,kv_cache,cuda_graph",
        "after_release",
    ], EVENTS
    engine.shutdown()


def check_refused(manager) -> None:
    """generating() must refuse, before touching the engine, with a RuntimeError naming load_weights."""
    try:
        with manager.generating():
            raise AssertionError("generating() ran without weights loaded since the last release")
    except RuntimeError as err:
        assert "load_weights()" in str(err), str(err)


def check_load_before_generate(chunks, hf_config, hf_dir: Path) -> None:
    engine = engine_of(hf_dir)
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, ROLLOUT)
    check_refused(manager)  # the engine released its memory when the manager was built
    manager.load_weights()
    with manager.generating():
        pass
    check_refused(manager)  # the exit released the weights too
    if engine is not None:
        calls = engine.engine.calls
        assert calls.resume == [["weights"], ["kv_cache", "cuda_graph"]], calls.resume
        assert (calls.begin, calls.flushes) == (1, 1), calls
        engine.shutdown()
    keep = replace(ROLLOUT, free_cache_engine=False)
    engine = engine_of(hf_dir, cfg=keep)
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, keep)
    check_refused(manager)  # nothing loaded yet
    manager.load_weights()
    for _ in range(2):  # nothing is released: the weights of one load serve both
        with manager.generating():
            pass
    if engine is not None:
        calls = engine.engine.calls
        assert (calls.release, calls.resume, calls.begin, calls.flushes) == ([], [], 1, 2), calls
        engine.shutdown()


def main(hf_dir: Path, narrow_dir: Path) -> None:
    for key in PROCESS_ENV_KEYS:
        os.environ.pop(key, None)
    megatron_cfg = MegatronConfig(tensor_model_parallel_size=2)
    init_parallel_state(Worker(), megatron_cfg, ROLLOUT)
    check_process_env()
    say("process-env")
    chunks = build_model(hf_dir, megatron_cfg, for_training=False)
    hf_config = unwrap_model(chunks[0]).hf_config
    check_stream_mismatch(chunks, hf_config, narrow_dir)
    say("stream-mismatch")
    check_hook_order(chunks, hf_config, hf_dir)
    say("hook-order")
    check_load_before_generate(chunks, hf_config, hf_dir)
    say("load-before-generate")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
