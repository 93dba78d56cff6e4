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


def loop_logprobs(logits, targets, temperature):
    """Plain-Python reference: one token at a time, math.exp / math.log on floats."""
    t = 1.0 if temperature < 1e-6 else temperature
    rows = logits.reshape(-1, logits.shape[-1]).tolist()
    logp, ent = [], []
    for row, y in zip(rows, targets.reshape(-1).tolist()):
        s = [v / t for v in row]
        m = max(s)
        lse = m + math.log(sum(math.exp(v - m) for v in s))
        logp.append(s[y] - lse)
        ent.append(-sum(math.exp(v - lse) * (v - lse) for v in s))
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
