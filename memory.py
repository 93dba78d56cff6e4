"""memory.py: how much memory a trainer rank needs at a training step's peak (train.py prints it at start-up).

memory_estimate: every term, in GiB, on the device and in host memory; memory_report: the start-up line, with a
warning naming what to change when it does not fit; optimizer_impl: the AdamW kernel (its temporaries are a term).
Checked against a measured CPU peak by bench/memory_check.py, its per-layer activations against the tensors
autograd saves (tests/test_memory.py), and against the 30B configs by tests/test_memory.py.
"""
from __future__ import annotations

from typing import Optional

import torch

import logprobs

GIB = 2 ** 30


def param_counts(model) -> tuple[int, int]:
    """(parameters, parameters of the largest decoder layer) of an HF causal LM: sharded (a DTensor's numel() is
    the full parameter's) or on the meta device (a config's model, never loaded). A MoE's experts count as stored:
    all E of every layer (each rank holds 1/world of each fused expert tensor), not the top-k a token runs."""
    return (sum(p.numel() for p in model.parameters()),
            max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers))


CUDA_RUNTIME_GIB = 2.0  # the CUDA context (~0.5-1 GiB with the kernels loaded) and NCCL's buffers, per rank
GPU_80GB_GIB = 79.11  # what torch reports as an "80 GB" H100's total (85.0e9 bytes; an A100 80GB's is 79.15)
ALLOCATOR_SLACK = 0.05  # of the device: reserved-but-unallocated blocks of the caching allocator (fragmentation)


def model_shape(model) -> dict:
    """What the activation and log-prob terms of memory_estimate need from an HF causal LM (sharded or on the meta
    device): the config's widths, whether its attention normalises q and k (Qwen3 does, Llama does not), and the
    parameters outside the decoder layers (the root unit of FSDP2: embeddings, final norm, lm_head)."""
    c = model.config.get_text_config()
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    layers = sum(p.numel() for layer in model.model.layers for p in layer.parameters())
    shape = {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "num_hidden_layers": c.num_hidden_layers,
             "q_dim": heads * head_dim, "kv_dim": kv * head_dim, "intermediate_size": c.intermediate_size,
             "root_params": sum(p.numel() for p in model.parameters()) - layers,
             "qk_norm": hasattr(model.model.layers[0].self_attn, "q_norm")}
    if getattr(c, "num_experts_per_tok", None):
        shape.update(num_experts=getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None),
                     num_experts_per_tok=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size)
    return shape


def layer_activation_bytes(shape: dict, tokens: int, compute_b: int) -> dict:
    """Bytes one decoder layer holds at its backward's peak, as transformers 5 computes it ("saved": what autograd
    keeps from the forward; "transient": what the backward adds at its peak), per token, from the tensors autograd
    saves (tests/test_memory.py counts them on a small layer, bf16 and float32):
      attention and norms: the RMSNorms (input and post-attention, 2 x hidden; with q_norm and k_norm, as Qwen3
        has and Llama has not, + q_dim + kv_dim) keep their input upcast to float32 (the input norm's is the
        layer's own input in float32, already counted) and their output; then q and k rotated, v, the
        attention's output (q_dim), the MLP's input and the attention's projected output (2 x hidden);
      dense MLP: 4 x intermediate saved (gate, its SiLU, up, their product), 3 x intermediate transient;
      MoE (integrations/moe.py grouped_mm_experts_forward, the cuda default): per token x top-k (S rows) its hidden
        state gathered and the down projection's output (2 x hidden), gate_up's output (2 x moe_intermediate), the
        SiLU and the product (2 x moe_intermediate) saved; 3 [S, hidden] in the backward (the un-permuted gradient,
        the gradient through the routing weights and its product); the router's float32 softmax [tokens, experts]
        twice (its own and routing replay's) and int64 sort indices;
      the gradients into and out of the layer, 2 x hidden."""
    h = shape["hidden_size"]
    q, kv = shape.get("q_dim", h), shape.get("kv_dim", h)
    normed = 2 * h + (q + kv if shape["qk_norm"] else 0)
    upcast = 4 * (normed - (h if compute_b == 4 else 0))  # float32 copies of the norms' inputs
    saved = upcast + compute_b * (normed + (q + kv) + kv + q + 2 * h)
    transient, k = 2 * h, shape.get("num_experts_per_tok")
    if k:
        i = shape["moe_intermediate_size"]
        saved += compute_b * k * (2 * h + 4 * i) + 2 * 4 * shape["num_experts"] + k * (3 * 8 + 4 + 8 + 4)
        transient += 3 * k * h
    else:
        saved += compute_b * 4 * shape.get("intermediate_size", 3 * h)
        transient += 3 * shape.get("intermediate_size", 3 * h)
    return {"saved": tokens * saved, "transient": tokens * transient * compute_b}


