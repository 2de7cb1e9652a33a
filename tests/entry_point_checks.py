"""The entry point's checks run in this process with Ray refused (tests/test_bad_inputs.py's table,
tests/test_routing_replay_preflight.py): `run_in_process` calls hybridflow.trainer.main.main and
returns its status and stderr, or raises RayStarted where the checks let the run through;
`base_recipe` is recipes/quickstart.yaml pointed at a test's tiny model and data. A module that
runs a shipped recipe through them runs in conftest's `in_quickstart_working_tree`, where the
recipe's relative paths exist (tests/test_working_tree.py)."""

from pathlib import Path

import yaml

from hybridflow.trainer import main as entry

ROOT = Path(__file__).resolve().parents[1]


class RayStarted(Exception):
    """Raised in place of connecting to Ray: the checks let the run through."""


def base_recipe(files: dict[str, Path]) -> dict:
    """recipes/quickstart.yaml pointed at the tiny model and data, sized for 2 CPU processes."""
    recipe = yaml.safe_load((ROOT / "recipes/quickstart.yaml").read_text())
    recipe["model"]["path"] = str(files["tiny"])
    recipe["data"].update(
        train_files=[str(files["train"])], val_files=[str(files["test"])], train_batch_size=4
    )
    recipe["rollout"]["sampling"]["n"] = 2
    recipe["actor"]["update"].update(ppo_mini_batch_size=8, ppo_micro_batch_size=4)
    recipe["actor"]["log_prob_micro_batch_size"] = 4
    recipe["critic"]["update"].update(ppo_mini_batch_size=8, ppo_micro_batch_size=4)
    recipe["trainer"].update(output_dir=str(files["out"]), logger=["console"])
    return recipe


def run_in_process(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    import ray

    def refuse(*args, **kwargs):
        raise RayStarted("the checks passed and the entry point went on to start Ray")

    monkeypatch.setattr(entry, "connect_ray", refuse)
    monkeypatch.setattr(ray, "init", refuse)  # in case anything before connect_ray starts Ray
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the KV cache row's 1 GiB default
    code = entry.main(argv)
    return code, capsys.readouterr().err
