"""The `hf` rollout engine against transformers itself, on a tiny random Qwen2 checkpoint.

References are independent of the engine: transformers `generate` / forward on the checkpoint
loaded with `from_pretrained`, and masks/positions recomputed from their definitions.
"""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hf_prompts import MAX_NEW, PROMPT_LENGTHS, PROMPT_WIDTH, RESPONSE_LENGTH, make_cfg, make_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from tiny_hf import make_tiny_hf_checkpoint

from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.hf_rollout import HFRolloutEngine
from engines.weight_sync.common import tensor_checksum
from hybridflow.protocol import DataProto

EOS, PAD = 1, 0


def reference_greedy(model, prompts: DataProto, max_new_tokens: int) -> torch.Tensor:
    """transformers' own greedy continuation, (B, L)."""
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts.batch["input_ids"],
            attention_mask=prompts.batch["attention_mask"],
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    return out[:, PROMPT_WIDTH:]


def with_eos(checkpoint: Path, target: Path, eos_ids: list[int]) -> Path:
    """A copy of the checkpoint whose generation_config.json declares `eos_ids`."""
    import shutil

    from transformers import GenerationConfig

    shutil.copytree(checkpoint, target)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=PAD).save_pretrained(target)
    return target


def test_output_layout_masks_and_positions(checkpoint):
    engine = HFRolloutEngine(checkpoint, make_cfg())
    prompts = make_prompts(data_seed=1)
    out = engine.generate_sequences(prompts)
    batch = out.batch
    rows = len(PROMPT_LENGTHS)
    assert batch["prompts"].shape == (rows, PROMPT_WIDTH)
    assert batch["responses"].shape == batch["response_mask"].shape == (rows, RESPONSE_LENGTH)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch[key].shape == (rows, PROMPT_WIDTH + RESPONSE_LENGTH)
        assert batch[key].dtype == torch.int64
    assert torch.equal(batch["prompts"], prompts.batch["input_ids"])
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], dim=1))
    assert torch.equal(batch["attention_mask"][:, :PROMPT_WIDTH], prompts.batch["attention_mask"])
    assert torch.equal(batch["attention_mask"][:, PROMPT_WIDTH:], batch["response_mask"])
    mask = batch["response_mask"]
    # A prefix of ones, never longer than max_new_tokens; padding holds the pad id.
    assert (mask[:, 1:] <= mask[:, :-1]).all()
    assert (mask[:, MAX_NEW:] == 0).all() and (mask.sum(1) >= 1).all()
    assert (batch["responses"][mask == 0] == PAD).all()
    # Ones up to and including the first EOS and nothing after it.
    for row in range(rows):
        valid = batch["responses"][row, : int(mask[row].sum())]
        assert (valid[:-1] != EOS).all()
    # Positions continue the prompt's: on real tokens they equal cumsum(mask) - 1.
    positions, attention = batch["position_ids"], batch["attention_mask"]
    expected = attention.cumsum(-1) - 1
    assert torch.equal(positions[attention == 1], expected[attention == 1])
    steps = torch.arange(1, RESPONSE_LENGTH + 1)
    assert torch.equal(positions[:, PROMPT_WIDTH:], positions[:, PROMPT_WIDTH - 1 : PROMPT_WIDTH] + steps)
    assert list(out.non_tensor_batch["uid"]) == list(prompts.non_tensor_batch["uid"])
    # A rank whose slice of the batch is empty still returns the layout.
    empty = engine.generate_sequences(prompts[0:0])
    assert empty.batch["input_ids"].shape == (0, PROMPT_WIDTH + RESPONSE_LENGTH)


def test_greedy_matches_transformers_and_is_deterministic(checkpoint, reference_model):
    engine = HFRolloutEngine(checkpoint, make_cfg())
    prompts = make_prompts(data_seed=2, validate=True)
    first = engine.generate_sequences(prompts)
    second = engine.generate_sequences(prompts)
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    expected = reference_greedy(reference_model, prompts, MAX_NEW)
    width = expected.shape[1]
    got, mask = first.batch["responses"][:, :width], first.batch["response_mask"][:, :width]
    assert torch.equal(got, expected.masked_fill(mask == 0, PAD))


