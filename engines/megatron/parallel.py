"""Process groups for the Megatron engine: layout validation, initialisation, this rank's coordinates.

`validate_parallel_layout` runs before any process group exists, so a bad recipe fails fast with
a message naming the sizes. `init_megatron(cfg)` is called once per worker process (torchrun or
a Ray worker that exported RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).
"""

import os

import torch
import torch.distributed as dist

from engines.megatron import cpu_compat
from engines.megatron.config import MegatronConfig
from engines.placement import training_device_index, visible_devices
from hybridflow.parallel_ranks import ParallelRanks


def validate_parallel_layout(hf_config, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """Raise ValueError unless the model splits evenly over `tp` tensor and `pp` pipeline ranks
    (and, for a mixture of experts, `ep` expert-parallel and `etp` expert-tensor-parallel ranks).

    Tensor parallelism splits attention heads, KV heads and the MLP width. When `tp` exceeds the
    KV head count, Megatron-Core's rule applies: each KV head is shared by `tp / kv_heads` ranks,
    which needs `tp` to be a multiple of the KV head count. Expert parallelism splits the experts
    (each EP rank holds num_experts / ep whole experts), expert TP splits each expert's width.
    """
    etp = tp if etp is None else etp
    sizes = (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
    )
    for name, size in sizes:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} must divide num_attention_heads={heads} "
            f"({hf_config.architecture})"
        )
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"tensor_model_parallel_size={tp} must divide num_key_value_heads={kv_heads} or be a "
            f"multiple of it ({hf_config.architecture})"
        )
    _validate_expert_layout(hf_config, ep, etp)
    if not hf_config.num_experts and hf_config.intermediate_size % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} must divide intermediate_size={hf_config.intermediate_size}"
        )
    if hf_config.num_hidden_layers % pp:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} must divide num_hidden_layers={hf_config.num_hidden_layers}"
        )


def _validate_expert_layout(hf_config, ep: int, etp: int) -> None:
    experts = hf_config.num_experts
    if not experts:
        if ep != 1:
            raise ValueError(
                f"expert_model_parallel_size={ep} needs a mixture-of-experts model; "
                f"{hf_config.architecture} is dense: set it to 1"
            )
        return
    if experts % ep:
        raise ValueError(
            f"expert_model_parallel_size={ep} must divide the number of experts {experts} "
            f"({hf_config.architecture})"
        )
    if hf_config.moe_ffn_hidden_size % etp:
        raise ValueError(
            f"expert_tensor_parallel_size={etp} must divide the expert intermediate size "
            f"{hf_config.moe_ffn_hidden_size} ({hf_config.architecture})"
        )


def validate_moe_training(hf_config, cfg: MegatronConfig) -> None:
    """Megatron-Core's MoE layer refuses to train at TP > 1 without sequence parallelism (which
    needs Transformer Engine on CUDA, see model.py): say so before any process starts."""
    if hf_config.num_experts and cfg.tensor_model_parallel_size > 1 and not cfg.sequence_parallel:
        raise ValueError(
            f"training the mixture of experts {hf_config.architecture} at tensor_model_parallel_size="
            f"{cfg.tensor_model_parallel_size} needs sequence_parallel=true (Megatron-Core's rule); "
            "or use tensor_model_parallel_size=1 with expert_model_parallel_size for the experts"
        )


def _init_torch_distributed() -> None:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(
            f"torch.distributed is not initialised and the environment lacks {missing}; "
            "launch with torchrun or export them before init_megatron"
        )
    if cpu_compat.cuda_available():
        visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
        torch.cuda.set_device(training_device_index(visible, int(os.environ.get("LOCAL_RANK", "0"))))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def init_megatron(cfg: MegatronConfig, hf_config=None) -> ParallelRanks:
    """Initialise torch.distributed (from env, if needed), Megatron's parallel state and the seeds.

    With `hf_config` the layout is validated first, before any process group is made.
    Idempotent for the same layout; a different layout in the same process raises ValueError.
    """
    from megatron.core import parallel_state

    tp, pp, cp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size
    ep = cfg.expert_model_parallel_size
    etp = tp if cfg.expert_tensor_parallel_size is None else cfg.expert_tensor_parallel_size
    if hf_config is not None:
        validate_parallel_layout(hf_config, tp, pp, ep, etp)
    if not dist.is_initialized():
        _init_torch_distributed()
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(
            f"world size {world} is not a multiple of tensor ({tp}) x pipeline ({pp}) x context ({cp}) "
            "parallel sizes"
        )
    if world % (etp * ep * pp):
        raise ValueError(
            f"world size {world} is not a multiple of expert tensor ({etp}) x expert model ({ep}) x "
            f"pipeline ({pp}) parallel sizes"
        )
    cpu_compat.install()
    cpu_compat.define_missing_te_gemm()
    if parallel_state.model_parallel_is_initialized():
        current = parallel_ranks()
        current_ep = parallel_state.get_expert_model_parallel_world_size()
        current_etp = parallel_state.get_expert_tensor_parallel_world_size()
        if (current.tp_size, current.pp_size, current.cp_size, current_ep, current_etp) != (
            tp,
            pp,
            cp,
            ep,
            etp,
        ):
            raise ValueError(
                f"Megatron parallel state already initialised with tp={current.tp_size}, "
                f"pp={current.pp_size}, cp={current.cp_size}, ep={current_ep}, etp={current_etp}; asked "
                f"for tp={tp}, pp={pp}, cp={cp}, ep={ep}, etp={etp}"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
    cpu_compat.seed_all(cfg.seed)
    return parallel_ranks()


def parallel_ranks() -> ParallelRanks:
    """This rank's data / tensor / pipeline / context parallel rank and group sizes."""
    from megatron.core import parallel_state as ps

    return ParallelRanks(
        dp=ps.get_data_parallel_rank(),
        tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        cp_size=ps.get_context_parallel_world_size(),
    )
