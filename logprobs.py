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
  - `kl_rows`: KL(p || q) per position, exact over the vocabulary, from two sets of logits (train/kl_to_start).

With a `Support` (rollout.sampling.top_k > 0, top_p < 1 or min_p > 0) both take the log-prob over the tokens the
sampler could draw instead of the whole vocabulary: each position's kept set is replayed from these logits by the
rule of the servers' sampling backend (`sampling_backend`), the distribution renormalised over it (docs/algorithms.md,
"Top-k and top-p sampling").
Only torch is imported, so this file can be copied into another repo.

Run the tests:      .venv/bin/python -m pytest -q tests/test_logprobs.py
Memory benchmark:   .venv/bin/python bench/logprob_memory.py
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

GREEDY_TEMPERATURE = 1e-6  # below this a request is greedy (SGLang's _SAMPLING_EPS); reported as log_softmax(logits)
# The scaled logit given to tokens outside a Support: exp() of it is exactly 0, and so is 0 times it (0 * -inf would
# be NaN in the entropy and in its gradient); far below any real logit / temperature (temperature >= 1e-6)
OUTSIDE = -1e30
SUPPORT_PARTS = 5  # a chunk's supports are found a fifth of its rows at a time (the log-sum-exp's temporary, and the
# top values of whole rows where a cut lies far down, then take at most about the float32 chunk's memory)
SUPPORT_FIRST_K = 128  # a top_p cut is looked for among the 128 most likely tokens first (torch.topk: on CPU at a
# vocabulary of 151,936, 0.07 s for 205 rows against 3.4 s to sort them), then 8x as many for the rows whose cut lies
# further, then all


SAMPLING_BACKENDS = ("flashinfer", "pytorch")  # the kept-set rules Support replays (SGLang's --sampling-backend)


@dataclass(frozen=True)
class Support:
    """The tokens SGLang 0.5.23's sampler can draw at a position, of p = softmax(logits / temperature) (its
    layers/sampler.py: Sampler._sample_from_probs), by the rule of the servers' sampling backend:

    - "flashinfer" (the default on CUDA) without min_p: token j is kept when count(p > p_j) < top_k and
      mass(p > p_j) < top_p, both on the whole distribution (flashinfer 0.7.2's top_k_top_p_sampling_from_probs,
      filter_apply_order="joint": sampling.cuh TopKTopPSamplingFromProbKernel). Value-based and strict: tied tokens
      are kept or dropped together, and a token with exactly top_p ranked above it is dropped.
    - "flashinfer" with min_p > 0: top_k_renorm_prob keeps count(p > p_j) < top_k, top_p_renorm_prob then keeps
      mass(q > q_j) < top_p of q, the top-k set renormalised (so top_p is measured within the top_k), and
      min_p_sampling_from_probs keeps p_j >= min_p x the largest; all three value-based.
    - "pytorch" (top_k_top_p_min_p_sampling_from_probs_torch; also under --enable-deterministic-inference): the
      row sorted, position r kept when r < top_k, the mass ranked before it is <= top_p (the token crossing top_p
      stays; the whole distribution's mass) and p_r >= min_p x the largest. Tokens tied at the cut are kept in
      sort order, which torch.sort leaves unspecified: the replay keeps the sampled token first and then the lowest
      ids, as many as the sort kept. The kept mass, the log-probs and the entropy are then the server's exactly;
      only which of the equally likely tokens receive the normaliser's gradient may differ.

    The rule is applied in float32 on these logits, not on the server's. A greedy request (temperature < 1e-6)
    draws the argmax and reports the whole vocabulary's log-prob: no support applies to it."""
    top_k: int = -1  # the top_k most likely tokens (-1 or >= vocabulary: all)
    top_p: float = 1.0  # nucleus mass (1: all)
    min_p: float = 0.0  # keep p >= min_p x the largest (0: all)
    backend: str = "flashinfer"  # flashinfer | pytorch: whose rule (SAMPLING_BACKENDS)

    def __post_init__(self):
        if self.backend not in SAMPLING_BACKENDS:
            raise ValueError(f"Support backend must be one of {', '.join(SAMPLING_BACKENDS)}, got {self.backend!r}")

    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def sampling_backend(setting: str, launch_flags: list) -> str:
    """rollout.sampling.backend resolved against the servers' launch flags (rollout.sglang_args.extra), as 0.5.23
    resolves --sampling-backend (arg_groups/overrides.py: _sampling_backend_default, flashinfer where the platform
    has it, and _deterministic_sampling_backend, pytorch under --enable-deterministic-inference, which
    --rl-on-policy-target turns on: attention_hook.py handle_deterministic_inference). "auto": what those flags
    select, flashinfer without them; "flashinfer" / "pytorch": that one, refused where the flags select the other."""
    flags = [str(f) for f in launch_flags]
    named = [v.split("=", 1)[1] if "=" in v else (flags[i + 1] if i + 1 < len(flags) else "")
             for i, v in enumerate(flags) if v.split("=", 1)[0] == "--sampling-backend"]
    deterministic = [f for f in flags if f.split("=", 1)[0] in ("--enable-deterministic-inference",
                                                                "--rl-on-policy-target")]
    chosen = "pytorch" if deterministic else (named[-1] if named else None)
    if setting not in ("auto",) + SAMPLING_BACKENDS:
        raise ValueError(f"rollout.sampling.backend must be auto, flashinfer or pytorch, got {setting!r}")
    if chosen is not None and chosen not in SAMPLING_BACKENDS:
        raise ValueError(f"rollout.sglang_args.extra selects --sampling-backend {chosen}, whose kept set the trainer "
                         "cannot replay; accepted: flashinfer, pytorch")
    if setting != "auto" and chosen is not None and chosen != setting:
        why = deterministic[0] if deterministic else f"--sampling-backend {chosen}"
        raise ValueError(f"rollout.sampling.backend is {setting} but rollout.sglang_args.extra ({why}) runs the "
                         f"servers' sampler on {chosen}: set it to auto or {chosen}")
    return chosen or ("flashinfer" if setting == "auto" else setting)


