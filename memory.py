"""memory.py: how much memory a trainer rank needs at a training step's peak (train.py prints it at start-up).

memory_estimate: every term, in GiB, on the device and in host memory; memory_report: the start-up line, with a
warning naming what to change when it does not fit; optimizer_impl: the AdamW kernel (its temporaries are a term).
Checked against a measured CPU peak by bench/memory_check.py and against the 30B configs by tests/test_memory.py.
"""
from __future__ import annotations

from typing import Optional

import torch

GIB = 2 ** 30


def param_counts(model) -> tuple[int, int]:
    """(parameters, parameters of the largest decoder layer) of an HF causal LM: sharded (a DTensor's numel() is
    the full parameter's) or on the meta device (a config's model, never loaded). A MoE's experts count as stored:
    all E of every layer (each rank holds 1/world of each fused expert tensor), not the top-k a token runs."""
    return (sum(p.numel() for p in model.parameters()),
            max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers))


ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34  # one layer's saved activations: 34 * tokens * hidden bytes in 16 bits
CUDA_RUNTIME_GIB = 2.0  # the CUDA context (~0.5-1 GiB with the kernels loaded) and NCCL's buffers, per rank


def memory_estimate(cfg, n_params: int, largest_layer: int, world: int, device_type: str,
                    shape: Optional[dict] = None) -> dict:
    """GiB per trainer rank at the peak of a training step. `shape`: the model's hidden_size, vocab_size and
    num_hidden_layers (model.config); without it the activation and log-prob terms are left out. Terms:
      params, grads, optimizer: FSDP2 shards over `world` ranks in the param dtype, AdamW's two moments; the grads'
        shards live from the first micro-batch's backward to the step (reduce_dtype float32);
      optimizer step: AdamW's temporaries, a full float32 shard with foreach (torch's _multi_tensor_adam), none fused
        (trainer.optimizer: optimizer_impl);
      snapshot: the old-policy copy, one shard in the compute dtype (Actor._take_snapshot; none with
        trainer.use_rollout_log_probs or one training call per step); the live shards kept aside while it computes
        fit in the gradients' memory (Actor._old_log_probs);
      gathered layers: the two largest decoder layers all-gathered in the compute dtype (one computing, one
        prefetched);
      layer gradients: the unsharded gradient of one layer in the compute dtype and its float32 copy, the
        reduce-scatter's input (MixedPrecisionPolicy reduce_dtype);
      activations: with activation checkpointing every layer's input (tokens x hidden, compute dtype) plus one layer
        recomputed, else every layer's (34 x tokens x hidden bytes a layer: Korthikanti et al. 2022, with
        flash/flex attention's no-[s, s] term), tokens = trainer.micro_batch_tokens;
      log-probs: one chunk's logits in the compute dtype and float32 (losses.linear_token_logprobs: the [tokens,
        vocab] logits are never built) and the lm_head gradient's float32 accumulator;
      cuda runtime: the CUDA context and NCCL (a constant, CUDA_RUNTIME_GIB; none on CPU).
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
    if shape is not None:
        tokens, h, v, n_layers = t.micro_batch_tokens, shape["hidden_size"], shape["vocab_size"], \
            shape["num_hidden_layers"]
        layer_act = ACTIVATION_BYTES_PER_TOKEN_HIDDEN * tokens * h * compute_b / 2
        parts["activations"] = ((n_layers * tokens * h * compute_b + layer_act) if cfg.model.activation_checkpointing
                                else n_layers * layer_act) / GIB
        parts["log-probs"] = (min(t.logprob_chunk_tokens, tokens) * v * (compute_b + 4) + v * h * 4) / GIB
    parts["cuda runtime"] = CUDA_RUNTIME_GIB if device_type == "cuda" else 0.0
    on_host = {"params", "grads", "optimizer", "optimizer step"} if t.cpu_offload else set()
    on_host |= {"snapshot"} if t.snapshot == "cpu" or t.cpu_offload else set()  # it sits beside the shards
    return {"parts": parts, "device": sum(v for k, v in parts.items() if k not in on_host),
            "host": sum(v for k, v in parts.items() if k in on_host)}


def optimizer_impl(cfg, device_type: str) -> str:
    """trainer.optimizer_impl with auto resolved: fused on cuda (one kernel, no foreach temporaries: torchtitan's
    default), foreach where the step runs on the CPU (device=cpu, or trainer.cpu_offload)."""
    impl = cfg.trainer.optimizer_impl
    return impl if impl != "auto" else ("fused" if device_type == "cuda" and not cfg.trainer.cpu_offload
                                        else "foreach")


def memory_report(cfg, model, world: int, device: torch.device) -> str:
    """The start-up line of memory_estimate for this model, with a warning naming what to change when the
    device's memory is smaller."""
    n, largest = param_counts(model)
    c = model.config.get_text_config()
    est = memory_estimate(cfg, n, largest, world, device.type, {k: getattr(c, k) for k in (
        "hidden_size", "vocab_size", "num_hidden_layers")})
    line = (f"[train] memory per rank, estimated at a step's peak ({n / 1e9:.2f}B parameters over {world} "
            f"ranks): " + " + ".join(f"{k} {v:.2f}" for k, v in est["parts"].items())
            + f" GiB; on the device {est['device']:.2f} GiB, in host memory {est['host']:.2f} GiB")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        if est["device"] > total:
            line += (f"\n[train] warning: that is more than the device's {total:.1f} GiB; set "
                     "trainer.cpu_offload=true (params, grads and optimizer to host memory), trainer.snapshot=cpu, "
                     "model.dtype=bfloat16, or run more trainer ranks")
    return line
