"""The prompt data: parquet files or a generated source, not both; the datasets the trainer will
build load (every prompt rendered), hold a batch each, and carry the reward's inputs. The prompt
data is tokenized here once more than the trainer does it; that costs seconds, a failure in the
workers costs minutes.
"""

import logging
from pathlib import Path

from hybridflow.checks.settings import _get
from hybridflow.config.schema import RecipeConfig
from hybridflow.data.prompt_dataset import (
    REQUIRED_COLUMNS,
    PromptDataset,
    check_chat_prompt,
    read_located_rows,
)
from hybridflow.data.reasoning_gym import package_missing, source_problems, split_paths
from hybridflow.data.recipe_datasets import policy_processor, recipe_prompt_dataset
from hybridflow.reward.registry import known_sources, rule_for

logger = logging.getLogger(__name__)


def _check_data_source(cfg: RecipeConfig) -> list[str]:
    """The prompts come from parquet files or from a generated source (data.source), not both; the
    files a run's resolved recipe names beside its source (the source's own output) are no others."""
    source = cfg.data.source.reasoning_gym
    if not source.enabled():
        empty = "data.train_files is empty; list the training parquet files, or generate prompts: data.source"
        return [] if cfg.data.train_files else [empty]
    return [
        f"{key} names files, but data.source.reasoning_gym generates the prompts; remove {key} or the source"
        for key, split in (("data.train_files", "train"), ("data.val_files", "val"))
        if _get(cfg, key) and _get(cfg, key) != _generated_file(cfg, split)
    ] + source_problems(source)


def _generated_file(cfg: RecipeConfig, split: str) -> list[str] | None:
    """[the file data.source writes for `split`] under <trainer.output_dir>/data (None without the
    package, whose version names the files)."""
    if package_missing():
        return None
    paths = split_paths(cfg.data.source.reasoning_gym, Path(cfg.trainer.output_dir) / "data")
    return [str(paths[split])] if split in paths else None


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
