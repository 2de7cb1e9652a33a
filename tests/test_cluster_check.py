"""check_cluster_resources: a recipe asking for more nodes or devices than the Ray cluster has
fails before any worker starts, naming what is missing. Pure cases on hand-written `ray.nodes()`
tables, then one against the session's real Ray."""

import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.launch.cluster import check_cluster_resources, missing_slurm_nodes, parse_launchers


def node(address, cpus, gpus=0, alive=True, hostname=None, slurm_node=None):
    resources = {"CPU": float(cpus), "memory": 1e9, **({"GPU": float(gpus)} if gpus else {})}
    labels = {"slurm-node": slurm_node} if slurm_node else {}
    return {
        "Alive": alive,
        "NodeManagerAddress": address,
        "NodeManagerHostname": hostname or f"host-{address}",
        "Resources": resources,
        "Labels": labels,
    }


EIGHT_GPU_NODES = [node("10.0.0.1", 64, 8), node("10.0.0.2", 64, 8)]


def test_fitting_gpu_cluster_passes():
    check_cluster_resources(2, 8, use_gpu=True, nodes=EIGHT_GPU_NODES)
    check_cluster_resources(1, 4, use_gpu=True, nodes=EIGHT_GPU_NODES)


def test_too_few_gpus_per_node_names_each_node_and_its_shortfall():
    nodes = [node("10.0.0.1", 64, 8), node("10.0.0.2", 64, 4, hostname="small")]
    with pytest.raises(ValueError) as err:
        check_cluster_resources(2, 8, use_gpu=True, nodes=nodes)
    message = str(err.value)
    assert "trainer.nnodes=2, trainer.n_gpus_per_node=8, trainer.use_gpu=true" in message
    assert "need 2 node(s) with 8 CPU, 8 GPU each" in message
    assert "1 of the 2 alive node(s) have that, so 1 more are missing" in message
    assert "10.0.0.2 (small): 4 GPU, 64 CPU lacks 4 GPU" in message
    assert "10.0.0.1" not in message.split("Too small:")[1]  # the node that fits is not blamed


def test_groups_are_not_packed_onto_one_big_node():
    # 16 GPUs on one node cannot host two nodes' worth of ranks: the pool keeps node entries apart.
    with pytest.raises(ValueError, match="1 of the 1 alive node"):
        check_cluster_resources(2, 8, use_gpu=True, nodes=[node("10.0.0.1", 128, 16)])


def test_dead_nodes_do_not_count():
    nodes = [node("10.0.0.1", 64, 8), node("10.0.0.2", 64, 8, alive=False)]
    with pytest.raises(ValueError, match="1 of the 1 alive node"):
        check_cluster_resources(2, 8, use_gpu=True, nodes=nodes)


def test_gpu_slots_also_need_a_cpu_each():
    with pytest.raises(ValueError, match="lacks 6 CPU"):
        check_cluster_resources(1, 8, use_gpu=True, nodes=[node("10.0.0.1", 2, 8)])


def test_cpu_runs_count_cpus_not_gpus():
    check_cluster_resources(2, 2, use_gpu=False, nodes=[node("a", 2), node("b", 4)])
    with pytest.raises(ValueError, match=r"need 1 node\(s\) with 3 CPU each.*lacks 1 CPU"):
        check_cluster_resources(1, 3, use_gpu=False, nodes=[node("a", 2)])


def test_gpu_run_on_a_cpu_only_cluster_says_gpus_are_missing():
    with pytest.raises(ValueError, match="lacks 1 GPU"):
        check_cluster_resources(1, 1, use_gpu=True, nodes=[node("a", 16)])


@pytest.mark.parametrize("nnodes, devices", [(0, 1), (1, 0), (True, 1), (1, 1.5)])
def test_bad_shape_is_a_value_error_naming_the_key(nnodes, devices):
    with pytest.raises(ValueError, match=r"trainer\.(nnodes|n_gpus_per_node) must be a positive integer"):
        check_cluster_resources(nnodes, devices, use_gpu=False, nodes=[node("a", 16)])


def test_missing_slurm_nodes_are_named_by_their_label():
    nodes = [node("a", 2, slurm_node="n1"), node("b", 2, slurm_node="n3", alive=False), node("c", 2)]
    assert missing_slurm_nodes(["n1", "n2", "n3"], nodes) == ["n2", "n3"]
    assert missing_slurm_nodes(["n1"], nodes) == []


def test_parse_launchers():
    assert parse_launchers("n1=12,n2") == {"n1": 12, "n2": None}
    with pytest.raises(ValueError, match="expected NAME or NAME=PID"):
        parse_launchers("n1=abc")
    with pytest.raises(ValueError, match="--nodes is empty"):
        parse_launchers(",")


CLUSTER_SCRIPT = Path(__file__).resolve().parents[1] / "hybridflow" / "launch" / "cluster.py"


