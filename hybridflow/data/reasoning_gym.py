"""reasoning-gym's procedural tasks as prompt rows (`data.source.reasoning_gym`, docs/reasoning-gym.md).

reasoning-gym (https://github.com/open-thought/reasoning-gym) generates item i of a task from the
dataset's seed and i, and scores an answer with the task's own `score_answer(answer, entry)`. The
rows made here are the parquet rows every prompt file holds: data_source `reasoning_gym/<task>`
(so validation reports `val/reasoning_gym/<task>/accuracy`), and as ground truth the item's
locator (task, seed, size, index, settings) rather than the item: an item's metadata holds tuples
and other values a JSON round trip would change, so the reward generates the item again and
scores with it as generated (hybridflow/reward/reasoning_gym.py).

Row i of a split draws its task by weight with Random(seed) and is item i of that task's dataset,
made with the split's seed and size. The held-out split is seeded with seed + size: reasoning-gym
seeds item i with seed + i, so the held-out items' generators come after the training ones'; a
training row whose question is also a held-out question is dropped (and counted), so the two sets
never share a question. The same settings and package version always make the same rows.

The package is imported when a recipe names a task, not by `import hybridflow`.
"""

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import random
from importlib import metadata
from pathlib import Path

from hybridflow.config.schema import ReasoningGymConfig

SOURCE_PREFIX = "reasoning_gym/"
KEY = "data.source.reasoning_gym"
INSTALL_HINT = "install it with: pip install reasoning-gym==0.1.25 (pinned in requirements.txt)"
SPLITS = ("train", "val")


def package_missing() -> str | None:
    """The error for a recipe that names reasoning-gym tasks without the package, else None."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError as err:
        return f"{KEY} needs the reasoning-gym package ({err}); {INSTALL_HINT}"
    return None


def task_registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's task names -> (dataset class, config class)."""
    import reasoning_gym  # noqa: F401  (registers the tasks)
    from reasoning_gym.factory import DATASETS

    return DATASETS


def system_prompts() -> dict[str, str]:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS


def source_problems(cfg: ReasoningGymConfig) -> list[str]:
    """Every problem of the settings of a source that names tasks, one line each naming the key, the
    value and the fix."""
    if (missing := package_missing()) is not None:
        return [missing]
    errors = []
    registry = task_registry()
    for task, weight in cfg.tasks.items():
        if task not in registry:
            nearest = difflib.get_close_matches(task, list(registry), n=1)
            hint = f"did you mean {nearest[0]!r}? " if nearest else ""
            errors.append(
                f"{KEY}.tasks has the unknown task {task!r} (weight {weight}); {hint}the available "
                f"tasks are: {', '.join(sorted(registry))}"
            )
        if not (math.isfinite(weight) and weight > 0):
            errors.append(f"{KEY}.tasks.{task}={weight}: a task's weight must be a positive number")
    if cfg.size <= 0:
        errors.append(f"{KEY}.size={cfg.size} must be > 0 (the training prompts to generate)")
    if cfg.val_size < 0:
        errors.append(f"{KEY}.val_size={cfg.val_size} must be >= 0 (0: no held-out set)")
    prompts = system_prompts()
    if cfg.system_prompt is not None and cfg.system_prompt not in prompts:
        errors.append(
            f"{KEY}.system_prompt={cfg.system_prompt!r} is not one of reasoning-gym's system prompts "
            f"({', '.join(prompts)}); name one, or null for none"
        )
    return errors + task_config_problems(cfg, registry)


def task_config_problems(cfg: ReasoningGymConfig, registry: dict) -> list[str]:
    """Each task_config entry belongs to a named task and is a valid setting of its config class."""
    errors = []
    for task, settings in cfg.task_config.items():
        where = f"{KEY}.task_config.{task}"
        if task not in cfg.tasks:
            errors.append(f"{where}: {task!r} is not in {KEY}.tasks; add it there, or remove {where}")
            continue
        if task not in registry:
            continue  # named once, in the tasks error
        config_cls = registry[task][1]
        fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
        unknown = [name for name in settings if name not in fields]
        if unknown:
            errors.append(
                f"{where} has {unknown}, not settings of {task} (seed and size come from {KEY}); its "
                f"settings: {fields}"
            )
            continue
        try:
            config_cls(**settings).validate()
        except (AssertionError, ValueError, TypeError) as err:
            errors.append(f"{where}={dict(settings)}: {task} refuses it: {err or type(err).__name__}")
    return errors


