"""Driver-side checks of the files a recipe names, after `validate_recipe` and before Ray starts.

`check_run_inputs(cfg)` reads what the workers would otherwise discover only after Ray and
Megatron have started: each model's safetensors headers (no tensor is loaded) and every tensor
shape in them against config.json, the tokenizer, the prompt data (columns, every prompt, the
reward inputs, enough rows for a batch) and the checkpoint a resume would start from; it warns
when trainer.output_dir has less free space than one checkpoint needs. Each problem raises
ValueError / FileNotFoundError naming the file (and row) and the fix. The prompt data is
tokenized here once more than the trainer does it; that costs seconds, a failure in the workers
costs minutes.
"""

import json
import logging
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from safetensors import SafetensorError, safe_open

from hybridflow.agents.template import check_incremental_template
from hybridflow.agents.tool_formats import FORMATS, ToolCallFormat, resolve_format
from hybridflow.agents.tool_parser import ToolCall
from hybridflow.agents.tools.base import prompt_tools
from hybridflow.checks.models import (
    Headers,
    check_routing_replay,
    check_weight_shapes,
    checkpoint_bytes,
    parameter_count,
)
from hybridflow.config.schema import RecipeConfig
from hybridflow.config.validate import model_dirs, uses_teacher
from hybridflow.data.image_prompts import IMAGES_KEY
from hybridflow.data.prompt_dataset import (
    REQUIRED_COLUMNS,
    PromptDataset,
    check_chat_prompt,
    read_located_rows,
)
from hybridflow.reward.registry import known_sources, rule_for
from hybridflow.trainer.checkpoint import LATEST, MANIFEST, STEP_DIR
from hybridflow.trainer.datasets import policy_processor, recipe_prompt_dataset
from hybridflow.trainer.teacher_check import check_teacher_tokenizer
from hybridflow.utils.disk import NO_SPACE, free_bytes, human_bytes
from hybridflow.utils.imports import first_line

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_run_inputs(cfg: RecipeConfig) -> None:
    parameters = check_weights(cfg)
    check_routing_replay(cfg)
    tokenizer = load_tokenizer(cfg)
    check_chat_template(cfg, tokenizer)
    if cfg.rollout.agent.loop == "environment":
        from hybridflow.agents.openenv_env import check_server

        check_server(cfg.rollout.agent.environment)
    if uses_teacher(cfg):  # the teacher scores the student's token ids: one tokenizer for both
        check_teacher_tokenizer(cfg.teacher.path, tokenizer, cfg.model.path)
    check_image_columns_match_model(cfg)
    train_rows = check_data(cfg, tokenizer)
    check_resume_point(cfg)
    warn_if_a_checkpoint_does_not_fit(cfg, parameters)
    warn_if_staleness_is_out_of_reach(cfg, train_rows)


def warn_if_staleness_is_out_of_reach(cfg: RecipeConfig, train_rows: int) -> None:
    """A warning when trainer.async_training.max_staleness is at least the run's steps: a sample of
    a run of T steps is at most T - 1 versions old, so such a bound only has every batch generated
    ahead from the first weights. Legal (a short smoke test of a long run's recipe), so not refused."""
    trainer, staleness = cfg.trainer, cfg.trainer.async_training.max_staleness
    steps = trainer.total_training_steps or train_rows // cfg.data.train_batch_size * trainer.total_epochs
    if trainer.async_training.mode == "async" and staleness >= steps:
        logger.warning(
            "trainer.async_training.max_staleness=%d is beyond what this run reaches: it trains %d steps, "
            "so no sample is more than %d version(s) old, and the bound only has every batch generated "
            "ahead from the first weights; lower it to %d or less, or train more steps",
            staleness, steps, steps - 1, max(steps - 1, 0),
        )  # fmt: skip


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


