"""Worker for tests/megatron/test_truncation.py (launch with torch.distributed.run, 1 or 2 ranks):
the actor's log-probs, entropies, their gradients, its view of the engine's top-K ids and the sum of
squared probabilities (the optimal token baseline's) with no filter and under top-k / top-p sampling
(engines/megatron/forward.py, vocabulary sharded over the TP group, padded columns at the end),
against a reference computed on the whole vocabulary in one process: transformers' warpers over
logits / T, log_softmax, autograd. Prints "TRUNCATION OK".

One label per row is a token the filters drop (as when the engine's logits put it just inside the
kept set and the actor's just outside): it must be kept, with a finite log-prob.
"""

import math
import os

import torch
import torch.distributed as dist
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from engines.megatron.config import MegatronConfig
from engines.megatron.forward import (
    ENGINE_TOP_K_IDS,
    engine_top_k_view,
    response_log_probs,
    response_sum_pi_squared,
)
from engines.megatron.parallel import init_megatron
from hybridflow.algorithms.sampling import Truncation

B, R, VOCAB, PADDED, T = 3, 5, 37, 40, 0.7  # (b, R) response tokens; 37 real ids of 40 columns
CASES = [Truncation(), Truncation(top_p=0.9), Truncation(top_k=6), Truncation(top_k=12, top_p=0.8)]


def reference(logits: torch.Tensor, labels: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """log p (b, R, V) over the real vocabulary: transformers' warpers, the labels kept."""
    scores = TemperatureLogitsWarper(T)(None, logits.flatten(0, 1))  # (b*R, V)
    if truncation.top_k != -1:
        scores = TopKLogitsWarper(truncation.top_k)(None, scores)
    if truncation.top_p < 1.0:
        scores = TopPLogitsWarper(truncation.top_p)(None, scores)
    kept = scores.view(logits.shape) > -math.inf
    kept = kept.scatter(-1, labels[..., None], True)
    return (logits / T).masked_fill(~kept, -math.inf).log_softmax(-1)


def check(truncation: Truncation, rank: int, tp: int) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(B, R, VOCAB, generator=gen) * 2).requires_grad_()  # (b, R, V), every rank
    labels = torch.randint(0, VOCAB, (B, R), generator=gen)  # (b, R)
    labels[:, 0] = (logits / T).argmin(-1)[:, 0].detach()  # the least likely token: every filter drops it
    expected = reference(logits, labels, truncation)  # (b, R, V)
    expected_log_probs = expected.gather(-1, labels[..., None]).squeeze(-1)  # (b, R)
    p = expected.exp()
    expected_entropy = -(p * expected.masked_fill(p == 0, 0.0)).sum(-1)  # (b, R)
    (expected_log_probs.sum() + expected_entropy.sum()).backward()
    expected_grad, logits = logits.grad.clone(), logits.detach()

    width = PADDED // tp
    columns = torch.nn.functional.pad(logits, (0, PADDED - VOCAB))[..., rank * width : (rank + 1) * width]
    output = torch.cat([columns, torch.zeros(B, 1, width)], dim=1).requires_grad_()  # (b, R + 1, Vp / tp)
    ids = (logits / T).topk(4).indices  # (b, R, 4), as an engine would report them
    micro_batch = {"responses": labels, ENGINE_TOP_K_IDS: ids}
    log_probs, entropy = response_log_probs(output, micro_batch, T, VOCAB, "grad", truncation)
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=1e-5)
    assert log_probs[:, 0].isfinite().all()
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
    (log_probs.sum() + entropy.sum()).backward()
    grad = output.grad[:, :-1]  # (b, R, Vp / tp): the positions that predict the responses
    own = torch.nn.functional.pad(expected_grad, (0, PADDED - VOCAB))[..., rank * width : (rank + 1) * width]
    torch.testing.assert_close(grad, own, atol=1e-5, rtol=1e-5)
    view = engine_top_k_view(output.detach(), micro_batch, T, VOCAB, truncation)
    torch.testing.assert_close(view["top_k_log_probs"], expected.gather(-1, ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(view["top1_ids"], ids[..., 0])
    sum_pi_squared = response_sum_pi_squared(output.detach(), micro_batch, T, VOCAB, truncation)  # (b, R)
    torch.testing.assert_close(sum_pi_squared, (p**2).sum(-1), atol=1e-6, rtol=1e-5)


def main() -> None:
    init_megatron(MegatronConfig(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"])))
    rank, tp = dist.get_rank(), dist.get_world_size()
    for truncation in CASES:
        check(truncation, rank, tp)
    dist.barrier()
    if rank == 0:
        print("TRUNCATION OK", flush=True)


if __name__ == "__main__":
    main()
