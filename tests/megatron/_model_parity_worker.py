"""torchrun worker: the Megatron model against transformers, for each (TP, PP) layout given.

Run by test_model_parity.py; also a debugging entry point:
    torchrun --nproc_per_node 4 tests/megatron/_model_parity_worker.py --work-dir /tmp/w --layouts 2x2
(checkpoints are made in --work-dir if absent). A layout is TPxPP or TPxPPxEP[:dispatcher]
(MoE token dispatcher, default allgather); EP > 1 runs only the mixture-of-experts models.
For every layout and tiny model (Qwen2: QKV bias, GQA, untied; Llama: tied embeddings, one KV
head so TP=2 exercises Megatron's KV-head sharing; Qwen3: QK norm; Qwen3-MoE: QK norm, 4 experts
top-2 without renormalisation; Mixtral: top-2 renormalised, tied) it checks, on every rank:
  1. logits equal transformers' on real tokens of a left/right-padded batch (1e-5);
  2. compute_log_prob's log-probs and entropies equal a full-softmax reference (temperature 0.7),
     and so do its log-probs of an engine's top-K ids and its argmax (padded and packed);
  3. gradients of a token-mean NLL through Megatron's schedule and DDP equal transformers' (MoE
     models at TP 1 only: Megatron-Core trains MoE at TP > 1 only with sequence parallelism, which
     needs Transformer Engine's norms on CUDA);
  4. iter_hf_tensors equals the original safetensors bit for bit;
  5. save_hf_checkpoint loads in transformers with identical tensors and a working tokenizer;
  6. a value-head model gives final-norm hidden states @ head, exports as *ForSequenceClassification
     (transformers loads `score.weight`) and loads back with the same values.
Prints "PARITY OK <arch> tp=.. pp=.." per passed combination.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from safetensors.torch import load_file
from tiny_hf import make_tiny_hf_checkpoint, padded_batch

from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.forward import compute_log_prob, run_micro_batches
from engines.megatron.model import load_hf_config, unwrap_model
from engines.megatron.parallel import init_megatron
from engines.megatron.weights import iter_hf_tensors, save_hf_checkpoint
from hybridflow.protocol import DataProto

MODELS = {
    "qwen2": dict(arch="qwen2", vocab_size=200, num_kv_heads=2, tie_word_embeddings=False),
    "llama": dict(arch="llama", vocab_size=120, num_kv_heads=1, tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", vocab_size=150, num_kv_heads=2, tie_word_embeddings=False),
    "qwen3_moe": dict(arch="qwen3_moe", vocab_size=130, num_kv_heads=2, tie_word_embeddings=False),
    "mixtral": dict(
        arch="mixtral", vocab_size=110, num_kv_heads=2, tie_word_embeddings=True, intermediate_size=48
    ),
}
MOE_MODELS = ("qwen3_moe", "mixtral")
PROMPT_LEN, RESPONSE_LEN = 5, 4
TEMPERATURE = 0.7


def make_checkpoints(work_dir: Path) -> None:
    for name, kwargs in MODELS.items():
        if not (work_dir / name / "config.json").exists():
            make_tiny_hf_checkpoint(work_dir / name, num_layers=4, **kwargs)


def the_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    return padded_batch([3, 5, 2, 4], [4, 2, 4, 1], PROMPT_LEN, RESPONSE_LEN, vocab_size, seed=1)


def hf_reference(hf_dir: Path, batch: dict):
    """transformers' logits, final hidden states and NLL gradients (HF names) for `batch`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        output_hidden_states=True,
    )
    logp = torch.log_softmax(out.logits[:, PROMPT_LEN - 1 : -1].float(), dim=-1)  # (B, R, V)
    mask = batch["response_mask"].float()
    nll = -(logp.gather(-1, batch["responses"][..., None]).squeeze(-1) * mask).sum() / mask.sum()
    nll.backward()
    return out.logits.detach(), out.hidden_states[-1].detach(), checkpoint_named_grads(model, hf_dir)


def checkpoint_named_grads(model, hf_dir: Path) -> dict[str, torch.Tensor]:
    """The gradients under the checkpoint's tensor names: transformers 5 fuses MoE experts in
    memory (experts.gate_up_proj) and splits them per expert on save, so let it save them.
    Every rank computed the same gradients; transformers saves on global rank 0 only."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.grad)
    grad_dir = hf_dir.parent / f"{hf_dir.name}_grads"
    model.save_pretrained(grad_dir)
    dist.barrier()
    grads = {}
    for shard in sorted(grad_dir.glob("*.safetensors")):
        grads.update(load_file(shard))
    return grads


def full_softmax_reference(logits: torch.Tensor):
    """Log-probs of the responses and entropies at temperature TEMPERATURE, from full logits."""
    logp = torch.log_softmax(logits[:, PROMPT_LEN - 1 : -1] / TEMPERATURE, dim=-1)  # (B, R, V)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp, entropy


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    """On CUDA the Megatron side is on the GPU and transformers' reference on the CPU."""
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


