"""LoRA on the Megatron actor equals transformers + peft with the same adapters, at TP 1, TP 2
and PP 2 (one torchrun launch each, _lora_parity.py): logits with adapters on and off, the
adapters exported back, one update's adapter gradients and grad norm, the adapters after one
AdamW step, base weights frozen and out of the optimizer, and the merged weight stream: equal to
peft's merge_and_unload() of the same adapters, and after the step made of the stepped adapters.

The adapters are peft's own, drawn nonzero (B too), so a misplaced row of a fused q/k/v or
gate/up adapter changes the logits.
"""

import dataclasses
import json

import pytest
import torch
from _train_settings import OPTIM
from launch import run_distributed
from tiny_hf import make_tiny_hf_checkpoint, padded_batch

pytestmark = pytest.mark.slow

LORA = dict(
    rank=4, alpha=8.0, dropout=0.0, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
)
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (tag, nproc, tp, pp); tp2 saves the checkpoint the others resume from (_lora_parity.SAVING)
LAUNCHES = [("tp2", 2, 2, 1), ("tp1", 1, 1, 1), ("pp2", 2, 1, 2)]
PROMPT_LEN, RESPONSE_LEN, VOCAB = 5, 4, 200  # PROMPT_LEN: _model_parity_worker.nll_loss's
PADDED_VOCAB = 256  # VOCAB rounded up to a multiple of 128 x TP (make_vocab_size_divisible_by)
OPTIM_CONSTANT = dataclasses.replace(OPTIM, lr_decay_style="constant")
MOE_LORA = {**LORA, "target_modules": ["linear_qkv", "linear_proj"]}  # no MLP adapters on experts


def peft_model(hf_dir, targets=HF_TARGETS):
    """transformers + peft with nonzero seeded adapters on `targets` (dropout 0)."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=targets
    )
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def nll(logits, batch):
    logp = torch.log_softmax(logits[:, PROMPT_LEN - 1 : -1], dim=-1)  # (B, R, V)
    mask = batch["response_mask"].float()
    return -(logp.gather(-1, batch["responses"][..., None]).squeeze(-1) * mask).sum() / mask.sum()


def saved_name(name: str) -> str:
    """peft's in-memory parameter name -> its adapter_model.safetensors key."""
    return name.replace(".default.", ".")


def peft_reference(hf_dir, batch) -> dict:
    """Logits on / off, adapters, base and merged weights, NLL gradients, grad norm, one AdamW step."""
    import copy

    from peft import get_peft_model_state_dict

    model = peft_model(hf_dir)
    merged = {k: v.detach() for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    adapters = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    with torch.no_grad(), model.disable_adapter():
        base_logits = model(**inputs).logits
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v.detach().clone()
            for k, v in model.state_dict().items() if "lora_" not in k}  # fmt: skip
    logits = model(**inputs).logits
    nll(logits, batch).backward()
    params = {saved_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    grads = {n: p.grad.clone() for n, p in params.items()}
    grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), OPTIM.clip_grad).item()
    opt = torch.optim.AdamW(
        list(params.values()),
        lr=OPTIM.lr,
        weight_decay=OPTIM.weight_decay,  # Megatron-Core decays every 2-D parameter
        betas=(OPTIM.adam_beta1, OPTIM.adam_beta2),
        eps=OPTIM.adam_eps,
    )
    opt.step()
    stepped = {n: p.detach().clone() for n, p in params.items()}
    return dict(logits=logits.detach(), base_logits=base_logits, adapters=adapters, grads=grads,
                grad_norm=grad_norm, stepped=stepped, merged=merged, base=base)  # fmt: skip


