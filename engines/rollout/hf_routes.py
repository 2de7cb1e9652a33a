"""The experts the `hf` engine's routers picked for every token it ran, for routing replay (R3).

Rollout Routing Replay (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning
Training and Inference Routers", arXiv 2510.11370) records the inference engine's top-k experts
per token and MoE layer and makes the trainer's forward use them, so the policy trained is the
one that sampled. Here forward hooks on the transformers routers (`mlp.gate` of each decoder
layer: Qwen3MoeTopKRouter, MixtralTopKRouter, which return (logits, scores, indices)) read the
indices during `generate`: the prefill gives every prompt position, each decoding step the token
fed in. The last generated token is never fed back, so its position (and any position past the
response) gets the filler ids 0..k-1: they are real experts, and no loss reads the outputs of
those positions (they predict past the response). Padding positions are also left out of the
trainer's load-balancing loss (the Megatron actor hands its routers the padding mask), which is
computed from the router's own top-k, not from these routes.

Output `routed_experts` (B, P+R, L, k) int16, aligned with `input_ids`: one row of expert ids per
input position and MoE layer, in the router's order (descending score).
"""

from contextlib import contextmanager

import torch

ROUTES_KEY = "routed_experts"
ROUTE_DTYPE = torch.int16  # expert ids < 32768; 2 bytes x L x k per token in the batch


def moe_routers(model) -> list[torch.nn.Module]:
    """Each decoder layer's router, in layer order (ValueError for a model without experts)."""
    routers = [getattr(layer.mlp, "gate", None) for layer in model.model.layers]
    if not routers or any(router is None or not hasattr(router, "top_k") for router in routers):
        raise ValueError(
            f"{type(model).__name__} has no top-k router in every layer: routing replay needs a "
            "mixture-of-experts model (Qwen3-MoE, Mixtral)"
        )
    return routers


class RouteRecorder:
    """Hooks on the model's routers that keep their top-k indices while `recording` is open."""

    def __init__(self, model):
        self.routers = moe_routers(model)
        self.top_k = self.routers[0].top_k
        self.rows, self.active = 0, False
        self.chunks: list[list[torch.Tensor]] = [[] for _ in self.routers]  # per layer, (B, t, k) per forward
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def keep(module, args, output) -> None:
            if self.active:
                indices = output[2]  # (B * t, k)
                self.chunks[layer].append(indices.reshape(self.rows, -1, self.top_k).to("cpu", ROUTE_DTYPE))

        return keep

    @contextmanager
    def recording(self, rows: int):
        """Record the forwards of a `generate` over `rows` rows (replacing the last recording)."""
        self.rows, self.active, self.chunks = rows, True, [[] for _ in self.routers]
        try:
            yield
        finally:
            self.active = False

    def routes(self, positions: int) -> torch.Tensor:
        """The last recording as (B, positions, L, k): recorded positions first, filler after."""
        filler = torch.arange(self.top_k, dtype=ROUTE_DTYPE)  # (k,)
        out = filler.expand(self.rows, positions, len(self.routers), self.top_k).clone()  # (B, T, L, k)
        if self.chunks[0]:
            per_layer = [torch.cat(chunks, dim=1) for chunks in self.chunks]  # L of (B, T_run, k)
            recorded = torch.stack(per_layer, dim=2)  # (B, T_run, L, k)
            kept = min(recorded.shape[1], positions)
            out[:, :kept] = recorded[:, :kept]
        return out
