"""torchrun worker: routing replay (R3) between the hf engine and the Megatron actor, on the tiny
Qwen3-MoE and Mixtral (tests/megatron/tiny_hf.py, fp32), at EP 1 (data parallel) and EP 2.

Per model and layout, on every rank:
  1. the hf engine samples responses with rollout.return_routed_experts and returns
     `routed_experts` (B, P+R, L, k);
  2. recorded == Megatron's own picks: forward hooks on Megatron's TopKRouter modules read the
     routing map of a log-prob pass without routes; on every real position the engine ran, the
     experts equal the engine's, except where the router's k-th and (k+1)-th probabilities lie
     within 1e-5 (a near-tie; counted and printed);
  3. replay: the same pass with routes that Megatron would not pick ((e + 1) mod E) uses exactly
     those experts on every token (the hooks' routing maps), and the log-probs change;
  4. the update's forward (forward_only=False, through Megatron's schedule and DDP) uses them too;
     with the engine's routes on half the rows, mismatch/router_agreement's counts equal the
     hooks' (the router's own top-k against the replayed one);
  5. a bf16 engine against the fp32 actor (16 sampled responses): the log-prob mismatch (k3 KL /
     mean / max |difference|) with replay is at most the one without (docs/routing-replay.md).
Prints "REPLAY OK <arch> ep=<ep> rank=<rank> near_ties=<n>/<tokens>" and "BF16 ENGINE ..." lines.

    torchrun --nproc_per_node 2 tests/megatron/_routing_replay_worker.py --work-dir /tmp/r3
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from tiny_hf import make_tiny_hf_checkpoint, padded_batch

from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.forward import compute_log_prob, run_micro_batches
from engines.megatron.model import load_hf_config
from engines.megatron.parallel import init_megatron
from engines.megatron.routing_replay import AGREEMENT, ROUTES_KEY, moe_routers
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.hf_rollout import HFRolloutEngine
from hybridflow.algorithms.mismatch import log_prob_mismatch
from hybridflow.protocol import DataProto

MODELS = {"qwen3_moe": dict(vocab_size=130), "mixtral": dict(vocab_size=110, intermediate_size=48)}
PROMPT_LEN, RESPONSE_LEN, TIE = 6, 5, 1e-5


class RouterMaps:
    """Forward hooks on every replaying TopKRouter: each forward's routing map (T*b, E), whether
    its top-k is a near-tie (T*b,) and the router's own top-k on its logits (T*b, E), by layer
    number (the top-k of the softmax: Qwen3-MoE and Mixtral both pick their experts by it)."""

    def __init__(self, chunks):
        self.maps: dict[int, list[torch.Tensor]] = {}
        self.ties: dict[int, list[torch.Tensor]] = {}
        self.own: dict[int, list[torch.Tensor]] = {}
        self.handles = [router.register_forward_hook(self.keep) for router in moe_routers(chunks[0])]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def keep(self, router, args, output) -> None:
        _, routing_map = output  # (T*b, E) bool
        with torch.no_grad():
            probs = router.gating(args[0]).view(-1, routing_map.shape[1]).float().softmax(-1)  # (T*b, E)
        top = probs.topk(router.topk + 1, dim=-1)  # (T*b, k+1)
        self.maps.setdefault(router.layer_number, []).append(routing_map.detach().clone())
        self.ties.setdefault(router.layer_number, []).append(top.values[:, -2] - top.values[:, -1] < TIE)
        own = one_hot(top.indices[:, :-1], routing_map.shape[1])  # (T*b, E)
        self.own.setdefault(router.layer_number, []).append(own)

    def take(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Routing maps, near-ties and own top-k since the last take, by layer."""
        kept = (self.maps, self.ties, self.own)
        taken = tuple({layer: torch.cat(t) for layer, t in by_layer.items()} for by_layer in kept)
        self.maps, self.ties, self.own = {}, {}, {}
        return taken


