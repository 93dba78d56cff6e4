"""moe.py: rollout routing replay (R3) for Mixture-of-Experts models. The server records which experts every token
was routed to; the trainer sends the same tokens to the same experts, with the gate weights computed from its own
router logits, so that the router is still trained.

Why: the trainer and the inference server compute the router's top-k independently, and small numerical
differences (bf16 kernels, a weight sync behind) flip the choice of a close second expert: NVIDIA/Megatron-LM#4168
reports ~10% of the router decisions differing per forward pass, and 3 of 3 Qwen3-30B-A3B GRPO runs without replay
collapsing. What this follows: R3 (arXiv 2510.11370) as #4168 describes it ("caching the binary expert-selection mask
from the inference engine and replaying it during training; training logits are still computed normally, preserving
gradient flow to the router"); Megatron-Core's RouterReplay (NVIDIA/Megatron-LM#2693: a record mode and a replay mode
per router, the replay bypassing top-k, and a replay for the backward's recompute) and AReaL's patch of it
(areal-project/AReaL#1207: `scores.gather(1, target_topk_idx)` in place of `torch.topk`), with the correction of
ISEEKYAN/Megatron-LM#79: the replayed weights are gathered from the full softmax over all experts (then renormalised
as the model does, norm_topk_prob), never from top-k-masked scores, where a replayed expert outside the trainer's own
top-k would get weight 0 and no gradient.

- `routers(model)`: [(decoder layer index, top-k router)] of an HF model (transformers 5 Qwen3-MoE: each sparse
  layer's `mlp.gate`, a Qwen3MoeTopKRouter returning (router_logits, top-k weights, top-k expert ids)).
- `Recorder(model)` (standins/engine.py, scheduler.py): forward hooks keep the last forward's top-k ids of every router.
- `set_routes(model, routes, routed)` (model.token_logprobs): every later forward routes token (b, t) of its input
  to routes[b, t] (integer [B, T, layers, top-k], in the trajectories' uint8 / int16) where routed[b, t] (bool
  [B, T]; elsewhere, padding and tokens the server never ran, the router's own top-k), until the next call; set, not
  scoped to one forward, so that activation checkpointing's recompute in the backward replays the same routes
  (Megatron's REPLAY_BACKWARD). Each router widens its layer's ids to int64 (gather's index) when it runs.
- `encode(routes)` / `decode(text, layers, top_k)`: sglang 0.5.23's `meta_info["routed_experts"]`: base64 of the
  int32 bytes of a [tokens, num_hidden_layers, top-k] array (managers/detokenizer_manager.py
  _b64_encode_per_request; state_capturer/routed_experts.py extract_routed_experts_from_meta_info), one row per
  position in [routed_experts_start_len, prompt + output tokens - 1): every token the server ran a forward on.
Imports only the standard library and torch.
"""
from __future__ import annotations

import base64
from typing import Optional

import torch


def is_moe(hf_config) -> bool:
    """Whether an HF config (or its config.json as a dict) is a top-k routed MoE: it has num_experts_per_tok (the
    experts' count is named num_experts, num_local_experts as transformers 5 writes it, or n_routed_experts)."""
    if isinstance(hf_config, dict):
        return bool(hf_config.get("text_config", hf_config).get("num_experts_per_tok"))
    return bool(getattr(hf_config.get_text_config(), "num_experts_per_tok", None))


def routers(model) -> list:
    """[(layer index, router module)] of every decoder layer whose MLP has a top-k router (`mlp.gate` with top_k)."""
    out = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            out.append((i, gate))
    return out


class Recorder:
    """The top-k expert ids of the last forward, per router (the engine's capture: sglang's RoutedExpertsCapturer
    .capture, called by each layer's TopK). `take()` -> int32 [tokens, num_layers, top-k] on the CPU, the tokens in
    the order the routers saw them (the forward's [rows, cols] input, row-major); layers without a router are 0."""

    def __init__(self, model):
        cfg = model.config.get_text_config()
        self.num_layers, self.top_k = cfg.num_hidden_layers, cfg.num_experts_per_tok
        self.last: dict = {}
        self.handles = [gate.register_forward_hook(self._hook(i)) for i, gate in routers(model)]

    def _hook(self, i: int):
        def hook(module, args, out):
            self.last[i] = out[2]  # (router_logits, weights, ids): ids [tokens, top-k]
        return hook

    def take(self) -> torch.Tensor:
        tokens = next(iter(self.last.values())).shape[0]
        out = torch.zeros(tokens, self.num_layers, self.top_k, dtype=torch.int32)
        for i, ids in self.last.items():
            out[:, i] = ids.to("cpu", torch.int32)
        return out


def _replay_hook(module, args, out):
    """Replaces the router's top-k by the set routes (where routed); the weights are the router's own softmax over
    all experts at those ids, renormalised as its forward does (transformers' Qwen3MoeTopKRouter.forward), so with
    equal ids they are the same numbers and the router logits keep their gradient."""
    replay = getattr(module, "_replay", None)
    if replay is None:
        return None
    routes, routed, i = replay
    logits, _, own = out
    want = routes[:, :, i].reshape(-1, routes.shape[-1]).to(own.dtype)  # this layer only, widened here
    ids = want if routed is None else torch.where(routed.reshape(-1, 1), want, own)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    if getattr(module, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), ids


def set_routes(model, routes: Optional[torch.Tensor], routed: Optional[torch.Tensor] = None) -> None:
    """Every later forward of `model` routes token (b, t) to routes[b, t, layer] (integer [B, T, layers, top-k])
    where routed[b, t] (bool [B, T]; None: everywhere), elsewhere to the router's own choice; routes None: the
    routers' own top-k everywhere. A model without routers is left alone."""
    gates = getattr(model, "_replay_routers", None)
    if gates is None:
        gates = model._replay_routers = routers(model)
        for _, gate in gates:
            gate.register_forward_hook(_replay_hook)
    for i, gate in gates:
        gate._replay = None if routes is None else (routes, routed, i)


def encode(routes: torch.Tensor) -> str:
    """int [tokens, layers, top-k] -> sglang 0.5.23's meta_info["routed_experts"] (base64 of the int32 bytes)."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode(text: str, num_layers: int, top_k: int) -> torch.Tensor:
    """meta_info["routed_experts"] -> int32 [tokens, num_layers, top_k]."""
    raw = bytearray(base64.b64decode(text))
    if len(raw) % (4 * num_layers * top_k):
        raise ValueError(f"meta_info.routed_experts has {len(raw)} bytes, not a whole number of int32 "
                         f"[{num_layers} layers, top-{top_k}] rows")
    flat = torch.frombuffer(raw, dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
    return flat.view(-1, num_layers, top_k)