def test_generation_stops_at_eos(checkpoint, reference_model, tmp_path):
    prompts = make_prompts(data_seed=3, validate=True)
    free_run = reference_greedy(reference_model, prompts, MAX_NEW)  # the checkpoint's EOS is never hit
    # Declare as a second EOS a token the model emits mid-sequence in row 0.
    stop_token = int(free_run[0, 3])
    first_hits = [(row == stop_token).nonzero() for row in free_run]
    engine = HFRolloutEngine(with_eos(checkpoint, tmp_path / "eos", [EOS, stop_token]), make_cfg())
    out = engine.generate_sequences(prompts)
    for row, hits in enumerate(first_hits):
        expected_len = int(hits[0]) + 1 if len(hits) else MAX_NEW
        assert int(out.batch["response_mask"][row].sum()) == expected_len
        assert torch.equal(out.batch["responses"][row, :expected_len], free_run[row, :expected_len])
        assert (out.batch["responses"][row, expected_len:] == PAD).all()
    assert int(out.batch["response_mask"][0].sum()) <= 4


def test_stop_string_truncates_and_masks(checkpoint, reference_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = make_prompts(data_seed=4, validate=True)
    free_run = reference_greedy(reference_model, prompts, MAX_NEW)
    # Two characters the model emits in row 0, from two one-character tokens (not a special
    # token's text, which decodes to several characters).
    first = free_run[0].tolist()
    single = [len(tokenizer.decode([token])) == 1 for token in first]
    start = next(k for k in range(1, len(first) - 1) if single[k] and single[k + 1])
    stop = tokenizer.decode(first[start : start + 2])
    val = SamplingConfig(do_sample=False, temperature=0.0, max_new_tokens=MAX_NEW, stop=[stop])
    engine = HFRolloutEngine(checkpoint, make_cfg(val_sampling=val))
    out = engine.generate_sequences(prompts)
    for row in range(len(PROMPT_LENGTHS)):
        ids = free_run[row].tolist()
        ids = ids[: ids.index(EOS) + 1] if EOS in ids else ids
        prefixes_with_stop = (k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
        expected_len = next(prefixes_with_stop, len(ids))
        length = int(out.batch["response_mask"][row].sum())
        assert length == expected_len, f"row {row}"
        kept = out.batch["responses"][row, :length].tolist()
        assert kept == ids[:length]
        assert (out.batch["responses"][row, length:] == PAD).all()
    first_row = out.batch["responses"][0, : int(out.batch["response_mask"][0].sum())]
    assert tokenizer.decode(first_row).endswith(stop)


def test_n_samples_repeat_rows_and_non_tensors(checkpoint):
    engine = HFRolloutEngine(checkpoint, make_cfg(sampling=SamplingConfig(n=3, max_new_tokens=MAX_NEW)))
    prompts = make_prompts(data_seed=5)
    out = engine.generate_sequences(prompts)
    rows = len(PROMPT_LENGTHS)
    assert len(out) == 3 * rows
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))
    assert list(out.non_tensor_batch["uid"]) == [f"prompt-{r}" for r in range(rows) for _ in range(3)]
    samples = out.batch["responses"].view(rows, 3, RESPONSE_LENGTH)
    assert any(not torch.equal(samples[r, 0], samples[r, 1]) for r in range(rows)), "samples should differ"
    # A caller that repeats the batch itself asks for one sample per row.
    assert len(engine.generate_sequences(make_prompts(data_seed=5, n=1))) == rows


