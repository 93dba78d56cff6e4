"""logprobs.py against hand-computed values, a plain-Python loop reference and the naive full log_softmax: values
and gradients of the chunked and the lm_head-fused paths, bf16 and non-contiguous inputs, NaN rows, large logits.
Run: .venv/bin/python -m pytest -q tests/test_logprobs.py
"""
import math

import pytest
import torch

import logprobs

SEEDS = range(40)



def naive_logprobs(logits, targets, temperature):
    """Full float32 log_softmax: the memory-hungry reference."""
    t = logprobs.effective_temperature(temperature)
    logp_all = torch.log_softmax(logits.float() / t, dim=-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def row_log_softmax(row: list, t: float) -> list:
    """Plain-Python log_softmax(row / t): math.exp / math.log on floats."""
    s = [v / t for v in row]
    m = max(s)
    lse = m + math.log(sum(math.exp(v - m) for v in s))
    return [v - lse for v in s]


def loop_logprobs(logits, targets, temperature):
    """Plain-Python reference: one token at a time, math.exp / math.log on floats."""
    t = 1.0 if temperature < 1e-6 else temperature
    rows = logits.reshape(-1, logits.shape[-1]).tolist()
    logp, ent = [], []
    for row, y in zip(rows, targets.reshape(-1).tolist()):
        lp = row_log_softmax(row, t)
        logp.append(lp[y])
        ent.append(-sum(math.exp(x) * x for x in lp))
    return (torch.tensor(logp, dtype=torch.float64).view(targets.shape),
            torch.tensor(ent, dtype=torch.float64).view(targets.shape))


def test_token_logprobs_hand_computed():
    # probs [1/4, 1/4, 1/2]: log p(2) = -log 2, H = 1.5 log 2; temperature 2 gives probs [1, 1, sqrt 2] / (2 + sqrt 2)
    logits = torch.tensor([[0.0, 0.0, math.log(2)], [0.0, 0.0, math.log(2)]])
    targets = torch.tensor([2, 0])
    logp, ent = logprobs.token_logprobs(logits, targets, 1.0, with_entropy=True)
    assert torch.allclose(logp, torch.tensor([-math.log(2), -math.log(4)]), atol=1e-6)
    assert torch.allclose(ent, torch.tensor([1.5 * math.log(2)] * 2), atol=1e-6)
    z = 2 + math.sqrt(2)
    logp, ent = logprobs.token_logprobs(logits, targets, 2.0, with_entropy=True)
    assert torch.allclose(logp, torch.tensor([math.log(math.sqrt(2) / z), math.log(1 / z)]), atol=1e-6)
    h = -(2 / z * math.log(1 / z) + math.sqrt(2) / z * math.log(math.sqrt(2) / z))
    assert torch.allclose(ent, torch.tensor([h, h]), atol=1e-6)
    # greedy (temperature < 1e-6) reports temperature-1 log-probs, as the engine does
    assert torch.equal(logprobs.token_logprobs(logits, targets, 0.0)[0],
                       logprobs.token_logprobs(logits, targets, 1.0)[0])
    assert logprobs.token_logprobs(logits, targets, 1.0)[1] is None


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_token_logprobs_match_loop_reference(temperature):
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(2, 5, 11, generator=g) * 3
        targets = torch.randint(0, 11, (2, 5), generator=g)
        logp, ent = logprobs.token_logprobs(logits, targets, temperature, chunk_size=1 + seed % 7, with_entropy=True)
        ref_logp, ref_ent = loop_logprobs(logits.double(), targets, temperature)
        assert torch.allclose(logp.double(), ref_logp, atol=2e-5, rtol=1e-5)
        assert torch.allclose(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 2, 7)])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10, 64])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_equals_naive_values_and_gradients(shape, chunk_size, with_entropy):
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        V, temperature = 13, 0.7
        logits = (torch.randn(*shape, V, generator=g) * 2).requires_grad_()
        targets = torch.randint(0, V, shape, generator=g)
        w_logp, w_ent = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        logp, ent = logprobs.token_logprobs(logits, targets, temperature, chunk_size, with_entropy)
        ((logp * w_logp).sum() + ((ent * w_ent).sum() if with_entropy else 0)).backward()
        grad = logits.grad.clone()
        logits.grad = None
        ref_logp, ref_ent = naive_logprobs(logits, targets, temperature)
        ((ref_logp * w_logp).sum() + ((ref_ent * w_ent).sum() if with_entropy else 0)).backward()
        assert logp.dtype == torch.float32 and logp.shape == shape
        assert torch.allclose(logp, ref_logp, atol=1e-5)
        if with_entropy:
            assert torch.allclose(ent, ref_ent, atol=1e-5)
        assert torch.allclose(grad, logits.grad, atol=1e-5)


