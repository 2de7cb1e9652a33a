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
action (the routers' own top-k). The indices are set per router, not through RouterReplay's
process-wide instance list, which would also hold a reference model's routers.

Token order: Megatron's router sees the padded micro-batch as (T, b, h) flattened to (T * b, h),
so a layer's indices are `routed_experts[:, :, layer]` (b, T, k) transposed to (T, b, k). Packed
(THD) micro-batches and sequence parallelism (each TP rank routing a slice of T) are not supported
yet (the recipe check refuses them); TP, EP and PP are (each rank routes all T * b tokens of its
micro-batch; PP stages pick their layers by the router's layer number).

Shapes: b rows, T positions (prompt + response), L MoE layers, k experts per token.
"""

ROUTES_KEY = "routed_experts"


def moe_routers(model) -> list:
    """This stage's TopKRouter modules that carry a RouterReplay, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]


def replay_routes(model, micro_batch) -> None:
    """Set (or clear) the replay of every router of `model` for this micro-batch's forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(model)
    if not routers:
        return
    routes = micro_batch.get(ROUTES_KEY) if ROUTES_KEY in micro_batch else None  # (b, T, L, k)
    for router in routers:
        replay = router.router_replay
        replay.clear_indices()
        if routes is None:
            replay.clear_router_replay_action()
            continue
        layer = routes[:, :, router.layer_number - 1]  # (b, T, k); layer_number counts from 1
        replay.set_target_indices(layer.transpose(0, 1).reshape(-1, layer.shape[-1]).long())  # (T*b, k)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_replay(model) -> None:
    """No replay and no indices held (after a pass)."""
    for router in moe_routers(model):
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()


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