# The tool an openai-loop recipe's template is tried with (its agent passes its own at run time)
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A tool of the chat-template check.",
        "parameters": {"type": "object", "properties": {}},
    },
}
PROBE_QUESTION = [{"role": "user", "content": "What is 1+1?"}]
PROBE_RESPONSE = "§tool response§"  # a text no template writes by itself


def check_chat_template(cfg: RecipeConfig, tokenizer) -> None:
    """An agent loop's template must take the tool role (the loop appends tool responses as such
    messages) and write tool calls, if it writes them, in the tool-call format the loop reads
    (rollout.agent.tool_call_format, agents/tool_formats.py; the model learned its calls in that
    format); ValueError naming the tokenizer's key. A template that ignores `tools=` or drops calls
    is a warning: the model can still call tools it was fine-tuned on (the tool demo's warm start),
    but it sees no schema."""
    loop = cfg.rollout.agent.loop
    if loop == "single_turn":
        return
    key = _tokenizer_key(cfg)
    if loop == "environment":  # observations are user turns appended to the sampled ids
        check_incremental_template(tokenizer, key, [{"role": "user", "content": PROBE_RESPONSE}])
        return
    render = template_renderer(tokenizer, key)
    schemas = prompt_tools(cfg.rollout.agent) or [PROBE_TOOL]
    if render(PROBE_QUESTION, schemas, "tools=") == render(PROBE_QUESTION, None, "a user message"):
        logger.warning(
            "%s: the chat template ignores tools=: the prompts carry no tool schema, so the model can call "
            "only tools it was fine-tuned to call (as the tool demo's warm start does)", key,
        )  # fmt: skip
    name = schemas[0]["function"]["name"]
    what = f"a tool call followed by its response, a message of role 'tool', which rollout.agent.loop={loop}"
    rendered = render(_tool_turn(name), schemas, f"{what} appends after every call")
    if PROBE_RESPONSE not in rendered:
        raise ValueError(
            f"{key}: the chat template renders a tool message without its content, so the model never reads "
            f"what its tools return; {TEMPLATE_FIX}"
        )
    prompt = render(PROBE_QUESTION, schemas, "tools=")
    call_format = resolve_format(cfg.rollout.agent.tool_call_format, tokenizer)
    _check_tool_call_format(
        _after(prompt, rendered[: rendered.index(PROBE_RESPONSE)]), name, key, loop, call_format
    )
    check_incremental_template(tokenizer, key)  # tool responses append to the sampled ids