@pytest.mark.parametrize("shape", [(7,), (2, 7)])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_linear_token_logprobs_equal_the_logits_path_with_gradients(shape, chunk_size, with_entropy):
    """lm_head fused into the chunked log-softmax: log-probs, entropy and the gradients of the hidden states and of
    the lm_head weight equal token_logprobs(hidden @ weight.T) within 1e-5 in float32."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        H, V, temperature = 6, 13, 0.7
        hidden = torch.randn(*shape, H, generator=g).requires_grad_()
        weight = torch.randn(V, H, generator=g).requires_grad_()
        targets = torch.randint(0, V, shape, generator=g)
        w_logp, w_ent = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        results = []
        for fused in (True, False):
            if fused:
                logp, ent = logprobs.linear_token_logprobs(hidden, weight, targets, temperature, chunk_size,
                                                           with_entropy)
            else:
                logp, ent = logprobs.token_logprobs(hidden @ weight.T, targets, temperature, chunk_size, with_entropy)
            ((logp * w_logp).sum() + ((ent * w_ent).sum() if with_entropy else 0)).backward()
            results.append((logp, ent, hidden.grad.clone(), weight.grad.clone()))
            hidden.grad = weight.grad = None
        (logp, ent, gh, gw), (ref_logp, ref_ent, ref_gh, ref_gw) = results
        assert logp.shape == shape and logp.dtype == torch.float32
        assert torch.allclose(logp, ref_logp, atol=1e-5)
        assert (ent is None) == (not with_entropy) and (ent is None or torch.allclose(ent, ref_ent, atol=1e-5))
        assert torch.allclose(gh, ref_gh, atol=1e-5) and torch.allclose(gw, ref_gw, atol=1e-5)
        assert gw.abs().sum() > 0


def test_linear_token_logprobs_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="hidden size of weight"):
        logprobs.linear_token_logprobs(torch.zeros(3, 4), torch.zeros(9, 5), torch.zeros(3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        logprobs.linear_token_logprobs(torch.zeros(3, 4), torch.zeros(9, 4), torch.zeros(3, dtype=torch.long), 1.0, 0)


def test_chunked_bf16_and_noncontiguous_slice():
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(2, 9, 50, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    logits = full[:, :-1]  # the usual shift: not contiguous
    targets = torch.randint(0, 50, (2, 8), generator=g)
    logp, ent = logprobs.token_logprobs(logits, targets, 0.9, chunk_size=3, with_entropy=True)
    (logp.sum() + 0.5 * ent.sum()).backward()
    grad = full.grad.clone()
    full.grad = None
    ref_logp, ref_ent = naive_logprobs(full[:, :-1], targets, 0.9)
    (ref_logp.sum() + 0.5 * ref_ent.sum()).backward()
    assert logp.dtype == torch.float32
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert grad.dtype == torch.bfloat16 and torch.all(grad[:, -1] == 0)
    assert torch.allclose(grad.float(), full.grad.float(), atol=1e-2, rtol=1e-2)


def test_token_logprobs_leave_float32_logits_untouched_and_nan_rows_get_zero_grad():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, generator=g)
    logits[2, 3] = float("nan")
    before = logits.clone()
    logits.requires_grad_()
    targets = torch.tensor([0, 1, 2, 3])
    logp, ent = logprobs.token_logprobs(logits, targets, 0.5, chunk_size=2, with_entropy=True)
    assert torch.isnan(logp[2]) and torch.isfinite(logp[[0, 1, 3]]).all()
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0])  # the loss excludes the NaN token: zero upstream gradient
    ((logp * weights).sum() + (torch.where(weights > 0, ent, 0.0)).sum()).backward()
    assert torch.isfinite(logits.grad).all() and torch.all(logits.grad[2] == 0)
    assert torch.equal(logits.detach()[~before.isnan()], before[~before.isnan()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chunked_logprobs_cuda_memory_and_values():
    T, V, chunk = 4096, 32000, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(T, V, generator=g, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    logp, _ = logprobs.token_logprobs(logits, targets, 0.8, chunk_size=chunk)
    logp.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    grad_bytes, chunk_f32 = T * V * 2, chunk * V * 4
    assert peak < grad_bytes + 2 * chunk_f32 + (64 << 20), peak  # a full float32 copy alone would be 2 * grad_bytes
    grad = logits.grad.clone()
    logits.grad = None
    ref, _ = naive_logprobs(logits, targets, 0.8)
    ref.sum().backward()
    assert torch.allclose(logp, ref, atol=1e-4)
    assert torch.allclose(grad.float(), logits.grad.float(), atol=1e-2, rtol=1e-2)


def test_entropy_is_exact_at_large_logits():
    """The entropy is computed from logits shifted by the row max: at logits ~3e4 in float32 the unshifted
    lse - sum p s subtracts two numbers ~3e4 apart by ~1 and loses ~1e-3 (float32 spacing there is 2e-3)."""
    g = torch.Generator().manual_seed(0)
    logits = 3e4 + torch.randn(2, 5, 50, generator=g) * 3
    targets = torch.randint(0, 50, (2, 5), generator=g)
    ref_lp, ref_h = naive_logprobs(logits.double(), targets, 1.0)
    lp, h = logprobs.token_logprobs(logits, targets, 1.0, chunk_size=4, with_entropy=True)
    assert (h.double() - ref_h).abs().max() < 1e-5
    assert (lp.double() - ref_lp).abs().max() < 1e-5


def test_token_logprobs_rejects_bad_arguments():
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        logprobs.token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 1.0, chunk_size=0)
    with pytest.raises(ValueError, match="targets shape"):
        logprobs.token_logprobs(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), 1.0)


# ---------------------------------------------------------------------------------------------------------------
# The sampler's support replayed (logprobs.Support: rollout.sampling.top_k / top_p)

def support_reference(logits, targets, temperature, top_k, top_p):
    """Plain reference: per token, SGLang's kept set found by sorting the row's probabilities (rank < top_k and the
    probability ranked above <= top_p), plus the target; log_softmax over the kept logits, the rest -inf. Returns
    (logp, entropy, log_mass); autograd differentiates it with the set held fixed."""
    s = logits.float() / temperature
    keep = torch.zeros(s.shape, dtype=torch.bool)
    flat_keep, flat_s, flat_t = keep.view(-1, s.shape[-1]), s.detach().reshape(-1, s.shape[-1]), targets.reshape(-1)
    for i in range(flat_s.shape[0]):
        p = torch.softmax(flat_s[i].double(), -1)
        order = p.argsort(descending=True).tolist()
        above = 0.0
        for rank, v in enumerate(order):
            if (top_k > 0 and rank >= top_k) or above > top_p:
                break
            flat_keep[i, v] = True
            above += p[v].item()
        flat_keep[i, flat_t[i]] = True
    inside = s.masked_fill(~keep, float("-inf"))
    logp_all = torch.log_softmax(inside, -1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    inside_lp = torch.where(keep, logp_all, 0.0)  # no -inf in the product (0 * -inf: a NaN gradient)
    entropy = -(torch.where(keep, inside_lp.exp(), 0.0) * inside_lp).sum(-1)
    return logp, entropy, (torch.logsumexp(inside, -1) - torch.logsumexp(s, -1)).detach()


def test_support_hand_computed():
    """Probabilities [0.5, 0.3, 0.15, 0.05] (the stand-in sampler's test distribution, tests/test_engine.py)."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4, 4)
    every = torch.arange(4)
    lp, h, mass = logprobs.token_logprobs(logits, every, 1.0, with_entropy=True, support=logprobs.Support(top_p=0.6))
    # kept {0, 1} (0.5 is ranked above token 1: <= 0.6; 0.8 above token 2: out): 0.625 / 0.375; a target outside
    # joins the support: token 2 over {0, 1, 2}, token 3 over {0, 1, 3}
    want = torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.15 / 0.95, 0.05 / 0.85]).log()
    assert torch.allclose(lp, want, atol=1e-6)
    assert torch.allclose(mass, torch.tensor([0.8, 0.8, 0.95, 0.85]).log(), atol=1e-6)
    assert torch.allclose(h[:2], -(torch.tensor([0.625, 0.375]) * torch.tensor([0.625, 0.375]).log()).sum(), atol=1e-6)
    lp, _, mass = logprobs.token_logprobs(logits, every, 1.0, support=logprobs.Support(top_k=3))
    assert torch.allclose(lp[:3], (torch.tensor([0.5, 0.3, 0.15]) / 0.95).log(), atol=1e-6)
    lp, _, _ = logprobs.token_logprobs(logits, every, 1.0, support=logprobs.Support(top_k=3, top_p=0.6))  # both
    assert torch.allclose(lp[:2], want[:2], atol=1e-6)
    # the temperature comes first: at 0.5 the probabilities are [0.25, 0.09, 0.0225, 0.0025] / 0.365, so 0.685 is
    # ranked above token 1 and top_p 0.6 keeps token 0 alone
    lp, _, mass = logprobs.token_logprobs(logits, every, 0.5, support=logprobs.Support(top_p=0.6))
    assert abs(lp[0].item()) < 1e-6 and abs(mass[0].item() - math.log(0.25 / 0.365)) < 1e-6
    # greedy: the engine reports the whole vocabulary's log-prob at temperature 1, and draws the argmax
    lp, _, mass = logprobs.token_logprobs(logits, every, 0.0, support=logprobs.Support(top_k=1))
    assert mass is None and torch.equal(lp, logprobs.token_logprobs(logits, every, 1.0)[0])


