"""Quickstart pieces that run without Ray: both recipes load and pass the recipe check (GRPO and
the PPO option), SFT batches are laid out as the actor expects, and the script's CLI."""

import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.checks.recipe import validate_recipe
from hybridflow.config.loader import load_recipe
from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.data.sft_dataset import SFTDataset, collate_sft
from hybridflow.utils.tiny_model import make_tiny_model

# the shipped recipes' relative paths exist, as after `make quickstart` (tests/working_tree.py)
pytestmark = pytest.mark.usefixtures("in_quickstart_working_tree")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart")
    model = make_tiny_model(root / "tiny_model")
    data = write_arith_parquet(root / "data", ArithConfig(num_train=40, num_test=8))
    return {"model": model, "data": data, "tokenizer": AutoTokenizer.from_pretrained(model)}


def paths(local) -> list[str]:
    return [
        f"model.path={local['model']}",
        f"data.train_files=[{local['data']['train']}]",
        f"data.val_files=[{local['data']['test']}]",
    ]


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("recipes/quickstart_sft.yaml", []),
        ("recipes/quickstart.yaml", []),
        ("recipes/quickstart.yaml", ["algorithm.adv_estimator=gae", "critic.enable=true"]),
        ("recipes/tool_demo_sft.yaml", []),
        ("recipes/tool_demo.yaml", []),
    ],
)
def test_recipes_pass_the_recipe_check_on_two_cpu_processes(local, recipe, extra):
    cfg = load_recipe(ROOT / recipe, [*paths(local), *extra])
    layout = validate_recipe(cfg, cuda_available=False)
    assert cfg.trainer.n_gpus_per_node == 2 and not cfg.trainer.use_gpu
    assert cfg.actor.megatron.tensor_model_parallel_size == 2
    assert layout.actor_dp == 1
    assert cfg.trainer.export_hf


@pytest.mark.parametrize("name", ["quickstart", "tool_demo"])
def test_rl_recipe_starts_from_the_sft_export(name):
    sft = load_recipe(ROOT / f"recipes/{name}_sft.yaml")
    rl = load_recipe(ROOT / f"recipes/{name}.yaml")
    assert rl.model.path == f"{sft.trainer.output_dir}/hf"
    assert sft.data.train_files == rl.data.train_files and sft.data.val_files == rl.data.val_files


def test_sft_batch_is_prompt_left_padded_then_response_right_padded(local):
    tok = local["tokenizer"]
    dataset = SFTDataset([str(local["data"]["train"])], tok, max_prompt_length=32, max_response_length=24)
    pairs = [dataset[0], dataset[1]]
    pairs[1] = (pairs[1][0][1:], [*pairs[1][1][:-3], tok.eos_token_id])  # ragged lengths
    batch = collate_sft(pairs, tok.pad_token_id)
    prompt_len = max(len(p) for p, _ in pairs)
    response_len = max(len(r) for _, r in pairs)
    assert batch["input_ids"].shape == (2, prompt_len + response_len)
    assert batch["responses"].shape == batch["response_mask"].shape == (2, response_len)
    for row, (prompt, response) in enumerate(pairs):
        mask = batch["attention_mask"][row]
        real = batch["input_ids"][row][mask.bool()].tolist()
        assert real == prompt + response  # pads only before the prompt and after the response
        assert batch["response_mask"][row].sum() == len(response)
        assert batch["responses"][row, len(response) - 1] == tok.eos_token_id
        positions = batch["position_ids"][row][mask.bool()]
        assert torch.equal(positions, torch.arange(len(prompt) + len(response)))
    assert torch.equal(batch["input_ids"][:, prompt_len:], batch["responses"])
    text = tok.decode(pairs[0][0] + pairs[0][1], skip_special_tokens=False)
    assert text.startswith("<|user|>What is ") and text.endswith("</s>")
    assert "<|assistant|>" in text and "\n#### " in text


def test_sft_dataset_drops_long_rows_and_rejects_all_dropped(local):
    tok = local["tokenizer"]
    files = [str(local["data"]["train"])]
    assert len(SFTDataset(files, tok, 32, 24)) == 40
    # "12+34=46\n#### 46" + EOS is 17 tokens; a three-digit sum makes it 19
    three_digit = sum(
        int(r["reward_model"]["ground_truth"]) >= 100 for r in pq.read_table(files[0]).to_pylist()
    )
    assert 0 < three_digit < 40
    assert SFTDataset(files, tok, 32, 17).num_dropped == three_digit
    assert SFTDataset(files, tok, 16, 24).num_dropped == 0  # "<|user|>What is 12+34?<|assistant|>"
    with pytest.raises(ValueError, match=r"every SFT row .* exceeds data.max_prompt_length=15"):
        SFTDataset(files, tok, 15, 24)


def test_quickstart_script_help_and_bad_argument():
    script = ROOT / "scripts/quickstart.sh"
    shown = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, check=True)
    assert all(flag in shown.stdout for flag in ("--tools", "--ppo", "--fresh", "--engine"))
    assert "set -euo" not in shown.stdout  # the help is the header comment only
    bad = subprocess.run(["bash", script, "--fast"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument: --fast" in bad.stderr
    engine = subprocess.run(["bash", script, "--engine", "trt"], capture_output=True, text=True)
    assert engine.returncode == 2 and "--engine takes hf or vllm, got 'trt'" in engine.stderr
    tools_hf = subprocess.run(["bash", script, "--tools", "--engine", "hf"], capture_output=True, text=True)
    assert tools_hf.returncode == 2 and "--tools needs --engine vllm" in tools_hf.stderr