def wait_nodes(address: str, nodes: str, timeout: str) -> subprocess.CompletedProcess:
    command = ["wait-nodes", "--address", address, "--nodes", nodes, "--timeout", timeout]
    return subprocess.run(
        [sys.executable, str(CLUSTER_SCRIPT), *command],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_join_wait_names_missing_and_exited_nodes(ray_cluster):
    # The session node carries no slurm-node label, so neither node below ever joins.
    address = ray_cluster.get_runtime_context().gcs_address
    launcher = subprocess.Popen(["true"])
    launcher.wait()  # its pid now names an exited launcher
    exited = wait_nodes(address, f"ghost-a,ghost-b={launcher.pid}", "60")
    assert exited.returncode == 1
    assert f"Ray exited before joining the cluster at {address} on: ghost-b" in exited.stderr
    missing = wait_nodes(address, "ghost-a,ghost-c", "1")
    assert missing.returncode == 1
    assert f"2 of 2 Slurm node(s) did not join the Ray cluster at {address} within 1 s: ghost-a, ghost-c" in (
        missing.stderr
    )


def test_real_cluster(ray_cluster):
    # The session cluster: one node with 16 logical CPUs and no GPU.
    check_cluster_resources(1, 16, use_gpu=False)
    with pytest.raises(ValueError, match="lacks 1 CPU"):
        check_cluster_resources(1, 17, use_gpu=False)
    with pytest.raises(ValueError, match="1 of the 1 alive node"):
        check_cluster_resources(2, 1, use_gpu=False)
    with pytest.raises(ValueError, match="lacks 1 GPU"):
        check_cluster_resources(1, 1, use_gpu=True)


def test_the_rollout_pool_shares_nodes_with_the_trainer_when_they_have_room():
    pool = {"rollout_pool": (1, 4)}
    check_cluster_resources(1, 4, use_gpu=True, nodes=[node("10.0.0.1", 64, 8)], **pool)
    check_cluster_resources(1, 8, use_gpu=True, nodes=EIGHT_GPU_NODES, **pool)
    # two rollout nodes: one beside the trainer, one on the third node
    three = [*EIGHT_GPU_NODES, node("10.0.0.3", 8, 4)]
    check_cluster_resources(1, 8, use_gpu=True, nodes=three, rollout_pool=(2, 4))


def test_a_rollout_pool_the_cluster_cannot_place_names_its_keys_and_the_fix():
    with pytest.raises(ValueError) as err:
        check_cluster_resources(1, 8, use_gpu=True, nodes=[node("10.0.0.1", 64, 8)], rollout_pool=(1, 2))
    message = str(err.value)
    assert (
        "the Ray cluster cannot place the rollout pool beside the trainer: trainer.rollout_pool.nnodes=1, "
        "trainer.rollout_pool.n_gpus_per_node=2 need 1 node(s) with 2 CPU, 2 GPU each" in message
    )
    assert "once trainer.nnodes=1 x trainer.n_gpus_per_node=8 are placed, 0 of the 1 alive node(s)" in message
    assert "10.0.0.1 (host-10.0.0.1): 0 GPU, 56 CPU left" in message
    assert "lower trainer.rollout_pool.n_gpus_per_node / trainer.rollout_pool.nnodes" in message


@pytest.mark.usefixtures("in_quickstart_working_tree")
def test_the_entry_point_checks_the_rollout_pool_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    """A disaggregated recipe on a cluster of one 2-CPU node: the trainer's 2 processes fit, the
    rollout pool's does not; the run ends with the named error before start_roles."""
    import hybridflow.launch.cluster as cluster
    from hybridflow.data.arith import ArithConfig, write_arith_parquet
    from hybridflow.trainer import main as entry
    from hybridflow.utils.tiny_model import make_tiny_model

    data = write_arith_parquet(tmp_path / "data", ArithConfig(num_train=8, num_test=4))
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    argv = [
        str(recipe), f"model.path={make_tiny_model(tmp_path / 'tiny')}", f"trainer.output_dir={tmp_path}/out",
        f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]", "data.train_batch_size=4",
        "rollout.sampling.n=2", "actor.update.ppo_mini_batch_size=8", "actor.log_prob_micro_batch_size=4",
        "actor.update.ppo_micro_batch_size=4", "trainer.placement=disaggregated",
        "trainer.rollout_pool.n_gpus_per_node=1", "trainer.logger=[console]",
    ]  # fmt: skip
    monkeypatch.setattr(entry, "connect_ray", lambda cfg: None)
    monkeypatch.setattr(cluster, "_connected_cluster_nodes", lambda: [node("10.0.0.1", 2)])
    monkeypatch.setattr(entry, "run", lambda *args: pytest.fail("workers were started"))
    assert entry.main(argv) == 2
    assert "error: the Ray cluster cannot place the rollout pool" in capsys.readouterr().err