@pytest.mark.parametrize("support", [logprobs.Support(), logprobs.Support(top_p=1.0, top_k=-1)])
@pytest.mark.parametrize("fused", [False, True])
def test_a_support_that_does_not_truncate_changes_nothing(support, fused):
    """rollout.sampling's defaults: the same tensors, bit for bit, values and gradients, and no log_mass."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 6, 5, generator=g), torch.randn(17, 5, generator=g)
    targets = torch.randint(0, 17, (2, 6), generator=g)
    results = []
    for extra in ({}, {"support": support}):
        h = hidden.clone().requires_grad_()
        if fused:
            out = logprobs.linear_token_logprobs(h, weight, targets, 0.7, 4, True, **extra)
        else:
            out = logprobs.token_logprobs(h @ weight.T, targets, 0.7, 4, True, **extra)
        (out[0].sum() + out[1].sum()).backward()
        results.append((out, h.grad))
    (base, base_grad), (out, grad) = results
    assert len(base) == 2 and len(out) == 3 and out[2] is None
    assert torch.equal(base[0], out[0]) and torch.equal(base[1], out[1]) and torch.equal(base_grad, grad)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (-1, 0.7), (4, 0.5), (30, 0.9), (1, 1.0)])
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_support_equals_the_plain_reference_values_and_gradients(top_k, top_p, chunk_size, with_entropy):
    """token_logprobs and linear_token_logprobs with a support against support_reference: log-probs, entropy,
    log_mass and the gradients of the logits (the hidden states and the lm_head weight, fused) within 1e-5."""
    support = logprobs.Support(top_k=top_k, top_p=top_p)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        H, V, temperature = 6, 13, [1.0, 0.7, 1.3][seed]
        hidden = torch.randn(2, 5, H, generator=g).requires_grad_()
        weight = (torch.randn(V, H, generator=g) * 0.8).requires_grad_()
        targets = torch.randint(0, V, (2, 5), generator=g)
        w_logp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
        results = []
        for path in ("reference", "chunked", "fused"):
            if path == "reference":
                logp, ent, mass = support_reference(hidden @ weight.T, targets, temperature, top_k, top_p)
            elif path == "chunked":
                logp, ent, mass = logprobs.token_logprobs(hidden @ weight.T, targets, temperature, chunk_size,
                                                          with_entropy, support=support)
            else:
                logp, ent, mass = logprobs.linear_token_logprobs(hidden, weight, targets, temperature, chunk_size,
                                                                 with_entropy, support=support)
            ((logp * w_logp).sum() + ((ent * w_ent).sum() if with_entropy else 0)).backward()
            results.append((logp, ent, mass, hidden.grad.clone(), weight.grad.clone()))
            hidden.grad = weight.grad = None
        (ref_lp, ref_h, ref_mass, ref_gh, ref_gw), *paths = results
        assert (ref_mass < -1e-3).any()  # the support truncates here
        for logp, ent, mass, gh, gw in paths:
            assert torch.allclose(logp, ref_lp, atol=1e-5) and torch.allclose(mass, ref_mass, atol=1e-5)
            assert (ent is None) == (not with_entropy) and (ent is None or torch.allclose(ent, ref_h, atol=1e-5))
            assert torch.allclose(gh, ref_gh, atol=1e-5) and torch.allclose(gw, ref_gw, atol=1e-5)
            assert not mass.requires_grad


def test_support_gradient_is_zero_outside_it_and_bf16_logits_stay_untouched():
    """d logp / d logit = onehot - p over the support, 0 for the tokens outside it (their logits do not enter the
    renormalised log-prob); the bf16 logits are read, never written."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 40, generator=g) * 3).to(torch.bfloat16)
    before = logits.clone()
    logits.requires_grad_()
    targets = logits.detach().float().argmax(-1)
    lp, _, mass = logprobs.token_logprobs(logits, targets, 1.0, chunk_size=2, support=logprobs.Support(top_k=5))
    lp.sum().backward()
    top5 = logits.detach().float().topk(5, -1).indices
    inside = torch.zeros(3, 40, dtype=torch.bool).scatter_(1, top5, True)
    assert torch.all(logits.grad[~inside] == 0) and torch.all(logits.grad[inside] != 0)
    assert torch.equal(logits.detach(), before) and (mass < 0).all()


