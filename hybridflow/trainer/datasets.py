"""The prompts a recipe generates instead of reading them from files (data.source), written as
parquet before the run starts so that the trainer and the resolved recipe read them as files."""

import dataclasses
from pathlib import Path

from hybridflow.config.schema import RecipeConfig


def with_generated_data(cfg: RecipeConfig) -> RecipeConfig:
    """With data.source.reasoning_gym: its training and held-out prompts written as parquet under
    <trainer.output_dir>/data/ (hybridflow/data/reasoning_gym.py) and named in data.train_files /
    data.val_files, which the resolved recipe then records; otherwise `cfg` unchanged."""
    source = cfg.data.source.reasoning_gym
    if not source.enabled():
        return cfg
    from hybridflow.data.reasoning_gym import write_splits

    paths, dropped = write_splits(source, Path(cfg.trainer.output_dir) / "data")
    print(f"reasoning-gym prompts ({', '.join(source.tasks)}): {', '.join(map(str, paths.values()))}")
    if dropped:
        print(f"dropped {dropped} of {source.size} generated training prompts: held-out questions too")
    files = {"train_files": [str(paths["train"])], "val_files": [str(paths["val"])] if "val" in paths else []}
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **files))
