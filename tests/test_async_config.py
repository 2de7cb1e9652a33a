"""The placement and asynchronous-training settings: each refused combination names the key and
the fix when the recipe is validated, before any process starts."""

from pathlib import Path

import pytest

from hybridflow.checks.recipe import RecipeError, validate_recipe
from hybridflow.config.loader import load_recipe
from hybridflow.utils.tiny_model import make_tiny_model

# the shipped recipes' relative paths exist, as after `make quickstart` (tests/working_tree.py)
pytestmark = pytest.mark.usefixtures("in_quickstart_working_tree")

GRPO = Path(__file__).resolve().parents[1] / "recipes/gsm8k_grpo.yaml"
DISAGGREGATED = ("trainer.placement=disaggregated", "trainer.rollout_pool.n_gpus_per_node=1")
STREAM = ("trainer.async_training.mode=stream", "rollout.name=vllm")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    """The GRPO recipe on a tiny model, 2 CPU processes, empty parquet files."""
    root = tmp_path_factory.mktemp("async_config")
    model = make_tiny_model(root / "tiny")
    for name in ("train", "test"):
        (root / f"{name}.parquet").write_bytes(b"")
    return [
        f"model.path={model}",
        f"data.train_files=[{root / 'train.parquet'}]",
        f"data.val_files=[{root / 'test.parquet'}]",
        "trainer.use_gpu=false",
        "trainer.n_gpus_per_node=2",
        "rollout.name=hf",
        "rollout.tensor_model_parallel_size=1",
        "data.max_prompt_length=256",
        "rollout.response_length=256",
    ]


def errors(base: list[str], *overrides: str) -> list[str]:
    cfg = load_recipe(GRPO, [*base, *overrides])
    try:
        validate_recipe(cfg, cuda_available=False)
    except RecipeError as err:
        return err.errors
    return []


def test_defaults_are_synchronous_and_colocated(base):
    cfg = load_recipe(GRPO, base)
    assert (cfg.trainer.placement, cfg.trainer.async_training.mode) == ("colocated", "sync")
    assert errors(base) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("trainer.async_training.mode=one_step",),
            "trainer.async_training.mode=one_step overlaps generation with training, which needs the "
            "rollout on its own devices: set trainer.placement=disaggregated",
        ),
        (
            ("trainer.placement=disaggregated",),
            "trainer.placement=disaggregated needs trainer.rollout_pool.nnodes >= 1 and "
            "trainer.rollout_pool.n_gpus_per_node >= 1",
        ),
        (
            ("trainer.rollout_pool.n_gpus_per_node=2",),
            "trainer.rollout_pool.n_gpus_per_node=2 gives the rollout its own devices, which only "
            "trainer.placement=disaggregated uses",
        ),
        (
            (*DISAGGREGATED, "rollout.name=vllm", "rollout.tensor_model_parallel_size=2"),
            "rollout.tensor_model_parallel_size=2 does not divide the rollout pool's 1 devices",
        ),
        (
            ("trainer.async_training.max_staleness=3",),
            "trainer.async_training.max_staleness=3 is used by mode=async only",
        ),
        (
            (*DISAGGREGATED, "trainer.async_training.mode=async", "trainer.async_training.max_staleness=-1"),
            "trainer.async_training.max_staleness must be >= 0",
        ),
        (
            ("trainer.async_training.partial_rollout=true",),
            "trainer.async_training.partial_rollout=true is used by mode=async only",
        ),
        (
            (
                *DISAGGREGATED,
                "trainer.async_training.mode=async",
                "trainer.async_training.partial_rollout=true",
            ),
            "transformers generate cannot do: use rollout.name=vllm",
        ),
        (
            (
                *DISAGGREGATED,
                "trainer.async_training.mode=async",
                "trainer.async_training.partial_rollout=true",
                "rollout.name=vllm",
            ),
            "trainer.async_training.partial_rollout=true with max_staleness=1: no request is in "
            "flight when weights arrive",
        ),
        (
            (*DISAGGREGATED, "trainer.async_training.mode=one_step", "algorithm.adv_estimator=remax"),
            "the greedy baseline would come from newer weights than the samples",
        ),
        (
            (*DISAGGREGATED, "rollout.name=sglang"),
            "rollout.name=sglang with trainer.placement=disaggregated is not built yet",
        ),
        (
            (*DISAGGREGATED, "rollout.verify_weight_sync=true"),
            "rollout.verify_weight_sync=true with trainer.placement=disaggregated is not built yet",
        ),
        (
            (
                *DISAGGREGATED,
                "rollout.name=vllm",
                "rollout.agent.loop=environment",
                "rollout.agent.environment.url=http://127.0.0.1:1",
            ),
            "rollout.agent.loop=environment with trainer.placement=disaggregated is not built yet",
        ),
        (
            (
                *DISAGGREGATED,
                "trainer.async_training.mode=one_step",
                "rollout.name=vllm",
                "rollout.agent.loop=tool",
                "rollout.agent.tools=[x.Y]",
            ),
            "rollout.agent.loop=tool in trainer.async_training.mode=one_step with "
            "trainer.placement=disaggregated is not built yet",
        ),
        (
            (*DISAGGREGATED, *STREAM, "trainer.async_training.max_staleness=0"),
            "trainer.async_training.max_staleness=0 with mode=stream: a group generating while a step "
            "trains is one version old when it finishes, so every group would be dropped; use mode=sync",
        ),
        (
            (*DISAGGREGATED, "trainer.async_training.mode=stream"),
            "trainer.async_training.mode=stream runs each group as requests between which weights land, "
            "which only the vLLM engine does here: set rollout.name=vllm (got hf)",
        ),
        (
            (*DISAGGREGATED, *STREAM, "trainer.async_training.partial_rollout=true"),
            "trainer.async_training.partial_rollout=true: mode=stream always continues requests",
        ),
        (
            (
                *DISAGGREGATED,
                "trainer.async_training.mode=async",
                "trainer.async_training.stale_groups=regenerate",
            ),
            "trainer.async_training.stale_groups=regenerate is used by mode=stream only; remove it",
        ),
        (
            (*DISAGGREGATED, "trainer.mode=sft"),
            "trainer.placement=disaggregated applies to trainer.mode=rl only",
        ),
        (
            ("trainer.mode=sft", "trainer.async_training.mode=one_step"),
            "trainer.async_training.mode=one_step applies to trainer.mode=rl only",
        ),
    ],
)
def test_refused_combinations_name_the_key_and_the_fix(base, overrides, message):
    found = errors(base, *overrides)
    assert any(message in error for error in found), found


