"""Each model directory a recipe names, before Ray starts: its config.json is supported and fits the
role's parallel layout and the longest sequence; its safetensors headers against config.json
(no tensor is read); the policy's tokenizer; what one checkpoint of the run will take on disk;
and the routing-replay settings against the policy's model (`check_routing_replay`).

`check_weight_shapes` compares every tensor's shape with the one config.json implies (the names
and shapes the engine's loader reads: `engines.megatron.weights.hf_tensor_shapes`), so a
vocabulary, hidden size, head count, layer count or expert count that disagrees with the weights
is refused with the config keys involved, instead of surfacing in the workers after Ray and
Megatron started. `checkpoint_bytes` estimates one checkpoint from the parameter counts.
"""

import json
import logging
import math
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from hybridflow.checks.engines import (
    _check_engine_context,
    _check_top_k_vocabulary,
    _check_vllm_on_cpu,
    _transformer_engine_usable,
    warn_if_lora_outsizes_layers,
)
from hybridflow.checks.roles import model_dirs
from hybridflow.checks.vlm import _vision_tower_problems
from hybridflow.config.schema import RecipeConfig
from hybridflow.utils.disk import NO_SPACE, free_bytes, human_bytes

logger = logging.getLogger(__name__)


def _check_models(cfg: RecipeConfig, path_errors: list[str], cuda_available: bool) -> list[str]:
    """Each model's config.json is supported, its layers and heads split over the role's TP / PP
    sizes, and the longest sequence (prompt + response) fits its position embeddings."""
    from engines.megatron.lora import validate_lora_layout
    from engines.megatron.model import expert_tp_size
    from engines.megatron.parallel import validate_moe_training, validate_parallel_layout

    errors = []
    longest = cfg.data.max_prompt_length + cfg.rollout.response_length
    for role, key, path in model_dirs(cfg):
        if any(error.startswith(f"{key}=") for error in path_errors):
            continue
        try:
            hf_config = _text_model_config(role, key, path)
        except ValueError as err:
            errors.append(f"{key}={path}: {err}")
            continue
        if role == "actor":
            errors += _vision_tower_problems(cfg, path)
        megatron = getattr(cfg, role).megatron
        try:
            validate_parallel_layout(
                hf_config,
                megatron.tensor_model_parallel_size,
                megatron.pipeline_model_parallel_size,
                megatron.expert_model_parallel_size,
                expert_tp_size(megatron),
            )
            if role not in ("reward_model", "teacher"):  # these only run forward
                validate_moe_training(hf_config, megatron)
            if role == "actor":
                te = cuda_available and _transformer_engine_usable()  # as model.machine_kernels decides
                validate_lora_layout(hf_config, megatron, cfg.actor.lora, te)
                if cfg.actor.lora.rank:
                    warn_if_lora_outsizes_layers(hf_config, cfg.actor.lora)
        except ValueError as err:
            errors.append(f"{role}.megatron does not fit the model in {path}: {err}")
        if longest > hf_config.max_position_embeddings:
            errors.append(
                f"data.max_prompt_length={cfg.data.max_prompt_length} + rollout.response_length="
                f"{cfg.rollout.response_length} = {longest} tokens exceed max_position_embeddings="
                f"{hf_config.max_position_embeddings} of the model in {path}; lower them"
            )
        if role == "actor":
            errors += _check_engine_context(cfg, hf_config.max_position_embeddings, path)
            errors += _check_top_k_vocabulary(cfg, hf_config.vocab_size, path)
        if role == "actor" and cfg.rollout.name == "vllm" and not (cuda_available and cfg.trainer.use_gpu):
            errors += _check_vllm_on_cpu(cfg.rollout, hf_config, path)
    return errors


