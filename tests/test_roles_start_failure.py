"""A run whose workers fail while they start frees the cluster's slots before the error is raised:
the cluster outlives a driver that called `main` in process (a notebook, the suite's in-process
recipe runs), and its next run places placement groups of the same names."""

from pathlib import Path

import pytest

from hybridflow.config.loader import load_recipe
from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def live_pools(ray, prefix: str) -> list[str]:
    table = ray.util.placement_group_table().values()
    return [pg["name"] for pg in table if pg["name"].startswith(prefix) and pg["state"] != "REMOVED"]


@pytest.mark.usefixtures("in_quickstart_working_tree")
def test_workers_that_fail_to_start_leave_no_placement_group(ray_cluster, tmp_path):
    from hybridflow.trainer.roles import start_roles

    model = make_tiny_model(tmp_path / "tiny", num_layers=2)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")  # init_model fails on it
    overrides = [f"model.path={model}", "trainer.n_gpus_per_node=1", f"trainer.output_dir={tmp_path / 'out'}"]
    cfg = load_recipe(ROOT / "recipes/quickstart.yaml", overrides)
    with pytest.raises(Exception, match="init_model"):
        start_roles(cfg)
    assert live_pools(ray_cluster, "global_pool") == []