def micro_batch_tokens(cfg) -> int:
    """The most tokens one micro-batch can hold: trainer.micro_batch_tokens, or a whole trajectory when one is
    longer (batching.plan_micro_batches puts it alone): rollout.sampling.max_new_tokens plus
    rollout.max_prompt_tokens (when set; else the prompt is not counted)."""
    r = cfg.rollout
    return max(cfg.trainer.micro_batch_tokens, r.sampling.max_new_tokens + (r.max_prompt_tokens or 0))


def memory_estimate(cfg, n_params: int, largest_layer: int, world: int, device_type: str,
                    shape: Optional[dict] = None, with_entropy: bool = True) -> dict:
    """GiB per trainer rank at the peak of a training step. `shape`: model_shape(model); without it the
    activation, log-prob and root-unit terms are left out. with_entropy: the training forward computes the entropy
    (train.py's metric), one more float32 [chunk, vocab] buffer. Terms:
      params, grads, optimizer: FSDP2 shards over `world` ranks in the param dtype, AdamW's two moments; the grads'
        shards live from the first micro-batch's backward to the step (reduce_dtype float32);
      optimizer step: AdamW's temporaries, a full float32 shard with foreach (torch's _multi_tensor_adam), none fused
        (trainer.optimizer: optimizer_impl);
      snapshot: the old-policy copy, one shard in the compute dtype (model.OldPolicy; none with
        trainer.use_rollout_log_probs or one training call per step); the live shards kept aside while it computes
        fit in the gradients' memory (model.OldPolicy.log_probs);
      gathered layers: the two largest decoder layers all-gathered in the compute dtype (one computing, one
        prefetched);
      layer gradients: the unsharded gradient of one layer in the compute dtype and its float32 copy, the
        reduce-scatter's input (MixedPrecisionPolicy reduce_dtype);
      root unit: FSDP2 keeps the root's parameters (embeddings, final norm, lm_head) gathered from the forward
        through the backward (reshard_after_forward is False for the root), and the lm_head's unsharded gradient
        in the compute dtype from the head's backward to the root's reduce-scatter at the backward's end;
      activations: with activation checkpointing every layer's input (tokens x hidden, compute dtype), else every
        layer's recomputed-layer bytes; tokens = micro_batch_tokens(cfg), the longest micro-batch;
      recomputed layer: with activation checkpointing, the one layer recomputed in the backward, at its peak
        (layer_activation_bytes: a MoE's grouped_mm experts hold ~8x a dense layer's);
      log-probs: one chunk's logits in the compute dtype and float32, one more float32 chunk with the entropy
        (logprobs.linear_token_logprobs: the [tokens, vocab] logits are never built), 2 bytes a chunk entry more
        with a rollout.sampling.top_k / top_p / min_p support (its boolean mask, and the top values of a fifth of
        the chunk at a time: +0.19 GiB measured at 1024 x 151936, bench/logprob_memory.py --top-p 0.9), and the
        lm_head gradient's float32 accumulator;
      cuda runtime: the CUDA context and NCCL (a constant, CUDA_RUNTIME_GIB; none on CPU).
    "device" sums them, except that with activation checkpointing the log-probs (the head's forward and backward)
    and the recomputed layer (a layer's backward) are never live together: the larger of the two counts.
    trainer.cpu_offload (params, grads, optimizer and its step) / trainer.snapshot=cpu move terms from "device" to
    "host". A MoE counts its experts as they are stored (all of them: each rank holds every expert's shard)."""
    t = cfg.trainer
    param_b = 4 if device_type == "cpu" else torch.tensor([], dtype=getattr(torch, cfg.model.dtype)).element_size()
    compute_b = 4 if device_type == "cpu" else 2  # bf16: the param_dtype of FSDP2's MixedPrecisionPolicy on cuda
    shard = n_params / world * param_b / GIB
    snapshot = 0.0 if t.use_rollout_log_probs or cfg.calls_per_step == 1 else shard * compute_b / param_b
    fused = optimizer_impl(cfg, device_type) == "fused"
    parts = {"params": shard, "grads": shard, "optimizer": 2 * shard,
             "optimizer step": 0.0 if fused or optimizer_impl(cfg, device_type) == "for_loop" else shard,
             "snapshot": snapshot, "gathered layers": 2 * largest_layer * compute_b / GIB,
             "layer gradients": largest_layer * (compute_b + 4 if device_type == "cuda" else 4) / GIB}
    apart = 0.0
    if shape is not None:
        tokens, h, v, n_layers = micro_batch_tokens(cfg), shape["hidden_size"], shape["vocab_size"], \
            shape["num_hidden_layers"]
        layer = layer_activation_bytes(shape, tokens, compute_b)
        parts["root unit"] = (shape.get("root_params", 0) + v * h) * compute_b / GIB
        if cfg.model.activation_checkpointing:
            parts["activations"] = n_layers * tokens * h * compute_b / GIB
            parts["recomputed layer"] = (layer["saved"] + layer["transient"]) / GIB
        else:
            parts["activations"] = (n_layers * layer["saved"] + layer["transient"]) / GIB
        chunk = min(t.logprob_chunk_tokens, tokens)
        sampling = cfg.rollout.sampling
        support = 2 if logprobs.Support(sampling.top_k, sampling.top_p, sampling.min_p).truncates() else 0
        parts["log-probs"] = (chunk * v * (compute_b + 4 + (4 if with_entropy else 0) + support) + v * h * 4) / GIB
        if cfg.model.activation_checkpointing:
            apart = min(parts["log-probs"], parts["recomputed layer"])
    parts["cuda runtime"] = CUDA_RUNTIME_GIB if device_type == "cuda" else 0.0
    on_host = {"params", "grads", "optimizer", "optimizer step"} if t.cpu_offload else set()
    on_host |= {"snapshot"} if t.snapshot == "cpu" or t.cpu_offload else set()  # it sits beside the shards
    return {"parts": parts, "device": sum(v for k, v in parts.items() if k not in on_host) - apart,
            "host": sum(v for k, v in parts.items() if k in on_host)}