@functools.lru_cache(maxsize=64)
def task_dataset(task: str, seed: int, size: int, settings_json: str):
    """The reasoning-gym dataset of `task` (one per split; kept, as a task's reward reads it again)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(settings_json))


def settings_json(cfg: ReasoningGymConfig, task: str) -> str:
    return json.dumps(dict(cfg.task_config.get(task, {})), sort_keys=True)


def split_seed(cfg: ReasoningGymConfig, split: str) -> int:
    """The training set's seed is `seed`; the held-out set's, seed + size (see the module docstring)."""
    return cfg.seed if split == "train" else cfg.seed + cfg.size


def split_rows(cfg: ReasoningGymConfig, split: str) -> list[dict]:
    """The split's rows in the prompt-file layout (hybridflow/data/prompt_dataset.py)."""
    seed, size = split_seed(cfg, split), cfg.size if split == "train" else cfg.val_size
    drawn = random.Random(seed).choices(list(cfg.tasks), weights=list(cfg.tasks.values()), k=size)
    text = None if cfg.system_prompt is None else system_prompts()[cfg.system_prompt]
    system = [] if text is None else [{"role": "system", "content": text}]
    locators = [
        {"task": task, "seed": seed, "size": size, "index": index, "settings": settings_json(cfg, task)}
        for index, task in enumerate(drawn)
    ]
    return [make_row(locator, split, system) for locator in locators]


def make_row(locator: dict, split: str, system: list[dict]) -> dict:
    """The row of the item `locator` names: its question after the `system` messages, the
    locator and the item's answer as ground truth."""
    dataset = task_dataset(locator["task"], locator["seed"], locator["size"], locator["settings"])
    entry = dataset[locator["index"]]
    question, answer = entry["question"], entry["answer"]
    return {
        "data_source": SOURCE_PREFIX + locator["task"],
        "prompt": [*system, {"role": "user", "content": question}],
        "ability": dataset.category,
        "reward_model": {"style": "rule", "ground_truth": json.dumps({**locator, "answer": answer})},
        # answer: the reference response an SFT warm start learns (hybridflow/data/sft_dataset.py)
        "extra_info": {
            "split": split,
            "index": locator["index"],
            "task": locator["task"],
            "question": question,
            "answer": f"<answer>{answer}</answer>",
        },
    }


def make_splits(cfg: ReasoningGymConfig) -> tuple[dict[str, list[dict]], int]:
    """{"train": rows, "val": rows} and how many training rows were dropped for repeating a
    held-out question."""
    val = split_rows(cfg, "val") if cfg.val_size else []
    held_out = {row["extra_info"]["question"] for row in val}
    generated = split_rows(cfg, "train")
    train = [row for row in generated if row["extra_info"]["question"] not in held_out]
    if not train:
        raise ValueError(
            f"every one of the {cfg.size} training prompts of {KEY} is also a held-out question: the "
            "tasks' settings allow too few distinct problems; widen them in task_config or lower val_size"
        )
    return {"train": train, "val": val}, len(generated) - len(train)


def item_at(locator: dict) -> tuple[object, dict]:
    """(dataset, item) a row's ground-truth locator names, generated again; ValueError when the
    item's answer is not the one the row was made with (another package version made the row)."""
    dataset = task_dataset(locator["task"], locator["seed"], locator["size"], locator["settings"])
    entry = dataset[locator["index"]]
    if entry["answer"] != locator["answer"]:
        raise ValueError(
            f"reasoning-gym's {locator['task']} item {locator['index']} (seed {locator['seed']}) now has the "
            f"answer {entry['answer']!r}, the row was made with {locator['answer']!r}: reasoning-gym "
            f"{package_version()} generates other items than the one that wrote the data; generate it again"
        )
    return dataset, entry


def package_version() -> str:
    return metadata.version("reasoning-gym")


def source_digest(cfg: ReasoningGymConfig) -> str:
    """8 hex digits naming the settings and the package version: other settings, other files."""
    settings = json.dumps({**dataclasses.asdict(cfg), "version": package_version()}, sort_keys=True)
    return hashlib.sha256(settings.encode()).hexdigest()[:8]


def split_paths(cfg: ReasoningGymConfig, out_dir: str | Path) -> dict[str, Path]:
    """<out_dir>/reasoning_gym-<digest>/{train,val}.parquet by split (val only with val_size > 0)."""
    directory = Path(out_dir) / f"reasoning_gym-{source_digest(cfg)}"
    return {split: directory / f"{split}.parquet" for split in SPLITS if split == "train" or cfg.val_size}


def write_splits(cfg: ReasoningGymConfig, out_dir: str | Path) -> tuple[dict[str, Path], int]:
    """Writes the splits at their `split_paths` unless an earlier run wrote them; returns their
    paths by split and the dropped training rows (0 when the files were already there)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = split_paths(cfg, out_dir)
    if all(path.is_file() for path in paths.values()):
        return paths, 0
    splits, dropped = make_splits(cfg)
    next(iter(paths.values())).parent.mkdir(parents=True, exist_ok=True)
    for split, path in paths.items():
        tmp = path.with_name(f".{path.name}.tmp")  # a run stopped mid-write leaves no partial file
        pq.write_table(pa.Table.from_pylist(splits[split]), tmp)
        tmp.replace(path)
    return paths, dropped