def moe_attention_reference(hf_dir, batch) -> dict:
    """peft's attention adapters on the Qwen3-MoE model (QK norm after q/k_proj): adapters, logits."""
    from peft import get_peft_model_state_dict

    model = peft_model(hf_dir, ["q_proj", "k_proj", "v_proj", "o_proj"])
    with torch.no_grad():
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
        with model.disable_adapter():
            base_logits = model(
                **{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
            ).logits
    adapters = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    return {"adapters": adapters, "logits": logits, "base_logits": base_logits}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_parity")
    hf_dir = make_tiny_hf_checkpoint(root / "hf", num_layers=4, vocab_size=VOCAB, seed=3)
    batch = padded_batch([3, 5, 2, 4], [4, 2, 4, 1], PROMPT_LEN, RESPONSE_LEN, VOCAB, seed=1)
    reference = peft_reference(hf_dir, batch)
    torch.save(batch, root / "batch.pt")
    torch.save(reference["adapters"], root / "adapters.pt")
    (root / "lora.json").write_text(json.dumps(LORA))
    moe_dir = make_tiny_hf_checkpoint(
        root / "moe_hf", arch="qwen3_moe", num_layers=4, vocab_size=VOCAB, seed=4
    )
    moe_reference = moe_attention_reference(moe_dir, batch)
    torch.save(moe_reference["adapters"], root / "moe_adapters.pt")
    (root / "moe_lora.json").write_text(json.dumps(MOE_LORA))
    for tag, nproc, tp, pp in LAUNCHES:
        run_distributed("_lora_parity.py", nproc, root, tp, pp, tag, timeout=300)
    return {
        "root": root,
        "hf": hf_dir,
        "batch": batch,
        "reference": reference,
        "moe_reference": moe_reference,
        **{tag: torch.load(root / f"{tag}.pt") for tag, *_ in LAUNCHES},
    }


def assert_close(actual, expected, name, tol=1e-5):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def assert_all_close(actual: dict, expected: dict, tol=1e-5):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert_close(actual[name], expected[name], name, tol)


TAGS = [tag for tag, *_ in LAUNCHES]


@pytest.mark.parametrize("tag", TAGS)
def test_logits_equal_peft_with_adapters_on_and_off(runs, tag):
    real = runs["batch"]["attention_mask"].bool()
    ref = runs["reference"]
    assert (ref["logits"] - ref["base_logits"])[real].abs().max() > 0.1  # the adapters matter
    assert_close(runs[tag]["logits"][real], ref["logits"][real], "logits")
    assert_close(runs[tag]["base_logits"][real], ref["base_logits"][real], "logits, adapters disabled")


@pytest.mark.parametrize("tag", TAGS)
def test_adapters_export_in_peft_names_bit_for_bit(runs, tag):
    expected = runs["reference"]["adapters"]
    exported = runs[tag]["exported"]
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("tag", TAGS)
def test_one_update_gradients_and_step_equal_the_single_process_reference(runs, tag):
    ref, run = runs["reference"], runs[tag]
    assert_all_close(run["grads"], ref["grads"])
    assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert ref["grad_norm"] > OPTIM.clip_grad  # clipping (with the duplicate-free norm) matters
    assert_all_close(run["stepped"], ref["stepped"])


@pytest.mark.parametrize("tag", TAGS)
def test_base_weights_are_frozen_and_only_adapters_are_optimized(runs, tag):
    per_rank = runs[tag]["per_rank"]
    for rank in per_rank:
        assert rank["base_moved"] == [] and rank["base_with_grad"] == []
        assert rank["optimizer_is_adapters"] and rank["trainable"] > 0
    whole = sum(t.numel() for t in runs["reference"]["adapters"].values())
    if tag == "tp1":
        assert per_rank[0]["trainable"] == whole


@pytest.mark.parametrize("tag", TAGS)
def test_parameter_counts_and_optimizer_state_cover_the_adapters_only(runs, tag):
    adapters = sum(t.numel() for t in runs["reference"]["adapters"].values())
    base = sum(t.numel() for t in runs["reference"]["base"].values())
    hidden = runs["reference"]["base"]["lm_head.weight"].shape[1]
    base += 2 * (PADDED_VOCAB - VOCAB) * hidden  # Megatron's padded rows of the embedding and head
    for rank in runs[tag]["per_rank"]:  # the same whole-model counts on every rank
        assert rank["counts"]["trainable_params"] == adapters
        assert rank["counts"]["total_params"] == base + adapters
        # Adam's two fp32 moments of this rank's adapters (and nothing for the frozen base)
        assert rank["counts"]["optimizer_state_bytes"] == 2 * 4 * rank["trainable"]


@pytest.mark.parametrize("tag", TAGS)
def test_merged_weight_stream_equals_peft_merge_and_unload(runs, tag):
    merged, expected = runs[tag]["merged"], runs["reference"]["merged"]
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name


@pytest.mark.parametrize("tag", TAGS)
def test_merged_stream_after_a_step_carries_the_stepped_adapters(runs, tag):
    before, after, stepped = runs[tag]["merged"], runs[tag]["merged_after_step"], runs[tag]["stepped"]
    scale = LORA["alpha"] / LORA["rank"]
    for name, tensor in runs["reference"]["base"].items():
        module = f"base_model.model.{name.removesuffix('.weight')}"
        a, b = stepped.get(f"{module}.lora_A.weight"), stepped.get(f"{module}.lora_B.weight")
        expected = tensor if a is None else tensor + (b @ a) * scale
        assert torch.equal(after[name], expected), name
        assert a is None or not torch.equal(after[name], before[name]), name


@pytest.mark.parametrize("tag", TAGS)
def test_peft_loads_the_exported_adapter_directory_and_reproduces_the_logits(runs, tag):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(runs["hf"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, runs["root"] / f"peft_{tag}")
    loaded = get_peft_model_state_dict(model)
    assert sorted(loaded) == sorted(runs["reference"]["adapters"])
    for name, tensor in runs["reference"]["adapters"].items():
        assert torch.equal(loaded[name], tensor), name
    batch, real = runs["batch"], runs["batch"]["attention_mask"].bool()
    with torch.no_grad():
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
    assert_close(logits[real], runs[tag]["logits"][real], "logits of the peft-loaded export")


@pytest.mark.parametrize("tag", ["tp1", "pp2"])
def test_adapter_checkpoint_saved_at_tp2_resumes_at_another_layout(runs, tag):
    saved, resumed = runs["tp2"], runs[tag]["resumed"]
    assert sorted(resumed["loaded"]) == sorted(saved["stepped"])
    for name, tensor in saved["stepped"].items():
        assert torch.equal(resumed["loaded"][name], tensor), name
    # the step after resuming needs the adapters' Adam moments and the LR schedule restored
    assert_all_close(resumed["next_step"], saved["next_step"])
    moved = [n for n, t in saved["next_step"].items() if not torch.equal(t, saved["stepped"][n])]
    assert len(moved) == len(saved["stepped"])


def test_adapter_dropout_masks_do_not_depend_on_tensor_parallelism(runs):
    """Every TP rank draws the same mask over the whole input (column-parallel ranks use it all,
    row-parallel ranks their columns), so TP 2 drops what TP 1 drops; masks that differed between
    ranks would mix differently dropped rows into one output."""
    real = runs["batch"]["attention_mask"].bool()
    tp1, tp2 = runs["tp1"]["dropout_logits"][real], runs["tp2"]["dropout_logits"][real]
    assert (tp1 - runs["tp1"]["logits"][real]).abs().max() > 0.1  # dropout acted
    assert_close(tp2, tp1, "logits with adapter dropout")


@pytest.mark.parametrize("tag", ["tp2", "pp2"])
def test_initial_adapters_do_not_depend_on_the_layout(runs, tag):
    expected, actual = runs["tp1"]["initial"], runs[tag]["initial"]
    assert sorted(actual) == sorted(expected) == sorted(runs["reference"]["adapters"])
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
        assert tensor.any() == name.endswith("lora_A.weight"), name  # A drawn, B zero


@pytest.mark.parametrize("tag", TAGS)
def test_attention_adapters_on_a_mixture_of_experts_model_equal_peft(runs, tag):
    real, ref = runs["batch"]["attention_mask"].bool(), runs["moe_reference"]
    assert (ref["logits"] - ref["base_logits"])[real].abs().max() > 0.1  # the adapters matter
    assert_close(runs[tag]["moe_logits"][real], ref["logits"][real], "MoE logits")