def optimizer_impl(cfg, device_type: str) -> str:
    """trainer.optimizer_impl with auto resolved: fused on cuda (one kernel, no foreach temporaries: torchtitan's
    default), foreach where the step runs on the CPU (device=cpu, or trainer.cpu_offload)."""
    impl = cfg.trainer.optimizer_impl
    return impl if impl != "auto" else ("fused" if device_type == "cuda" and not cfg.trainer.cpu_offload
                                        else "foreach")


def memory_report(cfg, model, world: int, device: torch.device, with_entropy: bool = True) -> str:
    """The start-up line of memory_estimate for this model, with a warning naming what to change when it does not
    fit the device's memory less ALLOCATOR_SLACK."""
    n, largest = param_counts(model)
    est = memory_estimate(cfg, n, largest, world, device.type, model_shape(model), with_entropy)
    line = (f"[train] memory per rank, estimated at a step's peak ({n / 1e9:.2f}B parameters over {world} "
            f"ranks, micro-batches up to {micro_batch_tokens(cfg)} tokens): "
            + " + ".join(f"{k} {v:.2f}" for k, v in est["parts"].items())
            + f" GiB (log-probs and the recomputed layer are never live together); on the device "
            f"{est['device']:.2f} GiB, in host memory {est['host']:.2f} GiB")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        if est["device"] > total * (1 - ALLOCATOR_SLACK):
            line += (f"\n[train] warning: that is more than {1 - ALLOCATOR_SLACK:.0%} of the device's {total:.1f} "
                     "GiB; set trainer.micro_batch_tokens lower, trainer.cpu_offload=true (params, grads and "
                     "optimizer to host memory), trainer.snapshot=cpu, model.dtype=bfloat16, or run more trainer "
                     "ranks")
    return line