def engine_batch(hf_dir: Path, vocab_size: int, rows: int = 4, dtype: str = "float32") -> DataProto:
    """The hf engine's sampled responses to left-padded prompts, with routed_experts."""
    lengths = [6, 3, 5, 2] * (rows // 4)
    prompts = padded_batch(lengths, [1] * rows, PROMPT_LEN, 1, vocab_size, seed=2)
    keys = ("input_ids", "attention_mask", "position_ids")
    prompt_tensors = {key: prompts[key][:, :PROMPT_LEN] for key in keys}  # (b, P) each
    cfg = RolloutConfig(
        name="hf",
        response_length=RESPONSE_LEN,
        load_format="auto",
        return_routed_experts=True,
        dtype=dtype,
        sampling=SamplingConfig(n=1, temperature=1.0, do_sample=True),
    )
    engine = HFRolloutEngine(hf_dir, cfg, device="cpu")
    return engine.generate_sequences(DataProto.from_dict(prompt_tensors, meta_info={"seed": 5}))


def without_routes(batch: DataProto) -> DataProto:
    keys = [key for key in batch.batch.keys() if key != ROUTES_KEY]  # noqa: SIM118 (iteration gives rows)
    return batch.select(batch_keys=keys)


def as_tokens(per_position: torch.Tensor, micro_batch: int = 2) -> torch.Tensor:
    """(b, T, ...) -> (T*b, ...) in the order the routers see the tokens: micro-batch after
    micro-batch, each (T, rows) flattened."""
    return torch.cat(
        [rows.transpose(0, 1).reshape(-1, *rows.shape[2:]) for rows in per_position.split(micro_batch)]
    )


def ran_positions(batch: DataProto) -> torch.Tensor:
    """(b, T) bool: real positions the engine fed through the model (all but each row's last)."""
    mask = batch.batch["attention_mask"].bool()  # (b, T)
    last = mask.long().cumsum(-1) == mask.sum(-1, keepdim=True)  # (b, T), the last real position
    return mask & ~last


def one_hot(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """(N, k) ids -> (N, E) bool."""
    return torch.zeros(routes.shape[0], experts, dtype=torch.bool).scatter(1, routes.long(), True)


def check_recorded(maps, ties, batch: DataProto, experts: int) -> tuple[int, int]:
    routes = batch.batch[ROUTES_KEY]  # (b, T, L, k)
    compared = as_tokens(ran_positions(batch))  # (T*b,)
    near_ties = total = 0
    for layer, routing_map in maps.items():
        recorded = one_hot(as_tokens(routes[:, :, layer - 1]), experts)  # (T*b, E)
        keep = compared & ~ties[layer]
        mismatched = (recorded != routing_map).any(-1) & keep
        assert not mismatched.any(), f"layer {layer}: tokens {mismatched.nonzero().flatten().tolist()} differ"
        near_ties += int((compared & ties[layer]).sum())
        total += int(compared.sum())
    return near_ties, total


def check_agreement(taken, batch: DataProto) -> None:
    """mismatch/router_agreement's counts (routing_replay.AGREEMENT) against the hooks': the
    (token, layer) pairs on read positions whose own top-k is the replayed one, up to near-ties;
    the share over both ranks is the all-reduced counts'."""
    maps, ties, own = taken
    read = as_tokens(ran_positions(batch))  # (T*b,)
    agree = total = slack = 0
    for layer, routing_map in maps.items():
        agree += int(((own[layer] == routing_map).all(-1) & read).sum())
        total += int(read.sum())
        slack += int((ties[layer] & read).sum())
    counted = (AGREEMENT.agree, AGREEMENT.total)
    assert counted[1] == total and abs(counted[0] - agree) <= slack, (counted, agree, total, slack)
    assert 0 < agree < total  # half the rows replay the router's own picks, half other experts
    counts = torch.tensor([AGREEMENT.agree, AGREEMENT.total], dtype=torch.float64)
    dist.all_reduce(counts)
    assert AGREEMENT.share() == float(counts[0] / counts[1])


def check_replayed(maps, routes: torch.Tensor, experts: int) -> None:
    for layer, routing_map in maps.items():
        expected = one_hot(as_tokens(routes[:, :, layer - 1]), experts)  # (T*b, E)
        assert torch.equal(routing_map, expected), f"layer {layer}: not the replayed experts"


def mean_logit(logits, micro_batch):
    return logits.float().mean(), {}


def bf16_mismatch(chunks, hf_dir: Path, vocab_size: int) -> str:
    """A bf16 engine against the fp32 actor: the log-prob mismatch without and with replay, and
    the share of (token, layer) routes the two pick differently."""
    batch = engine_batch(hf_dir, vocab_size, rows=16, dtype="bfloat16")
    plain = without_routes(batch)
    hooks = RouterMaps(chunks)
    own = compute_log_prob(chunks, plain, micro_batch_size=2).batch["old_log_probs"]  # (b, R)
    maps = hooks.take()[0]
    replayed = compute_log_prob(chunks, batch, micro_batch_size=2).batch["old_log_probs"]  # (b, R)
    hooks.remove()
    ran = as_tokens(ran_positions(batch))  # (T*b,)
    routes = batch.batch[ROUTES_KEY]
    differ = [
        (one_hot(as_tokens(routes[:, :, layer - 1]), m.shape[1]) != m).any(-1)[ran]
        for layer, m in maps.items()
    ]
    rollout, mask = batch.batch["rollout_log_probs"], batch.batch["response_mask"]
    without, with_replay = (log_prob_mismatch(lp, rollout, mask, 0.5) for lp in (own, replayed))
    assert with_replay["mismatch/kl_k3"] <= without["mismatch/kl_k3"], (without, with_replay)
    return f"routes_differ={float(torch.cat(differ).float().mean()):.4f} " + " ".join(
        f"{name}={stats['mismatch/kl_k3']:.3e}/{stats['mismatch/log_prob_abs_diff_mean']:.3e}/"
        f"{stats['mismatch/log_prob_abs_diff_max']:.3e}"
        for name, stats in (("off", without), ("replay", with_replay))
    )


def run_model(arch: str, hf_dir: Path, ep: int) -> None:
    cfg = MegatronConfig(expert_model_parallel_size=ep, moe_routing_replay="rollout")
    hf_config = load_hf_config(hf_dir)
    init_megatron(cfg, hf_config)
    experts = hf_config.num_experts
    batch = engine_batch(hf_dir, hf_config.vocab_size)
    chunks = build_model(hf_dir, cfg, for_training=True)
    hooks = RouterMaps(chunks)
    plain = without_routes(batch)
    own = compute_log_prob(chunks, plain, micro_batch_size=2)
    near_ties, total = check_recorded(*hooks.take()[:2], batch, experts)
    other = (batch.batch[ROUTES_KEY].long() + 1) % experts  # (b, T, L, k): not the router's picks
    replayed = DataProto.from_dict({**dict(plain.batch.items()), ROUTES_KEY: other.to(torch.int16)})
    out = compute_log_prob(chunks, replayed, micro_batch_size=2)
    check_replayed(hooks.take()[0], other, experts)
    half = batch.batch[ROUTES_KEY].clone()
    half[1::2] = other[1::2].to(half.dtype)  # odd rows: other experts
    half_replayed = DataProto.from_dict({**dict(plain.batch.items()), ROUTES_KEY: half})
    with AGREEMENT.counting():
        compute_log_prob(chunks, half_replayed, micro_batch_size=2)
    check_agreement(hooks.take(), batch)
    mask = batch.batch["response_mask"].bool()
    assert not torch.allclose(out.batch["old_log_probs"][mask], own.batch["old_log_probs"][mask])
    run_micro_batches(chunks, replayed, 2, mean_logit, forward_only=False)  # the update's path
    check_replayed(hooks.take()[0], other, experts)
    hooks.remove()
    measured = bf16_mismatch(chunks, hf_dir, hf_config.vocab_size)
    print(f"REPLAY OK {arch} ep={ep} rank={dist.get_rank()} near_ties={near_ties}/{total}", flush=True)
    print(f"BF16 ENGINE {arch} ep={ep} rank={dist.get_rank()} {measured}", flush=True)
    parallel_state.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--eps", default="1,2", help="comma-separated expert-parallel sizes")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        for arch, shape in MODELS.items():
            if not (args.work_dir / arch / "config.json").exists():
                make_tiny_hf_checkpoint(args.work_dir / arch, arch=arch, num_layers=2, **shape)
    dist.barrier()
    for ep in map(int, args.eps.split(",")):
        for arch in MODELS:
            run_model(arch, args.work_dir / arch, ep)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