def effective_temperature(temperature: float) -> float:
    """The temperature the engine's reported log-probs use (contract, docs/sglang.md).

    Sampling requests (temperature >= 1e-6) report log_softmax(logits / temperature) of the sampled token; greedy
    requests report log_softmax(logits), i.e. temperature 1. top_p / top_k never change the reported log-prob (the
    whole vocabulary's: layers/sampler.py Sampler.forward takes log(probs) before it filters them).
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


def _support_bounds(s: Tensor, targets: Tensor, support: Support) -> tuple:
    """Per row of scaled logits s [..., V] float32: (the lowest value the support keeps, the highest id kept among
    the tokens at that value or None, the row's log-sum-exp). Every rule keeps a prefix of the row sorted by value,
    so the lowest kept value describes the support, all of its ties kept; the pytorch rule can cut a run of ties,
    and the id bound says which of them stay (`_tied_bound`). Backward finds the same set again from the two."""
    rows, flat_t = s.reshape(-1, s.shape[-1]), targets.reshape(-1)
    lowest, lse = rows.new_empty(rows.shape[0]), rows.new_empty(rows.shape[0])
    last = flat_t.new_empty(rows.shape[0]) if support.backend == "pytorch" else None
    step = max(1, -(-rows.shape[0] // SUPPORT_PARTS))
    for i in range(0, rows.shape[0], step):
        part = slice(i, i + step)
        lse[part] = torch.logsumexp(rows[part], -1)
        lowest[part], kept, above = _lowest_kept(rows[part], lse[part], support)
        if last is not None:
            last[part] = _tied_bound(rows[part], flat_t[part], lowest[part], kept, above)
    return (lowest.view(s.shape[:-1]), None if last is None else last.view(s.shape[:-1]),
            lse.view(s.shape[:-1]))


def _kept_count(p: Tensor, support: Support, top_k_mass: Optional[Tensor]) -> Tensor:
    """How many of the probabilities p [r, k] (each row most likely first) the rule keeps, counted by position: a
    tie run passes or fails at its first position (its mass ranked before is mass(p > p_j)), so under the
    value-based rules the count ends on a kept value whose ties all stay. top_k_mass: flashinfer with min_p, the
    mass top_k keeps, within which top_p is measured."""
    keep = torch.ones_like(p, dtype=torch.bool)
    if support.top_p < 1:
        q = p if top_k_mass is None else p / top_k_mass[:, None]
        above = q.cumsum(-1).sub_(q)  # as the pytorch backend: probs_sum - probs_sort
        keep &= above <= support.top_p if support.backend == "pytorch" else above < support.top_p
    if support.min_p > 0:
        keep &= p >= p[:, :1] * support.min_p
    return keep.sum(-1)  # >= 1: nothing is ranked above the first, which is the largest


def _lowest_kept(x: Tensor, lse: Tensor, support: Support) -> tuple:
    """Per row of x [r, V] (log-sum-exp lse [r]): (the lowest value the support keeps, how many positions of the
    sorted row the rule keeps, how many values lie above the lowest), found among the row's k most likely values:
    top_k's, or for top_p / min_p SUPPORT_FIRST_K growing 8x (up to V) for the rows whose cut lies further. With
    flashinfer's min_p order and a top_k, top_p's mass is top_k's: all of top_k's values are taken at once."""
    cap = support.top_k if 0 < support.top_k < x.shape[-1] else x.shape[-1]
    within_top_k = support.backend == "flashinfer" and support.min_p > 0 and support.top_p < 1 and cap < x.shape[-1]
    searches = support.top_p < 1 or support.min_p > 0
    k = min(cap, SUPPORT_FIRST_K) if searches and not within_top_k else cap
    todo = torch.arange(x.shape[0], device=x.device)
    out, kept_out, above_out = x.new_empty(x.shape[0]), torch.empty_like(todo), torch.empty_like(todo)
    while todo.numel():
        rows = x if todo.numel() == x.shape[0] else x[todo]
        ranked = rows.topk(k, -1).values  # most likely first
        p = ranked.sub(lse[todo, None]).exp_()
        mass = None
        if within_top_k:  # top_k_renorm_prob keeps every tie of the k-th value, beyond the k taken here
            ties = (rows == ranked[:, -1:]).sum(-1) - (ranked == ranked[:, -1:]).sum(-1)
            mass = p.sum(-1) + ties * p[:, -1]
        kept = _kept_count(p, support, mass) if searches else torch.full_like(todo, k)
        done = (kept < k) | (k == cap)  # the cut is among these k, or top_k's cap is
        lowest = ranked[done].gather(-1, kept[done, None] - 1)
        out[todo[done]], kept_out[todo[done]] = lowest.squeeze(-1), kept[done]
        above_out[todo[done]] = (ranked[done] > lowest).sum(-1)
        todo, k = todo[~done], cap if 32 * k > cap else 8 * k  # (topk of all V costs less than sorting them)
    return out, kept_out, above_out


def _tied_bound(x: Tensor, targets: Tensor, lowest: Tensor, kept: Tensor, above: Tensor) -> Tensor:
    """The pytorch rule's cut through a run of ties, per row of x [r, V]: `kept` positions of the sorted row stay,
    `above` of them above `lowest`, so kept - above of the tokens at `lowest` do. Which ones is torch.sort's order
    (unspecified): the target first, then the lowest ids. Returns the highest id kept among the ties (V: all kept,
    -1: only the target), for `_restrict_`."""
    tied = x == lowest[:, None]
    last = torch.full_like(kept, x.shape[-1])
    cut = (above + tied.sum(-1) > kept).nonzero().squeeze(-1)
    if cut.numel():
        t = targets[cut, None]
        run = tied[cut]
        wanted = kept[cut] - above[cut] - run.gather(-1, t).squeeze(-1).long()  # ties kept besides the target
        run.scatter_(-1, t, False)
        seen = run.cumsum(-1, dtype=torch.int32)
        last[cut] = torch.where(wanted > 0, (seen < wanted[:, None]).sum(-1), -1)
    return last


def _restrict_(s: Tensor, targets: Tensor, lowest: Tensor, last: Optional[Tensor] = None) -> Tensor:
    """s [..., V] scaled logits, in place: OUTSIDE on the tokens below `lowest`, and with `last` on those at it
    whose id is above it, except the target, which keeps its own value. A sampled token was in the sampler's
    support even where these logits (not the sampler's) put it just outside, and its log-prob must stay finite."""
    target_s = s.gather(-1, targets.unsqueeze(-1))
    outside = s < lowest.unsqueeze(-1)
    if last is not None:
        ids = torch.arange(s.shape[-1], device=s.device)
        outside |= (s == lowest.unsqueeze(-1)) & (ids > last.unsqueeze(-1))
    s.masked_fill_(outside, OUTSIDE)
    return s.scatter_(-1, targets.unsqueeze(-1), target_s)


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


def _forward_buffers(logp: Tensor, with_entropy: bool, support: Optional[Support]) -> tuple:
    """(logp, lse, entropy, lowest, last, log_mass): the forward's per-token outputs, all shaped as logp, float32 but
    `last` (int64, the pytorch rule's id bound in a run of ties); None when not asked for (entropy), without a
    support (the last three) or for another rule (last)."""
    lowest, log_mass = (torch.empty_like(logp), torch.empty_like(logp)) if support else (None, None)
    last = torch.empty_like(logp, dtype=torch.long) if support and support.backend == "pytorch" else None
    return logp, torch.empty_like(logp), torch.empty_like(logp) if with_entropy else None, lowest, last, log_mass


def _chunk_forward(s: Tensor, targets: Tensor, bufs: tuple, at, with_entropy: bool,
                   support: Optional[Support]) -> None:
    """One chunk's scaled logits s [..., V] float32 (consumed) -> its tokens' entries `at` of _forward_buffers'
    outputs; with a support, restricted to it first (its bounds saved for the backward)."""
    logp, lse, entropy, lowest, last, log_mass = bufs
    if support:
        lowest[at], tied, full = _support_bounds(s, targets, support)
        if last is not None:
            last[at] = tied
        _restrict_(s, targets, lowest[at], tied)
    lse[at], logp[at], ent = _chunk_stats(s, targets, with_entropy)
    if with_entropy:
        entropy[at] = ent
    if support:
        log_mass[at] = lse[at] - full


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
    """Forward and backward chunk by chunk; saves only the logits (no copy), lse and entropy ([rows, T] float32), and
    with a support the lowest kept value per token ([rows, T] float32; the pytorch rule also an int64 id bound).

    Backward recomputes each chunk's softmax from the logits in float32 (and the same support from the saved bounds)
    and writes d/dlogits analytically (_chunk_grad), so the peak extra memory is one float32 chunk (two with
    entropy; with a support, a boolean mask of the chunk and the log-sum-exp of a fifth of it at a time besides) plus
    the gradient in the logits' dtype. This is the per-chunk checkpointing idea without autograd's saved intermediates.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int, with_entropy: bool,
                support: Optional[Support]):
        rows, T, _ = logits.shape
        bufs = _forward_buffers(logits.new_empty((rows, T), dtype=torch.float32), with_entropy, support)
        for rs, ts in _chunks(rows, T, chunk_size):
            s = logits[rs, ts].to(torch.float32, copy=True).div_(temperature)  # one new float32 chunk
            _chunk_forward(s, targets[rs, ts], bufs, (rs, ts), with_entropy, support)
            del s  # free this chunk before the next one is allocated
        logp, lse, entropy, lowest, last, log_mass = bufs
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.save_for_backward(logits, targets, lse, entropy, lowest, last)
        if support:
            ctx.mark_non_differentiable(log_mass)
        return logp, entropy, log_mass

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor, grad_entropy: Optional[Tensor], _grad_log_mass):
        logits, targets, lse, entropy, lowest, last = ctx.saved_tensors
        rows, T, _ = logits.shape
        grad = torch.empty_like(logits)
        for rs, ts in _chunks(rows, T, ctx.chunk_size):
            s = logits[rs, ts].to(torch.float32, copy=True).div_(ctx.temperature)
            if lowest is not None:
                _restrict_(s, targets[rs, ts], lowest[rs, ts], None if last is None else last[rs, ts])
            grad[rs, ts] = _chunk_grad(s, targets[rs, ts], lse[rs, ts], None if entropy is None else entropy[rs, ts],
                                       grad_logp[rs, ts], grad_entropy[rs, ts] if ctx.with_entropy else None,
                                       ctx.temperature)
            del s  # free this chunk before the next one is allocated
        return grad, None, None, None, None, None


def _replayed(support: Optional[Support], temperature: float) -> Optional[Support]:
    """The support the kernels restrict to: none without truncation, and none for a greedy request (the engine draws
    its argmax and reports the whole vocabulary's log-prob at temperature 1)."""
    return support if support is not None and support.truncates() and temperature >= GREEDY_TEMPERATURE else None


def _outputs(logp: Tensor, entropy: Optional[Tensor], log_mass: Optional[Tensor], shape, support) -> tuple:
    out = (logp.reshape(shape), None if entropy is None else entropy.reshape(shape))
    return out if support is None else out + (None if log_mass is None else log_mass.reshape(shape),)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float, chunk_size: int = 1024,
                   with_entropy: bool = False, support: Optional[Support] = None) -> tuple:
    """Log-prob of each target token, and optionally the entropy, under softmax(logits / temperature).

    logits [..., T, V] (any float dtype, e.g. bf16), targets [..., T] (valid token ids; put any id, e.g. 0, at
    padding) -> (logp [..., T] float32, entropy [..., T] float32 or None). Temperature convention: see
    `effective_temperature` (matches the engine's reported log-probs). Each chunk of `chunk_size` tokens is upcast
    to float32 on its own, in forward and in backward, so the extra memory is one float32 chunk (two with entropy)
    besides the gradient, not a full float32 [T, V] copy (20K tokens x 150K vocab would be 12 GB; see
    bench/logprob_memory.py). Differentiable once with respect to logits. The logits themselves (and their
    gradient) are still [T, V]: `linear_token_logprobs` never builds them.

    With `support` a third output: log_mass [..., T] float32, the log of the probability the whole-vocabulary
    distribution puts on the support (None when it does not truncate, or the temperature is greedy), and logp and
    entropy are those of the distribution renormalised over the support (plus the target, always): logp = full
    log-prob - log_mass. The support is found from these logits and held fixed in the gradient (it changes only
    where a logit crosses the cut), so the gradient is that of the renormalised log-prob, exactly.
    """
    if chunk_size <= 0:
        raise ValueError(f"token_logprobs chunk_size (trainer.logprob_chunk_tokens) must be > 0, got {chunk_size}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logprobs: targets shape {tuple(targets.shape)} must equal logits shape without the "
                         f"vocabulary dimension {tuple(logits.shape[:-1])}")
    lead, (T, V) = logits.shape[:-2], logits.shape[-2:]
    out = _ChunkedTokenLogProbs.apply(logits.reshape(-1, T, V), targets.reshape(-1, T).long(),
                                      effective_temperature(temperature), chunk_size, with_entropy,
                                      _replayed(support, temperature))
    return _outputs(*out, (*lead, T), support)


class _LinearTokenLogProbs(torch.autograd.Function):
    """lm_head and log-softmax fused per chunk of tokens: logits = hidden @ weight.T exist one chunk at a time, in
    forward and in backward (recomputed there: one more [chunk, H] x [H, V] matmul per chunk, the price of never
    holding [T, V]). Saves hidden, weight (no copies), lse and entropy (and a support's bounds). Backward
    per chunk: d = dL/dlogits (_chunk_grad), grad_hidden = d @ weight, grad_weight += d.T @ hidden (accumulated in
    float32). verl's linear_cross_entropy kernel (verl/utils/kernel/linear_cross_entropy.py) is the same idea as a
    Triton kernel."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int,
                with_entropy: bool, support: Optional[Support]):
        n = hidden.shape[0]
        bufs = _forward_buffers(hidden.new_empty(n, dtype=torch.float32), with_entropy, support)
        for t0 in range(0, n, chunk_size):
            c = slice(t0, t0 + chunk_size)
            s = (hidden[c] @ weight.T).float().div_(temperature)
            _chunk_forward(s, targets[c], bufs, c, with_entropy, support)
            del s
        logp, lse, entropy, lowest, last, log_mass = bufs
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, lowest, last)
        if support:
            ctx.mark_non_differentiable(log_mass)
        return logp, entropy, log_mass

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor, grad_entropy: Optional[Tensor], _grad_log_mass):
        hidden, weight, targets, lse, entropy, lowest, last = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for t0 in range(0, hidden.shape[0], ctx.chunk_size):
            c = slice(t0, t0 + ctx.chunk_size)
            s = (hidden[c] @ weight.T).float().div_(ctx.temperature)
            if lowest is not None:
                _restrict_(s, targets[c], lowest[c], None if last is None else last[c])
            d = _chunk_grad(s, targets[c], lse[c], None if entropy is None else entropy[c], grad_logp[c],
                            grad_entropy[c] if ctx.with_entropy else None, ctx.temperature)
            grad_hidden[c] = d.to(hidden.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(d.T, hidden[c].float())
            del s, d
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None,
                None)


def linear_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                          chunk_size: int = 1024, with_entropy: bool = False,
                          support: Optional[Support] = None) -> tuple:
    """`token_logprobs(hidden @ weight.T, ...)` without the [T, V] logits: hidden [..., T, H] (the last hidden
    states), weight [V, H] (the lm_head's), targets [..., T] -> (logp [..., T] float32, entropy or None), and with
    `support` log_mass as token_logprobs gives it.

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
    out = _LinearTokenLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).long(),
                                     effective_temperature(temperature), chunk_size, with_entropy,
                                     _replayed(support, temperature))
    return _outputs(*out, hidden.shape[:-1], support)


def kl_rows(logits: Tensor, ref_logits: Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """KL(p || q) of each position, exact over the whole vocabulary (not a sampled estimate):
    sum_v p_v (log p_v - log q_v), p = softmax(logits / t), q = softmax(ref_logits / t), t =
    effective_temperature(temperature): the distributions the engine samples from and the losses' log-probs use.

    logits, ref_logits [..., V] in any float dtype (bf16 as a GPU forward gives them; log-probs at temperature 1 are
    logits too, log_softmax leaves them as they are), ref_logits on any device -> [...] float32 on logits' device.
    Each chunk of `chunk_size` rows is upcast to float32 (and moved) on its own, so the extra memory is a few
    float32 [chunk, V] buffers. No top_k / top_p support: truncated distributions of two policies need not share
    their supports, where the KL is infinite. Identical rows give exactly 0. train/kl_to_start is its mean over the
    trainer's probe positions (actor.KLProbe); bench/staleness_experiment.py can call it on its own model."""
    if logits.shape != ref_logits.shape:
        raise ValueError(f"kl_rows: logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} must have "
                         "the same shape")
    if chunk_size <= 0:
        raise ValueError(f"kl_rows chunk_size must be > 0, got {chunk_size}")
    t = effective_temperature(temperature)
    V = logits.shape[-1]
    x, ref = logits.reshape(-1, V), ref_logits.reshape(-1, V)
    out = torch.empty(x.shape[0], dtype=torch.float32, device=logits.device)
    for r0 in range(0, x.shape[0], chunk_size):
        c = slice(r0, r0 + chunk_size)
        lp = torch.log_softmax(x[c].float() / t, -1)  # (not in place: a float32 input is the caller's tensor)
        lq = torch.log_softmax(ref[c].to(logits.device, torch.float32) / t, -1)
        p = lp.exp()
        out[c] = p.mul_(lp.sub_(lq)).sum(-1)
    return out.view(logits.shape[:-1])