def _tool_turn(name: str) -> list[dict]:
    """The probe question, an assistant turn calling tool `name`, and the tool's response."""
    call = {"id": "c00000000", "type": "function", "function": {"name": name, "arguments": {}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    response = {"role": "tool", "name": name, "tool_call_id": call["id"], "content": PROBE_RESPONSE}
    return [*PROBE_QUESTION, turn, response]


TEMPLATE_FIX = "use a model whose template renders tool messages and calls, or set model.tokenizer_path"


def _tokenizer_key(cfg: RecipeConfig) -> str:
    if cfg.model.tokenizer_path is None:
        return f"model.path={cfg.model.path}"
    return f"model.tokenizer_path={cfg.model.tokenizer_path}"


def template_renderer(tokenizer, key: str):
    """`render(messages, tools, what)`: the template's text (with the assistant prompt); what the
    template's own code raises is a ValueError naming `key` and `what` it refused."""

    def render(messages: list[dict], tools: list[dict] | None, what: str) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # raise_exception(), a missing field, ...
            raise ValueError(
                f"{key}: the chat template refuses {what} ({first_line(err)}); {TEMPLATE_FIX}"
            ) from None

    return render


def _after(prompt: str, rendered: str) -> str:
    """`rendered` from where it stops agreeing with `prompt` (the question with the assistant
    prompt): the assistant turn as the template writes it."""
    return rendered[len(os.path.commonprefix([prompt, rendered])) :]  # noqa: RUF071 (text, not paths)


def _check_tool_call_format(
    written: str, name: str, key: str, loop: str, call_format: ToolCallFormat
) -> None:
    """A call the template writes (`written`: the assistant turn) must parse back as the same call
    (name, arguments) in `call_format`. A template that writes none matters to loop=openai only,
    whose agents send their conversations back."""
    expected = [ToolCall(name, {})]
    if call_format.parse(written).calls == expected:
        return
    readers = [fmt.name for fmt in FORMATS.values() if fmt.parse(written).calls == expected]
    if readers:
        raise ValueError(
            f"{key}: the chat template writes tool calls in the {readers[0]} format, not the "
            f"{call_format.name} format the tool loop would read; set rollout.agent.tool_call_format: "
            f"{readers[0]} (or auto)"
        )
    if name not in written:
        if loop == "openai":
            logger.warning(
                "%s: the chat template writes no tool call of an assistant message: the calls of a "
                "conversation an OpenAI-style agent sends back are lost when it is rendered", key,
            )  # fmt: skip
        return
    raise ValueError(
        f"{key}: the chat template writes a tool call as {_written_call(written, name)!r}, which no "
        f"tool-call format reads (known: {', '.join(FORMATS)}): a model trained on this template would "
        f"call tools no loop runs; {TEMPLATE_FIX}"
    )


def _written_call(text: str, name: str) -> str:
    """The JSON object around the call's name in `text` (the line holding it when there is none)."""
    at = text.index(f'"{name}"')
    start = text.rfind("{", 0, at)
    try:
        return text[start : json.JSONDecoder().raw_decode(text, start)[1]]
    except ValueError:
        return text[text.rfind("\n", 0, at) + 1 :].split("\n")[0]


def check_data(cfg: RecipeConfig, tokenizer) -> int:
    """The datasets the trainer will build load, and hold at least one batch each; returns the
    training set's usable rows."""
    data, processor = cfg.data, policy_processor(cfg)
    if cfg.trainer.mode == "sft":
        from hybridflow.data.sft_dataset import SFTDataset

        rows = read_located_rows(data.train_files, (data.prompt_key, "extra_info"))
        located = rows[: data.train_max_samples]
        if not located:
            raise ValueError(f"{data.train_files} hold no rows; add rows")
        for where, row in located:  # SFTDataset renders the prompts without naming a bad row
            check_chat_prompt(row[data.prompt_key], where, data.prompt_key)
        train = SFTDataset(
            data.train_files, tokenizer, data.max_prompt_length, cfg.rollout.response_length,
            data.prompt_key, data.train_max_samples, processor=processor,
        )  # fmt: skip
    else:
        train = _prompt_dataset(cfg, tokenizer, processor, data.train_files, data.train_max_samples)
    _check_batch_fits("data.train_batch_size", data.train_batch_size, len(train), data.train_files)
    if data.val_files:
        val = _prompt_dataset(cfg, tokenizer, processor, data.val_files, data.val_max_samples)
        if data.val_batch_size is not None:
            _check_batch_fits("data.val_batch_size", data.val_batch_size, len(val), data.val_files)
    return len(train)


def _prompt_dataset(
    cfg: RecipeConfig, tokenizer, processor, files: list[str], max_samples: int | None
) -> PromptDataset:
    """The dataset the trainer builds (it checks every prompt), and the rows' reward inputs."""
    dataset = recipe_prompt_dataset(cfg, tokenizer, files, max_samples, processor)
    if cfg.rollout.agent.loop != "environment":  # an environment's rewards need no rule or ground truth
        check_reward_inputs(read_located_rows(files, REQUIRED_COLUMNS)[:max_samples], cfg.reward.custom_fn)
    return dataset


IMAGE_COLUMNS = ("images", "image")  # verl's data.image_key and the usual datasets column


def check_image_columns_match_model(cfg: RecipeConfig) -> None:
    """ValueError when a prompt file and the policy disagree about images: an image column with a
    text model (the trainer would read only the prompt's text and drop the images without a word),
    or a vision-language model with a file that has no `images` column."""
    from engines.model_dir import is_vision_language_dir

    vision = is_vision_language_dir(cfg.model.path)
    for key in ("train_files", "val_files"):
        for index, path in enumerate(getattr(cfg.data, key)):
            try:
                names = pq.read_schema(path).names
            except (OSError, pa.ArrowException):
                continue  # check_data names the unreadable file
            images = [name for name in names if name in IMAGE_COLUMNS]
            where, model = f"data.{key}[{index}]={path}", f"model.path={cfg.model.path}"
            if images and not vision:
                raise ValueError(
                    f"{where} has an image column '{images[0]}', but {model} is a text-only model "
                    f"({_architecture(cfg.model.path)}): its images would be dropped without a word; drop "
                    "the column, or train a vision-language model (docs/vlm.md)"
                )
            if vision and IMAGES_KEY not in names:
                raise ValueError(
                    f"{where} has no '{IMAGES_KEY}' column, but {model} is a vision-language model "
                    f"({_architecture(cfg.model.path)}) that reads each prompt's images from it; add the "
                    "column (a list of encoded images per row), or train a text model"
                )


def _architecture(model_dir: str) -> str:
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return ", ".join(raw.get("architectures") or [raw.get("model_type", "unknown")])


def check_reward_inputs(located: list[tuple[str, dict]], custom_fn: str | None) -> None:
    """The rule reward needs a rule for each row's data_source and the rows' ground truths; a custom
    reward may score without ground truth, so missing ones are only reported."""
    if custom_fn is None:
        for where, row in located:
            if rule_for(row["data_source"]) is None:
                raise ValueError(
                    f"{where}: no reward rule for data_source {row['data_source']!r} (known: "
                    f"{known_sources()}); set reward.custom_fn to a function 'module.fn' that scores it"
                )
    missing = [where for where, row in located if (row["reward_model"] or {}).get("ground_truth") is None]
    if len(missing) == len(located) and custom_fn is None:
        raise ValueError(
            f"reward_model.ground_truth is null in every row ({located[0][0]} ... {located[-1][0]}); the "
            "rule reward scores responses against it: fill it in, or set reward.custom_fn"
        )
    if missing:
        logger.warning(
            "reward_model.ground_truth is null in %d of %d rows, e.g. %s",
            len(missing),
            len(located),
            missing[0],
        )


def _check_batch_fits(key: str, batch_size: int, rows: int, files: list[str]) -> None:
    if batch_size > rows:
        raise ValueError(
            f"{key}={batch_size} exceeds the {rows} usable rows of {files} (after data.*_max_samples and "
            f"dropping prompts over data.max_prompt_length); lower {key} or add rows"
        )


def check_resume_point(cfg: RecipeConfig) -> None:
    """An explicit trainer.resume_from_path must be a finished checkpoint directory; with
    resume_mode auto, an existing `latest` file must name one."""
    trainer = cfg.trainer
    if trainer.resume_from_path:
        path = Path(trainer.resume_from_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"trainer.resume_from_path={path} does not exist; give a <output_dir>/checkpoints/"
                "global_step_N directory, or remove the key"
            )
        if not STEP_DIR.match(path.name):
            raise ValueError(f"trainer.resume_from_path={path}: expected a directory named global_step_N")
        if not (path / MANIFEST).is_file():
            raise ValueError(
                f"trainer.resume_from_path={path} has no {MANIFEST}: that checkpoint's save did not finish"
            )
    elif trainer.resume_mode == "auto":
        latest = Path(trainer.output_dir) / "checkpoints" / LATEST
        if latest.is_file() and not STEP_DIR.match(latest.read_text().strip()):
            raise ValueError(
                f"{latest} should name a global_step_N directory, it holds {latest.read_text()[:80]!r}; "
                "write the newest complete checkpoint's name there, or set trainer.resume_mode=disable"
            )