def test_seeded_sampling_and_rng_state(checkpoint):
    engine = HFRolloutEngine(checkpoint, make_cfg())
    prompts = make_prompts(data_seed=6)
    a = engine.generate_sequences(make_prompts(data_seed=6)).batch["responses"]
    state = engine.get_rng_state()
    b = engine.generate_sequences(prompts).batch["responses"]
    assert not torch.equal(a, b), "consecutive calls draw different samples"
    engine.set_rng_state(state)
    assert torch.equal(engine.generate_sequences(prompts).batch["responses"], b)
    # An explicit seed wins over the call counter, on any engine instance.
    other = HFRolloutEngine(checkpoint, make_cfg())
    seeded = make_prompts(data_seed=6, seed=1234)
    mine, theirs = engine.generate_sequences(seeded), other.generate_sequences(seeded)
    assert torch.equal(mine.batch["responses"], theirs.batch["responses"])
    # The sharding manager's per-rank seed stream gives another rank's slice other samples.
    streamed = make_prompts(data_seed=6, seed=1234, rollout_seed_stream=3)
    assert not torch.equal(engine.generate_sequences(streamed).batch["responses"], mine.batch["responses"])
    with pytest.raises(ValueError, match="calls"):
        engine.set_rng_state({"calls": -1})


def test_validation_calls_leave_the_training_samples_as_they_were(checkpoint):
    """Validation calls count apart from training calls (SamplingPosition): validating between two
    training calls does not change what the second one samples, and validation's own sampled draws
    are not a training call's (before, a validation call took the next training seed)."""
    sampled_val = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0)
    validating, plain = (HFRolloutEngine(checkpoint, make_cfg(val_sampling=sampled_val)) for _ in range(2))
    prompts = make_prompts(data_seed=7)
    for engine in (validating, plain):
        engine.generate_sequences(prompts)
    val = validating.generate_sequences(make_prompts(data_seed=7, validate=True)).batch["responses"]
    second = [engine.generate_sequences(prompts).batch["responses"] for engine in (validating, plain)]
    assert torch.equal(second[0], second[1])
    assert not torch.equal(val, second[1])
    assert validating.get_rng_state() == {"calls": 2, "val_calls": 1}
    validating.set_rng_state({"calls": 2})  # saved before validation calls were counted apart
    assert validating.get_rng_state() == {"calls": 2, "val_calls": 0}
    with pytest.raises(ValueError, match="val_calls"):
        validating.set_rng_state({"calls": 2, "val_calls": -1})