def inference_model(hf_dir, cfg, value_head: bool = False) -> list:
    """Model chunks in eval mode (Megatron's MoE layer refuses train mode at TP > 1 without SP)."""
    chunks = build_model(hf_dir, cfg, value_head=value_head, for_training=False)
    for chunk in chunks:
        chunk.eval()
    return chunks


def check_logits(chunks, data, batch, ref_logits, vocab_size):
    def gather_logits(output, micro_batch):
        return output.new_zeros(()), gather_from_tensor_model_parallel_region(output)

    results = run_micro_batches(chunks, data, 2, gather_logits, forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        assert results == [], "non-last pipeline stages return no outputs"
        return
    logits = torch.cat(results)  # (B, T, Vp)
    real = batch["attention_mask"].bool()
    check("logits", logits[..., :vocab_size][real], ref_logits[real])


def check_log_probs(chunks, data, batch, ref_logits):
    out = compute_log_prob(chunks, data, micro_batch_size=2, temperature=TEMPERATURE)
    if not parallel_state.is_pipeline_last_stage():
        assert out is None
        return
    ref_logp, ref_entropy = full_softmax_reference(ref_logits)
    expected_logp = ref_logp.gather(-1, batch["responses"][..., None]).squeeze(-1)
    mask = batch["response_mask"].bool()
    assert torch.isfinite(out.batch["old_log_probs"]).all() and torch.isfinite(out.batch["entropys"]).all()
    check("old_log_probs", out.batch["old_log_probs"][mask], expected_logp[mask])
    check("entropys", out.batch["entropys"][mask], ref_entropy[mask])


def check_engine_top_k(chunks, batch, ref_logits, vocab_size):
    """The actor's view of an engine's top-K ids (rollout.top_k_log_probs), padded and packed: the
    log-probs of ids spread over the whole vocabulary (both TP ranks' columns) and the argmax
    equal the full softmax's, away from near-ties of the top two."""
    ids = torch.randint(
        0, vocab_size, (*batch["responses"].shape, 3), generator=torch.Generator().manual_seed(4)
    )
    data = DataProto.from_dict(tensors={**batch, "rollout_top_k_ids": ids})
    ref_logp, _ = full_softmax_reference(ref_logits)  # (B, R, V)
    top2 = ref_logp.topk(2, dim=-1).values  # (B, R, 2)
    mask = batch["response_mask"].bool()
    clear = mask & (top2[..., 0] - top2[..., 1] > 1e-4)
    last = parallel_state.is_pipeline_last_stage()  # every stage runs every pass; the last checks
    for packed in (None, 64):
        out = compute_log_prob(chunks, data, 2, TEMPERATURE, max_token_len=packed, engine_top_k=True)
        assert (out is not None) == last
        if last:
            top_k = out.batch["actor_top_k_log_probs"]  # (B, R, K)
            check("actor_top_k_log_probs", top_k[mask], ref_logp.gather(-1, ids)[mask])
            assert torch.equal(out.batch["actor_top1_ids"].cpu()[clear], ref_logp.argmax(-1)[clear]), packed
    assert clear.sum() > mask.sum() // 2
    plain = compute_log_prob(chunks, data, 2, TEMPERATURE)  # the reference's and teacher's passes
    assert not last or not {"actor_top_k_log_probs", "actor_top1_ids"} & set(plain.batch.keys())


def nll_loss(vocab_size, total_tokens, num_micro_batches, logits, micro_batch):
    from engines.megatron.forward import vocab_parallel_log_probs

    logp = vocab_parallel_log_probs(logits[:, PROMPT_LEN - 1 : -1], micro_batch["responses"], vocab_size)
    mask = micro_batch["response_mask"].float()
    # The schedule divides by the number of micro-batches: undo it to get the batch token-mean.
    loss = -(logp * mask).sum() / total_tokens * num_micro_batches
    return loss, {"nll": loss.detach()}


def check_gradients(hf_dir, cfg, data, batch, hf_config, ref_grads):
    from functools import partial

    chunks = build_model(hf_dir, cfg, for_training=True)
    total = batch["response_mask"].sum().item()
    run_micro_batches(chunks, data, 2, partial(nll_loss, hf_config.vocab_size, total, 2), forward_only=False)
    model = unwrap_model(chunks[0])
    with torch.no_grad():  # the weight mapping is linear: export the gradients through it
        for param in model.parameters():
            param.copy_(param.main_grad)
    for name, grad in iter_hf_tensors(chunks, hf_config):
        check(f"grad {name}", grad, ref_grads[name], tol=1e-5)


def check_weights_roundtrip(chunks, hf_dir: Path, hf_config, out_dir: Path):
    original = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        original.update(load_file(shard))
    exported = {name: tensor.cpu() for name, tensor in iter_hf_tensors(chunks, hf_config)}
    assert sorted(exported) == sorted(original), (sorted(exported), sorted(original))
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    save_hf_checkpoint(chunks, hf_config, out_dir, max_shard_bytes=40_000)
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        index = json.loads((out_dir / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 2, "expected a sharded export"
        reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).state_dict()
        source = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
        assert sorted(reloaded) == sorted(source)
        for name, tensor in source.items():
            assert torch.equal(reloaded[name], tensor), name
        tokenizer = AutoTokenizer.from_pretrained(out_dir)
        assert tokenizer.decode(tokenizer("12+3=15")["input_ids"]) == "12+3=15"
    dist.barrier()


def check_value_head(hf_dir, cfg, data, batch, hf_config, ref_hidden, export_dir: Path):
    chunks = inference_model(hf_dir, cfg, value_head=True)
    head = dict(iter_hf_tensors(chunks, hf_config))["score.weight"].cpu()  # (1, h), replicated

    def values_of(model_chunks):
        results = run_micro_batches(
            model_chunks, data, 2, lambda out, micro_batch: (out.new_zeros(()), out), True
        )
        return torch.cat(results) if results else None  # (B, T, 1) on the last stage

    values = values_of(chunks)
    real = batch["attention_mask"].bool()
    if parallel_state.is_pipeline_last_stage():
        check("values", values[real], (ref_hidden @ head.T)[real])
    # export as *ForSequenceClassification, then load it back: transformers and Megatron agree
    save_hf_checkpoint(chunks, hf_config, export_dir)
    if dist.get_rank() == 0:
        from transformers import AutoModelForSequenceClassification

        reloaded = AutoModelForSequenceClassification.from_pretrained(export_dir, dtype=torch.float32)
        assert torch.equal(reloaded.score.weight, head)
    reloaded_chunks = inference_model(export_dir, cfg, value_head=True)
    if parallel_state.is_pipeline_last_stage():
        assert torch.equal(values_of(reloaded_chunks), values)
    else:
        values_of(reloaded_chunks)


def run_layout(work_dir: Path, tp: int, pp: int, ep: int, dispatcher: str, models: list[str]) -> None:
    cfg = MegatronConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher,
    )
    for arch in models:
        if ep > 1 and arch not in MOE_MODELS:
            continue
        hf_dir = work_dir / arch
        hf_config = load_hf_config(hf_dir)
        init_megatron(cfg, hf_config)
        batch = the_batch(hf_config.vocab_size)
        data = DataProto.from_dict(tensors=batch)
        ref_logits, ref_hidden, ref_grads = hf_reference(hf_dir, batch)
        chunks = inference_model(hf_dir, cfg)
        check_logits(chunks, data, batch, ref_logits, hf_config.vocab_size)
        check_log_probs(chunks, data, batch, ref_logits)
        check_engine_top_k(chunks, batch, ref_logits, hf_config.vocab_size)
        tag = f"tp{tp}_pp{pp}_ep{ep}"
        check_weights_roundtrip(chunks, hf_dir, hf_config, work_dir / f"export_{arch}_{tag}")
        if hf_config.num_experts and tp > 1:
            # Megatron-Core trains MoE at TP > 1 only with sequence parallelism, which needs TE's
            # norms (CUDA): without it every TP rank's copy of a token reaches the experts.
            print(
                f"SKIP gradients {arch} tp={tp}: MoE training at TP > 1 needs sequence_parallel", flush=True
            )
        else:
            check_gradients(hf_dir, cfg, data, batch, hf_config, ref_grads)
        check_value_head(
            hf_dir, cfg, data, batch, hf_config, ref_hidden, work_dir / f"export_value_{arch}_{tag}"
        )
        dispatch = f" {dispatcher}" if ep > 1 else ""
        print(f"PARITY OK {arch} tp={tp} pp={pp} ep={ep}{dispatch} rank={dist.get_rank()}", flush=True)
    parallel_state.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument(
        "--layouts",
        default="1x1",
        help="comma-separated TPxPP[xEP[:dispatcher]], e.g. 1x1,2x1,1x1x2:alltoall",
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {sorted(MODELS)}")
    args = parser.parse_args()
    if torch.cuda.is_available():  # one GPU a rank; cuBLAS is deterministic only with this workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_rank() == 0:
        make_checkpoints(args.work_dir)
    dist.barrier()
    for layout in args.layouts.split(","):
        sizes, _, dispatcher = layout.partition(":")
        tp, pp, ep = ([int(x) for x in sizes.split("x")] + [1])[:3]
        run_layout(args.work_dir, tp, pp, ep, dispatcher or "allgather", args.models.split(","))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
