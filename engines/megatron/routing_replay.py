"""Rollout Routing Replay (R3) in the Megatron actor: the MoE routers use the experts the rollout
engine picked (`routed_experts` in the batch) instead of their own top-k.

Why: the engine and the trainer route some tokens to different experts (other kernels, precision,
batch shapes), so the policy trained is not the one that sampled; replaying the engine's routes
removes that part of the train-inference mismatch (Ma et al. 2025, arXiv 2510.11370). The router
still computes its logits, and the replayed experts' probabilities come from them
(`scores.gather(1, indices)`), so the router's weights get gradients as usual.

Mechanism: Megatron-Core 0.16's own `RouterReplay` (megatron/core/transformer/moe/router_replay.py),
one per router when the TransformerConfig sets `moe_enable_routing_replay` (model.py does so for
`moe_routing_replay: rollout`). Before each micro-batch's forward, `replay_routes` hands every router
of this stage its layer's indices and sets REPLAY_FORWARD; a micro-batch without routes sets no
action (the routers' own top-k). RouterReplay queues every micro-batch's indices as well; after the
forward `replay_in_backward` sets REPLAY_BACKWARD, so a router recomputed in backward (activation
recompute: full, or selective with the `moe` module) takes the oldest queued indices, its own
micro-batch's, also under the pipeline schedule, where later forwards run before a backward.
`replay_pass` empties the queues before and after each pass. The indices are set per router, not
through RouterReplay's process-wide instance list, which would also hold a reference model's routers.

Token order: Megatron's router sees the padded micro-batch as (T, b, h) flattened to (T * b, h),
so a layer's indices are `routed_experts[:, :, layer]` (b, T, k) transposed to (T, b, k). Packed
(THD) micro-batches and sequence parallelism (each TP rank routing a slice of T) are not supported
yet (the recipe check refuses them); TP, EP and PP are (each rank routes all T * b tokens of its
micro-batch; PP stages pick their layers by the router's layer number).

Agreement (`mismatch/router_agreement`, per step): the share of (token, MoE layer) pairs of the
old-log-prob pass (the weights the engine sampled with) whose router, on the same logits, would
itself have picked exactly the replayed experts: 1 means the engine and the trainer route alike
and replay changes nothing; below 1, replay overrides the trainer's own routes on the rest.
Counted on the positions whose outputs are read (real tokens but each row's last: the engine never
ran that one, its routes are filler), by a hook on each router that reruns Megatron's routing
function without the replay (one h x E matmul per token and layer), only inside `counting()`.

Shapes: b rows, T positions (prompt + response), L MoE layers, k experts per token, E experts.
"""

import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist

ROUTES_KEY = "routed_experts"


class RouterAgreement:
    """Counts of (token, layer) pairs over the replayed forwards inside `counting()`: how many
    there were and on how many the router's own top-k equals the replayed one."""

    def __init__(self):
        self.agree = self.total = 0
        self.on = False
        self.read: torch.Tensor | None = None  # (T*b,) bool, the current micro-batch's read positions
        self.hooked: weakref.WeakSet = weakref.WeakSet()  # the routers with the hook

    def watch(self, routers: list, attention_mask: torch.Tensor) -> None:
        """Hook `routers` (once each) and count the next forward on `attention_mask`'s (b, T) read
        positions: real, with a real position after them."""
        mask = attention_mask.bool()  # (b, T)
        read = mask & torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)  # (b, T)
        self.read = read.transpose(0, 1).reshape(-1)  # (T*b,), the routers' token order
        for router in routers:
            if router not in self.hooked:
                router.register_forward_hook(self.count)
                self.hooked.add(router)

    def count(self, router, args, output) -> None:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if not self.on or router.router_replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return
        replayed = output[1]  # (T*b, E) bool routing map
        with torch.no_grad():
            logits = router.gating(args[0]).view(replayed.shape)  # (T*b, E)
            _, own = topk_routing_with_score_function(
                logits,
                router.topk,
                use_pre_softmax=router.config.moe_router_pre_softmax,
                num_groups=router.config.moe_router_num_groups,
                group_topk=router.config.moe_router_group_topk,
                scaling_factor=router.config.moe_router_topk_scaling_factor,
                score_function=router.score_function,
                expert_bias=router.expert_bias,
            )
        same = (own == replayed).all(-1)[self.read.to(replayed.device)]  # (N,)
        self.agree += int(same.sum())
        self.total += same.numel()

    @contextmanager
    def counting(self):
        """Counts the replayed forwards of the block, from zero."""
        self.agree = self.total = 0
        self.on = True
        try:
            yield self
        finally:
            self.on = False

    def share(self) -> float | None:
        """The agreement over this rank's counts and those of the pipeline stages and data-parallel
        ranks (collective over both groups); None when nothing was replayed."""
        from megatron.core import parallel_state

        counts = torch.tensor([self.agree, self.total], dtype=torch.float64)
        dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        return float(counts[0] / counts[1]) if counts[1] else None