@pytest.mark.parametrize("fused", [False, True])
def test_support_keeps_float32_to_one_chunk(fused):
    """Every tensor the kernels make with a support, forward and backward, seen by a dispatch mode: none in float32
    has more elements than one chunk's [chunk, V] (the sort runs on a fifth of a chunk at a time), where T x V is 16
    times that. The bf16 logits and their gradient are the unfused path's own [T, V]."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LargestFloat32(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.numel = max(self.numel, t.numel())
            return out

    T, V, H, chunk = 256, 500, 8, 16
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    logits = (hidden @ weight.T).detach().to(torch.bfloat16).requires_grad_()
    support = logprobs.Support(top_k=50, top_p=0.9)
    with LargestFloat32() as seen:
        if fused:
            lp, ent, _ = logprobs.linear_token_logprobs(hidden, weight, targets, 0.8, chunk, True, support)
        else:
            lp, ent, _ = logprobs.token_logprobs(logits, targets, 0.8, chunk, True, support)
        (lp.sum() + ent.sum()).backward()
    assert 0 < seen.numel <= chunk * V, seen.numel


def test_a_top_p_cut_far_down_a_flat_distribution_is_found():
    """logprobs.SUPPORT_FIRST_K: the cut is looked for among the 128 most likely tokens first, then 1,024, then all
    5,000. top_p 0.9 keeps ~50 tokens of a peaked row (one round), ~600 of a flatter one (two) and ~4,400 of a flat
    one (three): every row equals the plain reference."""
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(2, 5000, generator=g) * scale for scale in (4.0, 2.5, 0.1)])
    targets = torch.randint(0, 5000, (6,), generator=g)
    lp, _, mass = logprobs.token_logprobs(logits, targets, 1.0, chunk_size=4, support=logprobs.Support(top_p=0.9))
    ref_lp, _, ref_mass = support_reference(logits, targets, 1.0, -1, 0.9)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(mass, ref_mass, atol=1e-5)
    kept = (logits.softmax(-1).sort(-1, descending=True).values.cumsum(-1) < 0.9).sum(-1)
    first = logprobs.SUPPORT_FIRST_K
    assert kept[:2].max() < first < kept[2:4].min() <= kept[2:4].max() < 8 * first < kept[4:].min()


def loop_kl(logits, ref, temperature):
    """Plain-Python KL(p || q) per row: sum_v p_v (log p_v - log q_v), math.exp / math.log on floats."""
    t = logprobs.effective_temperature(temperature)
    out = []
    for a, b in zip(logits.reshape(-1, logits.shape[-1]).tolist(), ref.reshape(-1, ref.shape[-1]).tolist()):
        lpa, lpb = row_log_softmax(a, t), row_log_softmax(b, t)
        out.append(sum(math.exp(x) * (x - y) for x, y in zip(lpa, lpb)))
    return torch.tensor(out, dtype=torch.float64).view(logits.shape[:-1])


@pytest.mark.parametrize("temperature, chunk_size, dtype", [(1.0, 1024, torch.float32), (0.7, 3, torch.float32),
                                                            (0.0, 2, torch.float32), (1.3, 4, torch.bfloat16)])
def test_kl_rows_equal_the_loop_reference_and_kl_div(temperature, chunk_size, dtype):
    """logprobs.kl_rows (train/kl_to_start's KL per position) on random logits, 3-D, rows split over chunks of any
    size, at the effective temperature (greedy: 1): the plain-Python sum and torch's kl_div of the float32
    log_softmax; identical rows give exactly 0; the inputs are left as they were (a float32 input is not a copy)."""
    g = torch.Generator().manual_seed(int(temperature * 10) + chunk_size)
    logits = (torch.randn(2, 5, 37, generator=g) * 3).to(dtype)
    ref = (logits.float() + torch.randn(2, 5, 37, generator=g) * (0.2 + torch.rand(2, 5, 1, generator=g))).to(dtype)
    before = ref.clone(), logits.clone()
    kl = logprobs.kl_rows(logits, ref, temperature, chunk_size)
    assert kl.shape == (2, 5) and kl.dtype == torch.float32
    assert torch.equal(ref, before[0]) and torch.equal(logits, before[1])
    assert torch.allclose(kl.double(), loop_kl(logits.float(), ref.float(), temperature), rtol=1e-4, atol=1e-6)
    t = logprobs.effective_temperature(temperature)
    lp, lq = (torch.log_softmax(x.float() / t, -1) for x in (logits, ref))
    kl_div = torch.nn.functional.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    assert torch.allclose(kl, kl_div, rtol=1e-5, atol=1e-6)
    assert kl.min() > 1e-4  # every row moved
    assert torch.equal(logprobs.kl_rows(logits, logits.clone(), temperature, chunk_size), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="must have the same shape"):
        logprobs.kl_rows(logits, ref[:, :4], temperature)
