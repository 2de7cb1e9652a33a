"""The preflight's weights-against-config.json check on tiny models of every supported
architecture, and the checkpoint size estimate (hybridflow/checks/models.py)."""

import json

import pytest

from hybridflow.checks.models import check_safetensors, check_weight_shapes, checkpoint_bytes, parameter_count
from hybridflow.config.loader import load_recipe
from hybridflow.utils.tiny_model import ARCHS, MOE_ARCHS, make_tiny_model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_weights_of_every_architecture_match_their_config(arch, tied, tmp_path):
    experts = {"num_experts": 4} if arch in MOE_ARCHS else {}
    model = make_tiny_model(tmp_path / arch, arch=arch, num_layers=2, tie_word_embeddings=tied, **experts)
    headers = check_safetensors("model.path", model)
    assert ("lm_head.weight" in headers) != tied
    check_weight_shapes("model.path", model, headers, value_head=False)


def with_config(model, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))


def test_experts_the_weights_hold_beyond_config_json_are_counted(tmp_path):
    model = make_tiny_model(tmp_path / "moe", arch="mixtral", num_layers=2, num_experts=4)
    headers = check_safetensors("model.path", model)
    with_config(model, num_local_experts=2)
    router = {name: shape for name, shape in headers.items() if name.endswith("gate.weight")}
    # without the routers (whose shape names the count first) the expert count itself is reported
    headers = {name: shape for name, shape in headers.items() if name not in router}
    with pytest.raises(
        ValueError, match=r"the weights hold 4 experts a layer \(numbered 0 to 3\), num_local_experts=2"
    ):
        check_weight_shapes("model.path", model, headers, value_head=False)


def test_a_value_head_directory_needs_no_lm_head_but_a_policy_does(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", num_layers=2)
    headers = {k: v for k, v in check_safetensors("model.path", model).items() if k != "lm_head.weight"}
    check_weight_shapes("reward_model.path", model, headers, value_head=True)
    with pytest.raises(
        ValueError, match=r"lm_head.weight is missing \(1 tensors config.json implies are absent\)"
    ):
        check_weight_shapes("model.path", model, headers, value_head=False)


def test_a_checkpoint_holds_weights_and_adam_state_of_each_trained_role(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", num_layers=2)
    count = parameter_count(check_safetensors("model.path", model))
    assert count == sum(
        p.numel()
        for p in __import__("safetensors.torch").torch.load_file(model / "model.safetensors").values()
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: m}\ndata: {train_files: [t]}\n")
    cfg = load_recipe(str(recipe), ["critic.enable=true", "critic.megatron.params_dtype=bfloat16"])
    assert checkpoint_bytes(cfg, {"actor": count, "critic": 10}) == count * (4 + 8) + 10 * (2 + 8 + 4)