AGREEMENT = RouterAgreement()


def replays_routes(model) -> bool:
    """Whether `model` (a chunk, wrapped or not) was built with routing replay."""
    from engines.megatron.model import unwrap_model

    return unwrap_model(model).config.moe_enable_routing_replay


def moe_routers(model) -> list:
    """This stage's TopKRouter modules that carry a RouterReplay, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]


def replay_routes(model, micro_batch) -> None:
    """Hand every router of `model` this micro-batch's routes for its forward (REPLAY_FORWARD), or
    none (the routers' own top-k) when the micro-batch has no routes. RouterReplay also queues each
    micro-batch's routes for the recompute in backward (`replay_in_backward`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(model)
    routes = micro_batch.get(ROUTES_KEY) if ROUTES_KEY in micro_batch else None  # (b, T, L, k)
    if routes is None:
        for router in routers:
            router.router_replay.clear_router_replay_action()
        return
    AGREEMENT.watch(routers, micro_batch["attention_mask"])
    for router in routers:
        layer = routes[:, :, router.layer_number - 1]  # (b, T, k); layer_number counts from 1
        router.router_replay.set_target_indices(
            layer.transpose(0, 1).reshape(-1, layer.shape[-1]).long()
        )  # (T*b, k)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def replay_in_backward(model) -> None:
    """After a micro-batch's forward: a router that runs again in backward (activation recompute)
    takes the oldest queued routes (REPLAY_BACKWARD), which are that micro-batch's own. Why a queue:
    under the 1F1B pipeline schedule stage s runs the forwards of micro-batches i..i+w (w = PP - s -
    1) before the backward of i, and each router's backwards run in its forwards' order."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for router in moe_routers(model):
        if router.router_replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


def clear_replay(model) -> None:
    """No replay and no routes queued."""
    for router in moe_routers(model):
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()


@contextmanager
def replay_pass(chunks):
    """One pass over micro-batches: no routes queued before it, none held after it (the queue keeps
    every micro-batch's (T*b, k) indices per MoE layer until the pass ends)."""
    replays = replays_routes(chunks[0])
    for chunk in chunks if replays else ():
        clear_replay(chunk)
    try:
        yield
    finally:
        for chunk in chunks if replays else ():
            clear_replay(chunk)


def check_replay_model(model_path: str, return_routed_experts: bool, moe_routing_replay: str) -> None:
    """ValueError naming the routing-replay settings that are on when `model_path` (the policy, which
    the engine and the actor both run) is a dense model. Checked before Ray starts: otherwise the hf
    engine refuses only once its workers run (no router to hook), and the actor's dense
    TransformerConfig has no routers, so it would replay nothing without a word."""
    from engines.megatron.model import load_hf_config

    settings = {  # the setting when on -> the value that switches it off
        "rollout.return_routed_experts=true": ("rollout.return_routed_experts=false", return_routed_experts),
        "actor.megatron.moe_routing_replay=rollout": (
            "actor.megatron.moe_routing_replay=off",
            moe_routing_replay == "rollout",
        ),
    }
    on = {setting: fix for setting, (fix, is_on) in settings.items() if is_on}
    if not on:
        return  # a run without replay reads nothing more
    hf_config = load_hf_config(model_path)
    if hf_config.num_experts:
        return
    raise ValueError(
        f"{' and '.join(on)}: routing replay needs a mixture-of-experts model, but model.path={model_path} "
        f"is a dense model ({hf_config.architecture}, no experts in its config.json); set "
        f"{' and '.join(on.values())}, or use a Qwen3-MoE or Mixtral model"
    )
