"""logprobs.py: the trainer's per-token log-probs (and entropy) of sampled tokens, chunked over tokens so that a long
response with a large vocabulary never needs a full float32 [tokens x vocab] tensor, forward or backward.

The log-prob convention, shared with the rollout engine (standins/engine.py, SGLang; docs/sglang.md): the log-prob of
a sampled token is log_softmax(logits / temperature)[token], in float32, with temperature 1 for a greedy request
(`effective_temperature`). The trainer's step-start forward and the engine's reported log-probs are then the same
quantity, which the losses compare (losses.py) and train/rollout_logprob_diff_max watches.

  - `token_logprobs`: from logits [..., T, V], each chunk of tokens upcast to float32 on its own.
  - `linear_token_logprobs`: from the last hidden states and the lm_head weight, the lm_head fused into the chunked
    log-softmax, so the [T, V] logits never exist (model.token_logprobs uses it inside the model's forward).
Both are torch.autograd.Functions whose backward recomputes each chunk and writes d/dlogits analytically.
Only torch is imported, so this file can be copied into another repo.

Run the tests:      .venv/bin/python -m pytest -q tests/test_logprobs.py
Memory benchmark:   .venv/bin/python bench/logprob_memory.py
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

GREEDY_TEMPERATURE = 1e-6  # below this a request is greedy (SGLang's _SAMPLING_EPS); reported as log_softmax(logits)


def effective_temperature(temperature: float) -> float:
    """The temperature the engine's reported log-probs use (contract, docs/sglang.md).

    Sampling requests (temperature >= 1e-6) report log_softmax(logits / temperature) of the sampled token; greedy
    requests report log_softmax(logits), i.e. temperature 1. top_p / top_k never change the reported log-prob.
    """
    return 1.0 if temperature < GREEDY_TEMPERATURE else float(temperature)


def _chunks(rows: int, T: int, chunk_size: int):
    """(row slice, token slice) pairs covering [rows, T] with about `chunk_size` tokens each, as views."""
    if T >= chunk_size:
        for i in range(rows):
            for t0 in range(0, T, chunk_size):
                yield slice(i, i + 1), slice(t0, t0 + chunk_size)
    else:
        per = chunk_size // T
        for i in range(0, rows, per):
            yield slice(i, i + per), slice(None)


def _chunk_stats(s: Tensor, targets: Tensor, with_entropy: bool) -> tuple:
    """One chunk's scaled logits s [..., V] float32 (consumed) -> (lse, logp of targets, entropy or None)."""
    target_s = s.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # log-sum-exp by hand so that, without entropy, exp() overwrites s: one float32 chunk in all
    m = s.amax(-1, keepdim=True)
    d = s.sub_(m)  # s - m: shifted by the row max, so the entropy below never subtracts two large numbers
    e = d.exp() if with_entropy else d.exp_()
    z = e.sum(-1)
    log_z = z.log()
    # H = lse - sum_v p_v s_v = log z - sum_v p_v (s_v - m), p = e / z: at logits ~1e4 the unshifted form loses ~1e-3
    entropy = log_z - e.mul_(d).sum(-1) / z if with_entropy else None
    return m.squeeze(-1) + log_z, target_s - m.squeeze(-1) - log_z, entropy