def reference_response_log_probs(reference_model, out, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of an independent forward at the positions predicting the responses
    of the rollout output `out`. (B, R, V)"""
    with torch.no_grad():
        logits = reference_model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits  # (B, P+R, V)
    return (logits[:, PROMPT_WIDTH - 1 : -1] / temperature).log_softmax(-1)


def test_rollout_log_probs_match_a_forward_pass(checkpoint, reference_model):
    temperature = 0.7
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=temperature)
    engine = HFRolloutEngine(checkpoint, make_cfg(sampling=sampling, calculate_log_probs=True))
    out = engine.generate_sequences(make_prompts(data_seed=7))
    log_probs = reference_response_log_probs(reference_model, out, temperature)  # (B, R, V)
    expected = log_probs.gather(-1, out.batch["responses"][..., None]).squeeze(-1)
    expected = expected * out.batch["response_mask"]
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected, atol=1e-4, rtol=1e-4)


def test_top_k_log_probs_match_a_forward_pass(checkpoint, reference_model):
    """K = 3: each response position also carries log_softmax(logits / T).topk(3) of an independent
    forward, likeliest first, 0 on padding; the samples and their log-probs are those of K = 0."""
    k, temperature = 3, 0.7
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=temperature)
    prompts = make_prompts(data_seed=9, seed=77)
    plain = HFRolloutEngine(checkpoint, make_cfg(sampling=sampling)).generate_sequences(prompts)
    engine = HFRolloutEngine(checkpoint, make_cfg(sampling=sampling, top_k_log_probs=k))
    out = engine.generate_sequences(prompts)
    assert torch.equal(out.batch["responses"], plain.batch["responses"])
    assert torch.equal(out.batch["rollout_log_probs"], plain.batch["rollout_log_probs"])
    ids, log_probs = out.batch["rollout_top_k_ids"], out.batch["rollout_top_k_log_probs"]  # (B, R, K)
    assert ids.shape == log_probs.shape == (len(PROMPT_LENGTHS), RESPONSE_LENGTH, k)
    assert (ids.dtype, log_probs.dtype) == (torch.int64, torch.float32)
    expected = reference_response_log_probs(reference_model, out, temperature).topk(k)  # (B, R, K)
    mask = out.batch["response_mask"].bool()  # (B, R)
    torch.testing.assert_close(log_probs[mask], expected.values[mask], atol=1e-5, rtol=0)
    assert torch.equal(ids[mask], expected.indices[mask])
    assert (log_probs[mask][:, :-1] >= log_probs[mask][:, 1:]).all()
    assert (~mask).any() and (ids[~mask] == 0).all() and (log_probs[~mask] == 0).all()
    empty = engine.generate_sequences(prompts[0:0])
    assert empty.batch["rollout_top_k_ids"].shape == (0, RESPONSE_LENGTH, k)


def test_dummy_engine_takes_pushed_weights(checkpoint, reference_model):
    engine = HFRolloutEngine(checkpoint, make_cfg(load_format="dummy"))
    prompts = make_prompts(data_seed=8, validate=True)
    expected = reference_greedy(reference_model, prompts, MAX_NEW)
    before = engine.generate_sequences(prompts).batch["responses"]
    assert not torch.equal(before[:, : expected.shape[1]], expected)
    engine.update_weights(reference_model.state_dict().items())
    got = engine.generate_sequences(prompts)
    assert torch.equal(got.batch["responses"][:, : expected.shape[1]], expected)
    reference = reference_model.state_dict()
    assert engine.weight_checksums() == {name: tensor_checksum(reference[name]) for name in reference}


def test_update_weights_rejects_unknown_names_and_shapes(checkpoint):
    engine = HFRolloutEngine(checkpoint, make_cfg())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.not_a_weight"):
        engine.update_weights([("model.layers.0.mlp.not_a_weight", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_bad_prompts_and_config_are_rejected(checkpoint):
    engine = HFRolloutEngine(checkpoint, make_cfg())
    prompts = make_prompts()
    right_padded = DataProto.from_dict(
        {k: v.flip(1) for k, v in prompts.batch.items()}, meta_info={"validate": True}
    )
    with pytest.raises(ValueError, match="left-padded"):
        engine.generate_sequences(right_padded)
    with pytest.raises(ValueError, match="position_ids"):
        engine.generate_sequences(prompts.select(batch_keys=["input_ids", "attention_mask"]))
    with pytest.raises(ValueError, match="meta_info\\['n'\\]"):
        engine.generate_sequences(make_prompts(n=0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        RolloutConfig(response_length=8, sampling=SamplingConfig(max_new_tokens=9))
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        RolloutConfig(name="hf", tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="do_sample"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match=r"config\.json"):
        HFRolloutEngine(checkpoint.parent, make_cfg())
    assert replace(make_cfg(), response_length=64).max_new_tokens(SamplingConfig()) == 64


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_checkpoint_tensors_are_what_transformers_saves_and_load_into_fused_experts(arch, tmp_path):
    """transformers 5 fuses experts in memory and splits them per expert on save: the engine's
    names and tensors are exactly the saved checkpoint's, and writing them moves the fused weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engines.rollout.hf_rollout import checkpoint_tensors

    hf_dir = make_tiny_hf_checkpoint(tmp_path / arch, arch=arch, num_layers=2)
    saved = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        saved.update(load_file(shard))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tensors = checkpoint_tensors(model)
    assert sorted(tensors) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(tensors[name], tensor), name
    engine = HFRolloutEngine(hf_dir, RolloutConfig(load_format="dummy"), device="cpu")
    engine.update_weights(saved.items())
    for name, tensor in saved.items():
        assert torch.equal(checkpoint_tensors(engine.model)[name], tensor), name
    assert engine.weight_checksums() == {name: tensor_checksum(t) for name, t in saved.items()}
