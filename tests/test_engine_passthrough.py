"""Engine settings by their own names: Megatron-Core fields under <role>.megatron.{transformer,
ddp,optimizer} reach the real Megatron-Core 0.16.1 configs; SGLang ServerArgs fields under
rollout.sglang are checked against the pinned version's field list. Bad names fail when the
recipe loads, before Ray starts."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from engines.rollout.sglang_server_args import SGLANG_VERSION
from hybridflow.config.loader import load_recipe
from hybridflow.trainer import main as trainer_main
from hybridflow.utils.tiny_model import make_tiny_model

# the shipped recipes' relative paths exist, as after `make quickstart` (tests/working_tree.py)
pytestmark = pytest.mark.usefixtures("in_quickstart_working_tree")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gsm8k_grpo.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("passthrough") / "tiny")


def test_megatron_fields_hybridflow_never_names_reach_the_megatron_configs(tiny):
    from engines.megatron.model import load_hf_config, to_transformer_config
    from engines.megatron.optimizer import megatron_optimizer_config

    cfg = load_recipe(
        RECIPE,
        [
            "actor.megatron.params_dtype=float32",
            "actor.megatron.transformer.recompute_granularity=full",
            "actor.megatron.transformer.recompute_method=uniform",
            "actor.megatron.transformer.recompute_num_layers=2",
            "actor.megatron.transformer.attention_dropout=0.25",
            "actor.megatron.optimizer.loss_scale=128.0",
        ],
    )
    megatron = cfg.actor.megatron
    tf_config = to_transformer_config(load_hf_config(tiny), megatron)
    assert (tf_config.recompute_granularity, tf_config.recompute_method) == ("full", "uniform")
    assert tf_config.recompute_num_layers == 2
    assert tf_config.attention_dropout == 0.25  # overrides hybridflow's 0.0
    assert tf_config.num_layers == 4  # still read from the model
    assert megatron_optimizer_config(cfg.actor.optim, megatron).loss_scale == 128.0
    # the other roles keep Megatron-Core's defaults
    assert cfg.critic.megatron.transformer == {}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor.megatron.transformer.recompute_granulariti=full",
            "megatron.transformer.recompute_granulariti is not a field of TransformerConfig; did you mean "
            "megatron.transformer.recompute_granularity?",
        ),
        ("actor.megatron.ddp.overlap_grad_reduc=true", "did you mean megatron.ddp.overlap_grad_reduce?"),
        ("critic.megatron.optimizer.adam_bta2=0.9", "did you mean megatron.optimizer.adam_beta2?"),
        (
            "actor.megatron.transformer.num_layers=2",
            "hybridflow sets TransformerConfig.num_layers from the model's config.json",
        ),
        (
            "actor.megatron.optimizer.lr=0.1",
            "hybridflow sets OptimizerConfig.lr from optim.lr",
        ),
        (
            "actor.megatron.transformer.recompute_granularity=fulll",
            "recompute_granularity='fulll': TransformerConfig.recompute_granularity takes",
        ),
        ("actor.megatron.transformer.recompute_num_layers=two", "recompute_num_layers='two'"),
    ],
)
def test_bad_megatron_settings_fail_when_the_recipe_loads(override, message):
    with pytest.raises(ValueError) as err:
        load_recipe(RECIPE, [override])
    assert message in str(err.value)


def test_a_misspelt_megatron_field_stops_the_run_before_ray_starts(capsys, monkeypatch):
    def connect_ray(cfg):
        raise AssertionError("Ray was reached with a misspelt Megatron-Core field")

    monkeypatch.setattr(trainer_main, "connect_ray", connect_ray)
    code = trainer_main.main([str(RECIPE), "actor.megatron.transformer.sequence_paralel=true"])
    assert code == 2
    assert "did you mean megatron.transformer.sequence_parallel?" in capsys.readouterr().err


def test_sglang_server_args_by_name():
    cfg = load_recipe(
        RECIPE, ["rollout.sglang.enable_torch_compile=true", "rollout.sglang.torch_compile_max_bs=8"]
    )
    assert cfg.rollout.sglang == {"enable_torch_compile": True, "torch_compile_max_bs": 8}
    with pytest.raises(ValueError, match=r"did you mean rollout\.sglang\.enable_torch_compile\?"):
        load_recipe(RECIPE, ["rollout.sglang.enable_torch_compil=true"])
    with pytest.raises(
        ValueError,
        match=rf"sets SGLang {re.escape(SGLANG_VERSION)} ServerArgs\.tp_size from "
        r"rollout\.tensor_model_parallel_size",
    ):
        load_recipe(RECIPE, ["rollout.sglang.tp_size=2"])
    with pytest.raises(ValueError, match=r"rollout\.sglang is set but rollout\.name='hf'"):
        load_recipe(
            RECIPE,
            [
                "rollout.name=hf",
                "rollout.tensor_model_parallel_size=1",
                "rollout.sglang.enable_torch_compile=true",
            ],
        )


SERVER_ARGS_05 = '''
from sglang.srt.arg_groups.fields.exec_ import ExecGraph
from sglang.srt.arg_groups.fields.model import Model

class ServerArgs:
    """Assembled from the namespaces."""

_INPUT_NAMESPACES = [Model, ExecGraph]
'''
FIELDS_MODEL = """
class Model(msgspec.Struct):
    _NS_PATH: ClassVar[str] = "model"
    model_path: A[str, Arg(help="the model", aliases=["--model"])]
    revision: A[Optional[str], "a revision"] = None
"""
FIELDS_EXEC = """
class Base(msgspec.Struct):
    cuda_graph_max_bs: A[Optional[int], "max batch"] = None

class ExecGraph(Base):
    enable_torch_compile: A[bool, "compile"] = False
    _private: int = 0
"""


def test_server_args_list_is_generated_from_the_wheel_source(tmp_path):
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("sglang/srt/server_args.py", SERVER_ARGS_05)
        archive.writestr("sglang/srt/arg_groups/fields/model.py", FIELDS_MODEL)
        archive.writestr("sglang/srt/arg_groups/fields/exec_.py", FIELDS_EXEC)
    out = tmp_path / "fields.py"
    subprocess.run(
        [sys.executable, ROOT / "scripts" / "gen_sglang_server_args.py", wheel, "--out", out], check=True
    )
    namespace = {}
    exec(out.read_text(), namespace)
    assert namespace["SGLANG_VERSION"] == "9.9.9"
    assert namespace["SERVER_ARGS_FIELDS"] == {
        "cuda_graph_max_bs": "Optional[int]",
        "enable_torch_compile": "bool",
        "model_path": "str",
        "revision": "Optional[str]",
    }


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_overlap_param_gather_is_refused_because_weights_are_read_right_after_the_step(role):
    """With the distributed optimizer the updated bf16 parameters would be all-gathered only at the
    next forward, after the weight sync / checkpoint / export that follow the step have read them."""
    with pytest.raises(ValueError) as err:
        load_recipe(RECIPE, [f"{role}.megatron.ddp.overlap_param_gather=true"])
    assert "megatron.ddp.overlap_param_gather=True is not supported" in str(err.value)
    assert "set it to false" in str(err.value)
    cfg = load_recipe(RECIPE, [f"{role}.megatron.ddp.overlap_param_gather=false"])
    assert getattr(cfg, role).megatron.ddp == {"overlap_param_gather": False}