def test_disaggregated_modes_validate(base):
    assert errors(base, *DISAGGREGATED) == []
    assert errors(base, *DISAGGREGATED, "trainer.async_training.mode=one_step") == []
    asynchronous = (
        *DISAGGREGATED,
        "trainer.async_training.mode=async",
        "trainer.async_training.max_staleness=2",
    )
    assert errors(base, *asynchronous) == []
    partial = ("rollout.name=vllm", "trainer.async_training.partial_rollout=true")
    assert errors(base, *asynchronous, *partial) == []
    stream = (*DISAGGREGATED, *STREAM, "trainer.async_training.max_staleness=2")
    assert errors(base, *stream, "trainer.async_training.stale_groups=regenerate") == []
    # dynamic sampling refills a step's batch in every mode
    dynamic = "algorithm.filter_groups.enable=true"
    assert errors(base, *DISAGGREGATED, "trainer.async_training.mode=one_step", dynamic) == []
    assert errors(base, *asynchronous, dynamic) == []
    assert errors(base, *stream, dynamic) == []


def test_a_bare_off_is_not_a_mode(base):
    """YAML reads `off` as false: the synchronous mode is called sync."""
    with pytest.raises(ValueError, match=r"trainer\.async_training\.mode"):
        load_recipe(GRPO, [*base, "trainer.async_training.mode=off"])
    with pytest.raises(ValueError, match="did you mean 'one_step'"):
        load_recipe(GRPO, [*base, "trainer.async_training.mode=one-step"])


def test_rollout_workers_take_calls_side_by_side_only_with_partial_rollouts(base):
    """A thread per launched generation call (max_staleness), one for validation, one for the
    transfer calls."""
    from hybridflow.workers.rollout_worker import actor_options

    asynchronous = [
        *base,
        *DISAGGREGATED,
        "trainer.async_training.mode=async",
        "trainer.async_training.max_staleness=3",
    ]
    partial = ["rollout.name=vllm", "trainer.async_training.partial_rollout=true"]
    assert actor_options(load_recipe(GRPO, [*asynchronous, *partial])) == {"max_concurrency": 5}
    assert actor_options(load_recipe(GRPO, asynchronous)) == {}


def test_stream_rollout_workers_take_a_call_per_group_outstanding(base):
    """(max_staleness + 1) x train_batch_size groups outstanding at most, spread over the pool's
    processes, plus a validation call and the transfer calls."""
    from hybridflow.workers.rollout_worker import actor_options

    stream = [
        *base,
        *DISAGGREGATED,
        *STREAM,
        "data.train_batch_size=6",
        "trainer.async_training.max_staleness=2",
    ]
    assert actor_options(load_recipe(GRPO, stream)) == {"max_concurrency": 18 + 2}
    two = [*stream, "trainer.rollout_pool.n_gpus_per_node=4"]
    assert actor_options(load_recipe(GRPO, two)) == {"max_concurrency": 5 + 2}  # 18 over 4: 5 at most
