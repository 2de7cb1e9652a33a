"""The safetensors headers of a model directory against its config.json, and what one checkpoint
of the run will take on disk; both before Ray starts, from the headers alone (no tensor is read).
And the routing-replay settings against the policy's model (`check_routing_replay`).

`check_weight_shapes` compares every tensor's shape with the one config.json implies (the names
and shapes the engine's loader reads: `engines.megatron.weights.hf_tensor_shapes`), so a
vocabulary, hidden size, head count, layer count or expert count that disagrees with the weights
is refused with the config keys involved, instead of surfacing in the workers after Ray and
Megatron started. `checkpoint_bytes` estimates one checkpoint from the parameter counts.
"""

import math
import re
from pathlib import Path

from hybridflow.config.schema import RecipeConfig

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
EXPERT = re.compile(r"\.experts\.(\d+)\.")
# Bytes a checkpoint stores per trained parameter besides the weight itself: Adam's two fp32
# moments, plus fp32 master weights when the weights are bf16 (Megatron's optimizer state).
ADAM_BYTES = {"float32": 4 + 8, "bfloat16": 2 + 8 + 4}

Headers = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, file name)


def experts_key(hf) -> str:
    return "num_local_experts" if hf.model_type == "mixtral" else "num_experts"


def config_terms(name: str, hf) -> str:
    """The config.json values a tensor's shape comes from, as `key=value` text."""
    h, d = f"hidden_size={hf.hidden_size}", f"head_dim={hf.head_dim}"
    ffn = "intermediate_size" if hf.model_type == "mixtral" or not hf.num_experts else "moe_intermediate_size"
    terms = [
        (("embed_tokens", "lm_head"), f"vocab_size={hf.vocab_size} and {h}"),
        (("q_norm", "k_norm"), d),
        (("q_proj", "o_proj"), f"num_attention_heads={hf.num_attention_heads} x {d} and {h}"),
        (("k_proj", "v_proj"), f"num_key_value_heads={hf.num_key_value_heads} x {d} and {h}"),
        ((".gate.weight",), f"{experts_key(hf)}={hf.num_experts} and {h}"),
        (("experts.",), f"{ffn}={hf.moe_ffn_hidden_size} and {h}"),
        (("_proj.", "w1", "w2", "w3"), f"intermediate_size={hf.intermediate_size} and {h}"),
    ]
    return next((text for parts, text in terms if any(p in name for p in parts)), h)


def shape_problems(expected: dict[str, tuple[int, ...]], headers: Headers, hf) -> list[str]:
    """Each tensor whose shape differs from what config.json implies, in the model's order."""
    return [
        f"{name} in {headers[name][1]} is {list(headers[name][0])}, but {config_terms(name, hf)} make it "
        f"{list(want)}"
        for name, want in expected.items()
        if name in headers and tuple(headers[name][0]) != want
    ]


def count_problems(headers: Headers, hf) -> list[str]:
    """Layers or experts the weights hold other than config.json's counts."""
    layers = {int(m[1]) for name in headers if (m := LAYER.match(name))}
    experts = {int(m[1]) for name in headers if (m := EXPERT.search(name))}
    problems = []
    if layers and layers != set(range(hf.num_hidden_layers)):
        problems.append(
            f"the weights hold {numbered(layers, 'layers')}, num_hidden_layers={hf.num_hidden_layers}"
        )
    if experts and experts != set(range(hf.num_experts)):
        per_layer = numbered(experts, "experts a layer")
        problems.append(f"the weights hold {per_layer}, {experts_key(hf)}={hf.num_experts}")
    return problems


def numbered(indices: set[int], what: str) -> str:
    """{0, 1, 3} -> '3 layers (numbered 0 to 3)'."""
    return f"{len(indices)} {what} (numbered {min(indices)} to {max(indices)})"


def check_weight_shapes(key: str, model_dir: Path, headers: Headers, value_head: bool) -> None:
    """ValueError naming the first disagreement between the weights and config.json (and how many
    there are): a shape, a layer or expert count, or a tensor the loader needs that is missing.
    `value_head`: the directory serves only a critic or reward model, whose output layer is a
    value head (the causal-LM head is not read, the score head may be absent: a fresh one)."""
    from engines.megatron.model import load_hf_config
    from engines.megatron.weights import hf_tensor_shapes
    from engines.model_dir import is_vision_language_dir

    if is_vision_language_dir(model_dir):
        hf, expected = vlm_tensor_shapes(key, model_dir)
        problems = shape_problems(expected, headers, hf)
    else:
        hf = load_hf_config(model_dir)
        expected = hf_tensor_shapes(hf, value_head=value_head)
        problems = shape_problems(expected, headers, hf) + count_problems(headers, hf)
    missing = [name for name in expected if name not in headers and name != "score.weight"]
    if missing:
        problems.append(f"{missing[0]} is missing ({len(missing)} tensors config.json implies are absent)")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(
            f"{key}={model_dir}: the weights do not match config.json: {problems[0]}{more}; fix config.json "
            "or use the weights it belongs to"
        )


def vlm_tensor_shapes(key: str, model_dir: Path):
    """(text config, every checkpoint tensor's shape) of a LLaVA directory, as vlm_weights.py maps
    it; ValueError naming `key` for a config or tensor name the LLaVA model does not build."""
    from engines.megatron.config import MegatronConfig
    from engines.megatron.vlm_config import load_vlm_config
    from engines.megatron.vlm_weights import vlm_stream_tensor_shapes

    try:
        vlm = load_vlm_config(model_dir)
        return vlm.text, vlm_stream_tensor_shapes(vlm, MegatronConfig())
    except ValueError as err:
        raise ValueError(f"{key}={model_dir}: {err}") from None


def parameter_count(headers: Headers) -> int:
    return sum(math.prod(shape) for shape, _ in headers.values())


def checkpoint_bytes(cfg: RecipeConfig, parameters: dict[str, int]) -> int:
    """About what one checkpoint takes: each trained role's parameters (`parameters`: role ->
    count, from its weights' headers) times the bytes of its weight and Adam state."""
    trained = ["actor"] + (["critic"] if cfg.critic.enable else [])
    return sum(parameters[role] * ADAM_BYTES[getattr(cfg, role).megatron.params_dtype] for role in trained)


def check_routing_replay(cfg: RecipeConfig) -> None:
    """ValueError naming the routing-replay settings that are on for a dense policy model
    (engines/megatron/routing_replay.py's `check_replay_model`)."""
    from engines.megatron.routing_replay import check_replay_model

    check_replay_model(
        cfg.model.path, cfg.rollout.return_routed_experts, cfg.actor.megatron.moe_routing_replay
    )
