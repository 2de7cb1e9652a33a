"""`build_model`: this pipeline stage's model chunks from a Hugging Face directory, ready to train or
to score: the GPTModel (model.py), its HF weights (weights.py), LoRA adapters (lora.py) and
Megatron-Core's DistributedDataParallel wrapper. Apart from model.py, which weights.py and lora.py
build on, so that those imports run one way. `build_vlm_model`: the same for a Hugging Face LLaVA
directory (vlm.py, vlm_weights.py).
"""

from engines.megatron import cpu_compat
from engines.megatron.config import LoraConfig, MegatronConfig
from engines.megatron.lora import attach_lora, validate_lora_layout
from engines.megatron.model import build_gpt_model, expert_tp_size, load_hf_config, use_transformer_engine
from engines.megatron.parallel import validate_parallel_layout
from engines.megatron.vlm import build_llava_model
from engines.megatron.vlm_config import load_vlm_config
from engines.megatron.vlm_weights import load_vlm_weights
from engines.megatron.weights import load_hf_weights


def _wrap_for_training(model, tf_config, cfg: MegatronConfig):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    settings = dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.use_distributed_optimizer and cpu_compat.cuda_available(),
    )
    ddp_config = DistributedDataParallelConfig(**{**settings, **cfg.ddp})
    wrapped = DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=model)
    # What Megatron's training loop wires up: the schedule syncs grads through these.
    tf_config.no_sync_func = wrapped.no_sync
    tf_config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_model(
    hf_dir,
    cfg: MegatronConfig,
    *,
    value_head: bool = False,
    load_weights: bool = True,
    for_training: bool = True,
    lora: LoraConfig | None = None,
) -> list:
    """Model chunks of this pipeline stage (one chunk: no virtual pipeline), built from `hf_dir`.

    Requires `init_megatron(cfg)` first. The returned GPTModel carries `hf_config` (the
    HFModelConfig it was built from), `megatron_config` and `value_head`, which the weight and
    log-prob functions read. `for_training` wraps
    the chunk in Megatron-Core's DistributedDataParallel and sets the schedule's grad-sync hooks.
    `lora` with rank > 0 freezes the loaded weights and adds LoRA adapters (lora.py), the only
    trainable parameters then.
    """
    hf_config = load_hf_config(hf_dir)
    validate_parallel_layout(
        hf_config,
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
        cfg.expert_model_parallel_size,
        expert_tp_size(cfg),
    )
    if hf_config.architecture.endswith("ForSequenceClassification") and not value_head:
        raise ValueError(
            f"{hf_dir} holds a {hf_config.architecture} (a scalar head): build it with value_head=True"
        )
    lora = lora or LoraConfig()
    validate_lora_layout(hf_config, cfg, lora, use_transformer_engine())
    with cpu_compat.cuda_calls_on_cpu():  # tied embeddings under PP call .cuda() at construction
        model = build_gpt_model(hf_config, cfg, value_head=value_head)
    model.hf_config = hf_config
    model.megatron_config = cfg
    model.value_head = value_head
    if load_weights:
        load_hf_weights([model], hf_dir, hf_config)
    if lora.rank:
        attach_lora(model, lora)
    if not for_training:
        return [model]
    with cpu_compat.cuda_calls_on_cpu():
        return [_wrap_for_training(model, model.config, cfg)]


def build_vlm_model(hf_dir, cfg: MegatronConfig, *, load_weights: bool = True, for_training: bool = True,
                    train_vision_tower: bool = False) -> list:  # fmt: skip
    """One chunk: Megatron-Core's LLaVAModel (vlm.py) from a Hugging Face LLaVA directory,
    carrying `vlm_config`, `hf_config` (its text config), `megatron_config` and `value_head` (False)
    as `build_model`'s chunks do. The vision tower is frozen unless `train_vision_tower` (as most
    RL recipes keep it): DDP then holds no gradient buffer for it and the optimizer never steps it;
    the projector and the language model train. Requires `init_megatron(cfg)` first."""
    vlm = load_vlm_config(hf_dir)
    validate_parallel_layout(vlm.text, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, 1, 1)
    model = build_llava_model(vlm, cfg)
    model.megatron_config, model.value_head = cfg, False
    if load_weights:
        load_vlm_weights(model, hf_dir, vlm, cfg)
    model.freeze(freeze_language_model=False, freeze_vision_model=not train_vision_tower,
                 freeze_vision_projection=False)  # fmt: skip
    if not for_training:
        return [model]
    with cpu_compat.cuda_calls_on_cpu():
        return [_wrap_for_training(model, model.config, cfg)]
