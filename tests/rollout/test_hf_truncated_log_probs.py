"""The `hf` engine's log-probs under top-p / top-k sampling are those of the distribution it
sampled from: an independent forward of the checkpoint, through transformers' own warpers
(temperature, then top-k, then top-p, as `generate` applies them), renormalised over the tokens
they keep (docs/sampling.md)."""

import math

import pytest
import torch
from hf_prompts import PROMPT_WIDTH, make_cfg, make_prompts

from engines.rollout.config import SamplingConfig
from engines.rollout.hf_rollout import HFRolloutEngine

MAX_NEW = 9
SETTINGS = {"top_p": dict(top_p=0.9), "top_k": dict(top_k=20), "both": dict(top_k=40, top_p=0.8)}


def warped_log_probs(model, out, temperature: float, top_k: int = -1, top_p: float = 1.0):
    """log_softmax of transformers' warped scores at the positions predicting the responses of the
    rollout output `out`, -inf outside the kept tokens. (B, R, V)"""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    with torch.no_grad():
        logits = model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits[:, PROMPT_WIDTH - 1 : -1]  # (B, R, V)
    scores = TemperatureLogitsWarper(temperature)(None, logits.flatten(0, 1))  # (B*R, V)
    if top_k != -1:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.log_softmax(-1).view(logits.shape)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_log_probs_and_top_k_are_of_the_truncated_distribution(checkpoint, reference_model, setting):
    temperature, k = 0.7, 4
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=temperature, **SETTINGS[setting])
    engine = HFRolloutEngine(checkpoint, make_cfg(sampling=sampling, top_k_log_probs=k))
    out = engine.generate_sequences(make_prompts(data_seed=5, seed=11))
    expected = warped_log_probs(reference_model, out, temperature, **SETTINGS[setting])  # (B, R, V)
    mask = out.batch["response_mask"].bool()  # (B, R)
    sampled = expected.gather(-1, out.batch["responses"][..., None]).squeeze(-1)  # (B, R)
    assert sampled[mask].isfinite().all()  # every sampled token is one the warpers kept
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], sampled[mask], atol=1e-4, rtol=1e-4)
    assert (expected[mask] == -math.inf).any()  # the filters drop tokens here: the check has teeth
    top = expected.topk(k)  # (B, R, K), -inf where fewer than K tokens are kept
    torch.testing.assert_close(
        out.batch["rollout_top_k_log_probs"][mask], top.values[mask], atol=1e-4, rtol=0
    )