def _text_model_config(role: str, key: str, path: str):
    """The model's config.json read by model.py, or, for a vision-language policy, its language
    model's (vlm.py; ValueError naming what it does not build)."""
    from engines.megatron.model import load_hf_config
    from engines.megatron.vlm_config import load_vlm_config
    from engines.model_dir import is_vision_language_dir

    if not is_vision_language_dir(path):
        return load_hf_config(path)
    if role != "actor":
        raise ValueError(
            f"a vision-language model trains only as the policy (model.path); the {role} ({key}) "
            "needs a text model"
        )
    return load_vlm_config(path).text


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


def check_weights(cfg: RecipeConfig) -> dict[str, int]:
    """Each model directory's safetensors headers (read once per directory), and their shapes
    against its config.json; returns each Megatron role's parameter count."""
    roles_of: dict[str, tuple[str, list[str]]] = {}  # directory -> (its first key, roles built from it)
    for role, key, path in model_dirs(cfg):
        roles_of.setdefault(path, (key, []))[1].append(role)
    parameters = {}
    for path, (key, roles) in roles_of.items():
        headers = check_safetensors(key, Path(path))
        check_weight_shapes(key, Path(path), headers, value_head="actor" not in roles)
        parameters.update(dict.fromkeys(roles, parameter_count(headers)))
    return parameters


def checkpoint_size_estimate(cfg: RecipeConfig) -> int:
    """Bytes one checkpoint of this run takes, about (see hybridflow.checks.models.checkpoint_bytes)."""
    counts = {
        role: parameter_count(check_safetensors(key, Path(path))) for role, key, path in model_dirs(cfg)
    }
    return checkpoint_bytes(cfg, counts)


def warn_if_a_checkpoint_does_not_fit(cfg: RecipeConfig, parameters: dict[str, int]) -> None:
    """A warning when trainer.output_dir's filesystem has less free space than one checkpoint needs."""
    trainer = cfg.trainer
    if trainer.save_freq <= 0:
        return
    needed, free = checkpoint_bytes(cfg, parameters), free_bytes(trainer.output_dir)
    if free < needed:
        logger.warning(
            "trainer.output_dir=%s has %s free, but one checkpoint (trainer.save_freq=%d) needs about %s "
            "(parameters of the trained models x their weight and Adam state bytes): the first save will "
            "fail with '%s'; free space there or choose another trainer.output_dir",
            trainer.output_dir, human_bytes(free), trainer.save_freq, human_bytes(needed), NO_SPACE,
        )  # fmt: skip


def check_safetensors(key: str, model_dir: Path) -> Headers:
    """Every safetensors file of the model directory exists and has a whole, readable header;
    returns each tensor's shape and file (from the headers: no tensor is read)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{key}: {index} is not a safetensors index with a weight_map ({err})") from None
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{key}={model_dir} has neither model.safetensors nor model.safetensors.index.json; the "
            "model's weights must be there"
        )
    headers = {}
    for name in files:
        file = model_dir / name
        if not file.is_file():
            raise FileNotFoundError(f"{key}: {file}, listed in {index.name}, does not exist")
        try:
            with safe_open(file, framework="pt") as weights:
                for tensor in weights.keys():  # noqa: SIM118 (safe_open is not iterable)
                    headers[tensor] = (tuple(weights.get_slice(tensor).get_shape()), name)
        except SafetensorError as err:
            raise ValueError(f"{key}: {file} is not a complete safetensors file ({err})") from None
    return headers


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(cfg: RecipeConfig):
    """The policy's tokenizer (model.tokenizer_path, else model.path), which must have a chat template."""
    from transformers import AutoTokenizer

    key, path = "model.tokenizer_path", cfg.model.tokenizer_path
    if path is None:
        key, path = "model.path", cfg.model.path
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{key}={path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); copy the "
            "tokenizer there or set model.tokenizer_path"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(f"{key}={path}: the tokenizer does not load ({type(err).__name__}: {err})") from None
    if not tokenizer.chat_template:
        raise ValueError(f"{key}={path}: the tokenizer has no chat_template, which renders the prompts")
    return tokenizer