def _chunk_grad(s: Tensor, targets: Tensor, lse: Tensor, entropy: Optional[Tensor], g: Tensor,
                ge: Optional[Tensor], temperature: float) -> Tensor:
    """d loss / d logits of one chunk from its scaled logits s [..., V] float32 (consumed, the result reuses it):
      d logp_t / d s = onehot(y_t) - p,      d H_t / d s = -p * (log p + H_t),      s = logits / temperature.
    Rows with zero upstream gradient (masked or NaN-excluded tokens) get an exact zero, so a NaN/inf logit row
    cannot reach the model through 0 * NaN."""
    g = g.float()
    logp_all = s.sub_(lse.unsqueeze(-1))  # log p over the vocabulary
    if ge is not None:
        ge = ge.float()
        p = logp_all.exp()
        d = logp_all.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-ge.unsqueeze(-1))  # ge * dH/ds
        d.add_(p.mul_(-g.unsqueeze(-1)))
        del p
        zero = (g == 0) & (ge == 0)
    else:
        d = logp_all.exp_().mul_(-g.unsqueeze(-1))
        zero = g == 0
    d.scatter_add_(-1, targets.unsqueeze(-1), g.unsqueeze(-1))
    d.div_(temperature)
    return d.masked_fill_(zero.unsqueeze(-1), 0.0)


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """Forward and backward chunk by chunk; saves only the logits (no copy), lse and entropy ([rows, T] float32).

    Backward recomputes each chunk's softmax from the logits in float32 and writes d/dlogits analytically
    (_chunk_grad), so the peak extra memory is one float32 chunk (two with entropy) plus the gradient in the
    logits' dtype. This is the per-chunk checkpointing idea without autograd's saved intermediates.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int, with_entropy: bool):
        rows, T, _ = logits.shape
        logp = logits.new_empty((rows, T), dtype=torch.float32)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        for rs, ts in _chunks(rows, T, chunk_size):
            s = logits[rs, ts].to(torch.float32, copy=True).div_(temperature)  # one new float32 chunk
            lse[rs, ts], logp[rs, ts], ent = _chunk_stats(s, targets[rs, ts], with_entropy)
            if with_entropy:
                entropy[rs, ts] = ent
            del s  # free this chunk before the next one is allocated
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.save_for_backward(logits, targets, lse, *([entropy] if with_entropy else []))
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor, grad_entropy: Optional[Tensor] = None):
        logits, targets, lse, *ent = ctx.saved_tensors
        rows, T, _ = logits.shape
        grad = torch.empty_like(logits)
        for rs, ts in _chunks(rows, T, ctx.chunk_size):
            s = logits[rs, ts].to(torch.float32, copy=True).div_(ctx.temperature)
            grad[rs, ts] = _chunk_grad(s, targets[rs, ts], lse[rs, ts], ent[0][rs, ts] if ent else None,
                                       grad_logp[rs, ts], grad_entropy[rs, ts] if ctx.with_entropy else None,
                                       ctx.temperature)
            del s  # free this chunk before the next one is allocated
        return grad, None, None, None, None


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float, chunk_size: int = 1024,
                   with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Log-prob of each target token, and optionally the entropy, under softmax(logits / temperature).

    logits [..., T, V] (any float dtype, e.g. bf16), targets [..., T] (valid token ids; put any id, e.g. 0, at
    padding) -> (logp [..., T] float32, entropy [..., T] float32 or None). Temperature convention: see
    `effective_temperature` (matches the engine's reported log-probs). Each chunk of `chunk_size` tokens is upcast
    to float32 on its own, in forward and in backward, so the extra memory is one float32 chunk (two with entropy)
    besides the gradient, not a full float32 [T, V] copy (20K tokens x 150K vocab would be 12 GB; see
    bench/logprob_memory.py). Differentiable once with respect to logits. The logits themselves (and their
    gradient) are still [T, V]: `linear_token_logprobs` never builds them.
    """
    if chunk_size <= 0:
        raise ValueError(f"token_logprobs chunk_size (trainer.logprob_chunk_tokens) must be > 0, got {chunk_size}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logprobs: targets shape {tuple(targets.shape)} must equal logits shape without the "
                         f"vocabulary dimension {tuple(logits.shape[:-1])}")
    lead, (T, V) = logits.shape[:-2], logits.shape[-2:]
    out = _ChunkedTokenLogProbs.apply(logits.reshape(-1, T, V), targets.reshape(-1, T).long(),
                                      effective_temperature(temperature), chunk_size, with_entropy)
    logp, entropy = out if with_entropy else (out, None)
    return logp.reshape(*lead, T), (entropy.reshape(*lead, T) if with_entropy else None)


class _LinearTokenLogProbs(torch.autograd.Function):
    """lm_head and log-softmax fused per chunk of tokens: logits = hidden @ weight.T exist one chunk at a time, in
    forward and in backward (recomputed there: one more [chunk, H] x [H, V] matmul per chunk, the price of never
    holding [T, V]). Saves hidden, weight (no copies), lse and entropy. Backward per chunk: d = dL/dlogits
    (_chunk_grad), grad_hidden = d @ weight, grad_weight += d.T @ hidden (accumulated in float32). verl's
    linear_cross_entropy kernel (verl/utils/kernel/linear_cross_entropy.py) is the same idea as a Triton kernel."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int,
                with_entropy: bool):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        for t0 in range(0, n, chunk_size):
            c = slice(t0, t0 + chunk_size)
            s = (hidden[c] @ weight.T).float().div_(temperature)
            lse[c], logp[c], ent = _chunk_stats(s, targets[c], with_entropy)
            if with_entropy:
                entropy[c] = ent
            del s
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.save_for_backward(hidden, weight, targets, lse, *([entropy] if with_entropy else []))
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor, grad_entropy: Optional[Tensor] = None):
        hidden, weight, targets, lse, *ent = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for t0 in range(0, hidden.shape[0], ctx.chunk_size):
            c = slice(t0, t0 + ctx.chunk_size)
            s = (hidden[c] @ weight.T).float().div_(ctx.temperature)
            d = _chunk_grad(s, targets[c], lse[c], ent[0][c] if ent else None, grad_logp[c],
                            grad_entropy[c] if ctx.with_entropy else None, ctx.temperature)
            grad_hidden[c] = d.to(hidden.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(d.T, hidden[c].float())
            del s, d
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None


def linear_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                          chunk_size: int = 1024, with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """`token_logprobs(hidden @ weight.T, ...)` without the [T, V] logits: hidden [..., T, H] (the last hidden
    states), weight [V, H] (the lm_head's), targets [..., T] -> (logp [..., T] float32, entropy or None).

    Peak extra memory, forward or backward: one chunk's logits in hidden's dtype and float32 (plus the float32
    weight gradient, [V, H]), where the unfused path holds [T, V] logits and their gradient (2 x 6.95 GiB in bf16 at
    24576 tokens x 151936; bench/logprob_memory.py). Differentiable once with respect to hidden and weight.
    """
    if chunk_size <= 0:
        raise ValueError(f"linear_token_logprobs chunk_size (trainer.logprob_chunk_tokens) must be > 0, "
                         f"got {chunk_size}")
    if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_token_logprobs: hidden {tuple(hidden.shape)} must be targets' shape "
                         f"{tuple(targets.shape)} plus the hidden size of weight {tuple(weight.shape)}")
    lead = hidden.shape[:-1]
    out = _LinearTokenLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).long(),
                                     effective_temperature(temperature), chunk_size, with_entropy)
    logp, entropy = out if with_entropy else (out, None)
    return logp.reshape(lead), (entropy.reshape(lead) if with_entropy else None)
