"""losses.py against hand-computed values and against plain-Python-loop references written here (many seeds).

Also: exact-zero gradients for masked tokens and sequences, dual-clip bound, detached IS weights, NaN logits kept
out of the gradient, and micro-batch / data-parallel splits summing to the mini-batch loss. The log-prob kernels:
tests/test_logprobs.py.
The published estimators (decoupled_ppo, loglinear, m2po, truncated_is, the m2_mask correction) are compared with
their peers' own functions at pinned versions: tests/fixtures/peer_losses.json (bench/make_loss_fixtures.py).
Run: .venv/bin/python -m pytest -q tests/test_losses.py
"""
import inspect
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

import config
import logprobs
import losses

SEEDS = range(40)


def algo(**kw):
    """A losses.LossSettings with dotted overrides, e.g. algo(**{"m2_mask.enable": True, "dual_clip_c": 3.0})."""
    a = losses.LossSettings()
    for key, value in kw.items():
        *path, last = key.split(".")
        obj = a
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return a


# ---------------------------------------------------------------------------------------------------------
# compute_advantages and offpolicy_token_mask
# ---------------------------------------------------------------------------------------------------------

def test_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1], [2.0, 2.0, 2.0, 2.0]])
    a = losses.compute_advantages(r, std_normalize=True, eps=1e-6)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (std + 1e-6))
    assert torch.equal(a[1:], torch.zeros(2, 4))  # identical rewards: exactly zero, also for 0.1 (rounding)
    dr = losses.compute_advantages(r, std_normalize=False)
    assert torch.allclose(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5])) and torch.equal(dr[1:], torch.zeros(2, 4))
    assert torch.equal(losses.compute_advantages(torch.tensor([[3.0], [1.0]])), torch.zeros(2, 1))


@pytest.mark.parametrize("std_normalize", [True, False])
def test_advantages_match_loop_reference(std_normalize):
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        G, N = 3, 2 + seed % 6
        r = torch.randint(0, 3, (G, N), generator=g).float() * 0.5 + torch.rand(G, 1, generator=g)
        eps = 1e-6 * (1 + seed % 3)
        a = losses.compute_advantages(r, std_normalize, eps)
        for i, row in enumerate(r.double().tolist()):
            mean = sum(row) / N
            std = math.sqrt(sum((x - mean) ** 2 for x in row) / (N - 1))
            for j, x in enumerate(row):
                if max(row) == min(row):
                    expected = 0.0
                else:
                    expected = (x - mean) / (std + eps) if std_normalize else x - mean
                assert a[i, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_offpolicy_token_mask_hand_computed():
    versions = torch.tensor([[0, 0, 1, 1, 2, 7], [3, 3, 3, 0, 0, 0], [5, 4, 5, 0, 0, 0]])
    loss_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.float32)
    expected = torch.tensor([[0, 0, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.float32)
    out = losses.offpolicy_token_mask(versions, loss_mask)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert torch.equal(losses.offpolicy_token_mask(versions, loss_mask.bool()), expected.bool())


def test_offpolicy_token_mask_matches_loop_reference():
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        versions = torch.randint(0, 4, (4, 9), generator=g)
        loss_mask = torch.rand(4, 9, generator=g) < 0.7
        out = losses.offpolicy_token_mask(versions, loss_mask)
        for i in range(4):
            vs = [v for v, m in zip(versions[i].tolist(), loss_mask[i].tolist()) if m]
            newest = max(vs) if vs else None
            for t in range(9):
                assert bool(out[i, t]) == (bool(loss_mask[i, t]) and versions[i, t].item() == newest)


# ---------------------------------------------------------------------------------------------------------
# policy_loss: the plain-loop reference
# ---------------------------------------------------------------------------------------------------------

def finite(*xs):
    return all(math.isfinite(x) for x in xs)


def ref_policy_loss(lp, old, ro, adv, mask, a, norm_len=None):
    """Token by token, straight from docs/algorithms.md. lp: leaf tensor [B, T]; the rest Python lists.

    Returns (loss tensor with grad, metrics dict of floats, the denominator it used).
    """
    B, T = len(mask), len(mask[0])
    tok = [[lp[i, t] for t in range(T)] for i in range(B)]
    lpv = lp.tolist()
    present = [[bool(mask[i][t]) for t in range(T)] for i in range(B)]
    ok = [[present[i][t] and finite(lpv[i][t], old[i][t], adv[i], *( [ro[i][t]] if ro is not None else []))
           for t in range(T)] for i in range(B)]
    keep = [row[:] for row in ok]
    weight = [[1.0] * T for _ in range(B)]
    m = {}
    n_ok = sum(map(sum, ok))
    if a.is_correction.enable:
        c = a.is_correction
        low = c.mask_low if c.mask_low is not None else 0.0
        high = c.mask_high if c.mask_high is not None else math.inf
        units = []  # (rho, [(i, t), ...])
        for i in range(B):
            cells = [(i, t) for t in range(T) if ok[i][t]]
            if c.level == "token":
                units += [(math.exp(old[i][t] - ro[i][t]), [(i, t)]) for (i, t) in cells]
            elif cells:
                units.append((math.exp(sum(old[i][t] - ro[i][t] for (i, t) in cells)), cells))
        kept_w, truncated, dropped = [], 0, 0
        for rho, cells in units:
            if low <= rho <= high:
                kept_w.append(min(rho, c.clip))
                truncated += rho > c.clip
                for (i, t) in cells:
                    weight[i][t] = min(rho, c.clip)
            else:
                dropped += 1
                for (i, t) in cells:
                    keep[i][t] = False
        m["train/is_mean"] = sum(kept_w) / len(kept_w) if kept_w else 0.0
        m["train/is_max"] = max(kept_w) if kept_w else 0.0
        m["train/is_min"] = min(kept_w) if kept_w else 0.0
        m["train/is_truncated_frac"] = truncated / len(kept_w) if kept_w else 0.0
        m["train/is_masked_frac"] = dropped / len(units) if units else 0.0
    if a.m2_mask.enable:  # drop the largest until the rest's mean is below tau; one token always stays (AReaL)
        items = sorted(((old[i][t] - ro[i][t]) ** 2, i, t) for i in range(B) for t in range(T) if ok[i][t])[::-1]
        masked = 0
        while len(items) > 1 and sum(x for x, _, _ in items) / len(items) >= a.m2_mask.tau:
            _, i, t = items.pop(0)
            keep[i][t] = False
            masked += 1
        m["train/m2_masked_frac"] = masked / n_ok if n_ok else 0.0
    if a.opsm.enable:
        mu = ro if ro is not None else old
        seqs, dropped = 0, 0
        for i in range(B):
            cells = [t for t in range(T) if ok[i][t]]
            if not cells:
                continue
            seqs += 1
            kl = sum(mu[i][t] - lpv[i][t] for t in cells) / len(cells)
            if adv[i] < 0 and kl > a.opsm.delta:
                dropped += 1
                for t in cells:
                    keep[i][t] = False
        m["train/opsm_masked_frac"] = dropped / seqs if seqs else 0.0

    per_seq, clipped, clipped_low, dual, n_keep = [], 0, 0, 0, 0
    for i in range(B):
        total = 0.0
        for t in range(T):
            if not keep[i][t]:
                continue
            A = adv[i]
            r = torch.exp(torch.clamp(tok[i][t] - old[i][t], -20, 20))
            surr1, surr2 = -A * r, -A * torch.clamp(r, 1 - a.clip_low, 1 + a.clip_high)
            loss_t = surr2 if surr2 > surr1 else surr1
            clipped += bool(surr2 > surr1)
            clipped_low += bool(surr2 > surr1) and bool(r < 1)
            if a.dual_clip_c is not None and A < 0 and loss_t > -a.dual_clip_c * A:
                loss_t = torch.tensor(-a.dual_clip_c * A, dtype=torch.float64)
                dual += 1
            total = total + loss_t * weight[i][t]
            n_keep += 1
        per_seq.append((total, sum(present[i])))
    mode = a.loss_agg_mode
    n_seqs = sum(1 for i in range(B) if any(present[i]))
    if mode == "token-mean":
        num, denom = sum(s for s, _ in per_seq), sum(map(sum, present))
    elif mode == "seq-mean-token-mean":
        num, denom = sum(s / n for s, n in per_seq if n), n_seqs
    elif mode == "seq-mean-token-sum":
        num, denom = sum(s for s, _ in per_seq), n_seqs
    else:
        num, denom = sum(s for s, _ in per_seq), n_seqs * norm_len
    loss = num / max(denom, 1)
    if not torch.is_tensor(loss):
        loss = lp.sum() * 0.0 + loss
    n_present = sum(map(sum, present))
    m["train/pg_loss"] = loss.item()
    m["train/approx_kl"] = (sum(old[i][t] - lpv[i][t] for i in range(B) for t in range(T) if ok[i][t]) / n_ok
                            if n_ok else 0.0)
    m["train/clip_ratio"] = clipped / n_keep if n_keep else 0.0
    m["train/clip_ratio_low"] = clipped_low / n_keep if n_keep else 0.0
    m["train/clip_ratio_high"] = (clipped - clipped_low) / n_keep if n_keep else 0.0
    m["train/dual_clip_ratio"] = dual / n_keep if n_keep else 0.0
    m["train/nan_ratio"] = (n_present - n_ok) / n_present if n_present else 0.0
    return loss, m, denom


def random_batch(seed, B=5, T=7, nonfinite=False):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + torch.randn(B, T, generator=g) * 0.4
    ro = old + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    adv[seed % B] = 0.0
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[(seed + 1) % B] = False if seed % 4 == 0 else mask[(seed + 1) % B]
    if nonfinite:
        lp[0, 1], ro[1, 2], old[2, 3], adv[3] = float("nan"), float("inf"), float("-inf"), float("nan")
    return lp, old, ro, adv, mask


CONFIGS = {
    "ppo": {},
    "dual": {"dual_clip_c": 2.0, "clip_low": 0.1, "clip_high": 0.15},
    "is-token": {"is_correction.enable": True, "is_correction.clip": 1.3},
    "is-token-mis": {"is_correction.enable": True, "is_correction.mask_low": 0.7, "is_correction.mask_high": 1.6},
    "is-seq-mis": {"is_correction.enable": True, "is_correction.level": "sequence", "is_correction.clip": 1.5,
                   "is_correction.mask_low": 0.2, "is_correction.mask_high": 4.0},
    "m2_mask": {"m2_mask.enable": True, "m2_mask.tau": 0.05},
    "opsm": {"opsm.enable": True, "opsm.delta": 0.02},
    "all": {"dual_clip_c": 3.0, "is_correction.enable": True, "is_correction.level": "sequence",
            "m2_mask.enable": True, "m2_mask.tau": 0.08, "opsm.enable": True, "opsm.delta": 0.05},
}
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
EXERCISED = {  # a metric that must be non-zero for some seed, so the random inputs really take each path
    "ppo": "train/clip_ratio", "dual": "train/dual_clip_ratio", "is-token": "train/is_truncated_frac",
    "is-token-mis": "train/is_masked_frac", "is-seq-mis": "train/is_masked_frac", "m2_mask": "train/m2_masked_frac",
    "opsm": "train/opsm_masked_frac", "all": "train/m2_masked_frac",
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_matches_loop_reference(name, mode):
    a = algo(loss_agg_mode=mode, **CONFIGS[name])
    exercised = 0.0
    for seed in range(25):
        lp, old, ro, adv, mask = random_batch(seed, nonfinite=seed % 5 == 1)
        entropy = torch.rand(5, 7, generator=torch.Generator().manual_seed(seed))
        denom = losses.loss_denominator(mask, mode, norm_len=12)
        x = lp.clone().requires_grad_()
        loss, metrics = losses.ppo(losses.TokenBatch(x, old, ro, adv, mask, entropy=entropy), a, denom)
        loss.backward()
        x_ref = lp.double().requires_grad_()
        ref_loss, ref_m, ref_denom = ref_policy_loss(x_ref, old.double().tolist(), ro.double().tolist(),
                                                     adv.double().tolist(), mask.tolist(), a, norm_len=12)
        ref_loss.backward()
        assert denom == ref_denom
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6), (name, mode, seed)
        ref_grad = torch.nan_to_num(x_ref.grad.float(), nan=0.0)
        assert torch.allclose(x.grad, ref_grad, rtol=1e-4, atol=1e-6), (name, mode, seed)
        ok = (mask & torch.isfinite(lp) & torch.isfinite(old) & torch.isfinite(ro)
              & torch.isfinite(adv).unsqueeze(-1) & torch.isfinite(entropy))
        ref_m["train/entropy"] = entropy[ok].mean().item() if ok.any() else 0.0
        assert set(metrics) == set(ref_m)
        for k, v in ref_m.items():
            assert metrics[k].item() == pytest.approx(v, rel=1e-5, abs=1e-6), (name, mode, seed, k)
        exercised = max(exercised, ref_m[EXERCISED[name]])
    assert exercised > 0, f"no seed exercised {EXERCISED[name]}"


def test_policy_loss_hand_computed_clip_and_dual_clip():
    # one sequence, A = +1: r = 1.5 clips at 1.28 (loss -1.28), r = 1 gives -1 -> token-mean -1.14
    lp = torch.tensor([[math.log(1.5), 0.0]]).requires_grad_()
    loss, m = losses.ppo(losses.TokenBatch(lp, torch.zeros(1, 2), None, torch.tensor([1.0]), torch.ones(1, 2)), algo(),
                         2)
    assert loss.item() == pytest.approx(-1.14) and m["train/clip_ratio"].item() == 0.5
    loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1].item() == pytest.approx(-0.5)  # d(-r/2)/dlp = -r/2 at r = 1
    # A = -1, r = 5: PPO loss = -min(-5, -1.28) = 5; dual-clip with c = 3 caps it at -cA = 3, gradient 0
    lp = torch.tensor([[math.log(5.0), 0.0]]).requires_grad_()
    batch = losses.TokenBatch(lp, torch.zeros(1, 2), None, torch.tensor([-1.0]), torch.ones(1, 2))
    loss, m = losses.ppo(batch, algo(), 2)
    assert loss.item() == pytest.approx((5 + 1) / 2)
    loss, m = losses.ppo(batch, algo(dual_clip_c=3.0), 2)
    assert loss.item() == pytest.approx((3 + 1) / 2) and m["train/dual_clip_ratio"].item() == 0.5
    loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1].item() == pytest.approx(0.5)


def test_dual_clip_bounds_every_token_loss_at_minus_c_times_a():
    g = torch.Generator().manual_seed(0)
    n, c = 200, 3.0
    lp = (torch.randn(n, 1, generator=g) * 3).requires_grad_()  # ratios from e^-9 to e^9
    adv = -torch.rand(n, generator=g) * 2 - 0.01
    a = algo(dual_clip_c=c, loss_agg_mode="seq-mean-token-mean")
    seqs = [losses.TokenBatch(lp[i:i + 1], torch.zeros(1, 1), None, adv[i:i + 1], torch.ones(1, 1)) for i in range(n)]
    per_seq = torch.stack([losses.ppo(b, a, 1)[0] for b in seqs])
    assert torch.all(per_seq <= -c * adv + 1e-6)
    assert torch.any(per_seq == -c * adv)  # the bound is reached (dual-clip active)
    off = torch.stack([losses.ppo(b, algo(), 1)[0] for b in seqs])
    assert torch.any(off > -c * adv)  # without dual-clip the same tokens exceed it


def test_is_correction_hand_computed():
    # rho = pi_old / mu = [3, 0.5, 1.2]; C = 2 -> w = [2, 0.5, 1.2]; A = 1, r = 1 -> token losses -w
    old = torch.zeros(1, 3)
    ro = -torch.log(torch.tensor([[3.0, 0.5, 1.2]]))
    lp = torch.zeros(1, 3, requires_grad=True)
    a = algo(**{"is_correction.enable": True})
    loss, m = losses.ppo(losses.TokenBatch(lp, old, ro, torch.tensor([1.0]), torch.ones(1, 3)), a, 3)
    assert loss.item() == pytest.approx(-(2 + 0.5 + 1.2) / 3, rel=1e-6)
    assert m["train/is_max"].item() == pytest.approx(2) and m["train/is_min"].item() == pytest.approx(0.5)
    assert m["train/is_mean"].item() == pytest.approx(3.7 / 3, rel=1e-6)
    assert m["train/is_truncated_frac"].item() == pytest.approx(1 / 3)
    # MIS: keep only rho in [0.6, 2.5] -> the 3 and the 0.5 tokens drop out, zero gradient
    a = algo(**{"is_correction.enable": True, "is_correction.mask_low": 0.6, "is_correction.mask_high": 2.5})
    loss, m = losses.ppo(losses.TokenBatch(lp, old, ro, torch.tensor([1.0]), torch.ones(1, 3)), a, 3)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2 / 3, rel=1e-6) and m["train/is_masked_frac"].item() == pytest.approx(2 / 3)
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == 0 and lp.grad[0, 2].item() == pytest.approx(-1.2 / 3)
    # sequence level: rho = 3 * 0.5 * 1.2 = 1.8 for every token
    a = algo(**{"is_correction.enable": True, "is_correction.level": "sequence"})
    loss, m = losses.ppo(losses.TokenBatch(lp, old, ro, torch.tensor([1.0]), torch.ones(1, 3)), a, 3)
    assert loss.item() == pytest.approx(-1.8, rel=1e-6) and m["train/is_mean"].item() == pytest.approx(1.8)


def test_is_weights_carry_no_gradient():
    lp, old, ro, adv, mask = random_batch(3)
    old, ro = old.clone().requires_grad_(), ro.clone().requires_grad_()
    a_is = algo(**{"is_correction.enable": True, "is_correction.clip": 1.5})
    x = lp.clone().requires_grad_()
    loss, _ = losses.ppo(losses.TokenBatch(x, old, ro, adv, mask), a_is, mask.sum())
    loss.backward()
    assert old.grad is None and ro.grad is None
    # the weighted gradient is the unweighted one times the (constant) weight min(rho, C)
    y = lp.clone().requires_grad_()
    plain, _ = losses.ppo(losses.TokenBatch(y, old.detach(), None, adv, mask), algo(), mask.sum())
    plain.backward()
    w = torch.exp(old.detach() - ro.detach()).clamp(max=1.5)
    assert torch.allclose(x.grad, y.grad * w, atol=1e-7)


def test_m2_mask_hand_computed():
    # squared log-ratios [1, .01, .01, .01]: mean .2575 >= tau = .04; masking the top one leaves .01 < tau
    old = torch.tensor([[1.0, 0.1, -0.1, 0.1]])
    ro = torch.zeros(1, 4)
    lp = old.clone().requires_grad_()
    a = algo(**{"m2_mask.enable": True, "m2_mask.tau": 0.04})
    loss, m = losses.ppo(losses.TokenBatch(lp, old, ro, torch.tensor([1.0]), torch.ones(1, 4)), a, 4)
    loss.backward()
    assert m["train/m2_masked_frac"].item() == 0.25
    assert loss.item() == pytest.approx(-3 / 4) and lp.grad[0, 0] == 0 and torch.all(lp.grad[0, 1:] != 0)
    # tau above the full mean: nothing masked; below every token's own value: all but the smallest (AReaL)
    _, m = losses.ppo(losses.TokenBatch(lp, old, ro, torch.tensor([1.0]), torch.ones(1, 4)),
                      algo(**{"m2_mask.enable": True, "m2_mask.tau": 0.3}), 4)
    assert m["train/m2_masked_frac"].item() == 0.0
    _, m = losses.ppo(losses.TokenBatch(lp, old, ro, torch.tensor([1.0]), torch.ones(1, 4)),
                      algo(**{"m2_mask.enable": True, "m2_mask.tau": 0.001}), 4)
    assert m["train/m2_masked_frac"].item() == 0.75


def test_opsm_hand_computed():
    # both sequences: mean KL(mu || pi) = mean(log mu - log pi) = 0.5 > delta; only the A < 0 one is masked
    lp = torch.full((2, 2), -1.0, requires_grad=True)
    ro = torch.tensor([[-0.5, -0.5], [-0.5, -0.5]])
    a = algo(**{"opsm.enable": True, "opsm.delta": 0.1})
    loss, m = losses.ppo(losses.TokenBatch(lp, lp.detach(), ro, torch.tensor([1.0, -1.0]), torch.ones(2, 2)), a, 4)
    loss.backward()
    assert m["train/opsm_masked_frac"].item() == 0.5 and loss.item() == pytest.approx(-0.5)
    assert torch.all(lp.grad[1] == 0) and torch.all(lp.grad[0] != 0)
    a = algo(**{"opsm.enable": True, "opsm.delta": 0.6})  # KL below delta: nothing masked
    _, m = losses.ppo(losses.TokenBatch(lp, lp.detach(), ro, torch.tensor([1.0, -1.0]), torch.ones(2, 2)), a, 4)
    assert m["train/opsm_masked_frac"].item() == 0.0


def test_masked_tokens_and_sequences_get_exactly_zero_gradient():
    a = algo(**{"dual_clip_c": 3.0, "is_correction.enable": True, "is_correction.mask_low": 0.8,
                "is_correction.mask_high": 1.25, "m2_mask.enable": True, "m2_mask.tau": 0.05,
                "opsm.enable": True, "opsm.delta": 0.02})
    for seed in SEEDS:
        lp, old, ro, adv, mask = random_batch(seed, nonfinite=True)
        x = lp.clone().requires_grad_()
        loss, m = losses.ppo(losses.TokenBatch(x, old, ro, adv, mask), a, losses.loss_denominator(mask, "token-mean"))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
        assert torch.all(x.grad[~mask] == 0)
        assert torch.all(x.grad[[0, 1, 2], [1, 2, 3]] == 0) and torch.all(x.grad[3] == 0)  # NaN/inf tokens
        assert m["train/nan_ratio"].item() > 0


def test_nan_logits_never_reach_the_gradient():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 9, generator=g)
    logits[1, 2, 5] = float("nan")
    logits.requires_grad_()
    targets = torch.randint(0, 9, (2, 4), generator=g)
    logp, ent = logprobs.token_logprobs(logits, targets, 1.0, chunk_size=3, with_entropy=True)
    mask = torch.ones(2, 4, dtype=torch.bool)
    batch = losses.TokenBatch(logp, logp.detach() + 0.1, None, torch.tensor([1.0, -1.0]), mask, entropy=ent)
    loss, m = losses.ppo(batch, algo(), 8)
    loss.backward()
    assert m["train/nan_ratio"].item() == pytest.approx(1 / 8) and torch.isfinite(m["train/entropy"])
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all() and torch.all(logits.grad[1, 2] == 0)


def test_corrections_need_rollout_log_probs():
    lp, old, _, adv, mask = random_batch(0)
    for key in ("is_correction", "m2_mask"):
        with pytest.raises(ValueError, match=f"algorithm.{key}.enable=true needs rollout_log_probs"):
            losses.ppo(losses.TokenBatch(lp, old, None, adv, mask), algo(**{f"{key}.enable": True}), 10)
    losses.ppo(losses.TokenBatch(lp, old, None, adv, mask), algo(**{"opsm.enable": True}), 10)  # OPSM falls back to old


def test_a_loss_missing_a_batch_field_it_reads_names_it_in_one_sentence():
    lp, old, ro, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match="^algorithm.policy_loss=gspo needs old_log_probs in the TokenBatch$"):
        losses.gspo(losses.TokenBatch(lp, None, ro, adv, mask), algo(), 10)
    with pytest.raises(ValueError, match="^algorithm.policy_loss=loglinear needs versions in the TokenBatch$"):
        losses.loglinear(losses.TokenBatch(lp, None, ro, adv, mask), algo(), 10)
    versions = torch.zeros(lp.shape, dtype=torch.long)
    loss, _ = losses.loglinear(losses.TokenBatch(lp, None, ro, adv, mask, versions, 1), algo(), 10)  # reads no old
    assert torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------------------
# Aggregation across micro-batches and data-parallel ranks
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_split_microbatches_sum_to_minibatch_loss(mode):
    # The M2 mask is left out: it is defined per call (see m2_mask), so a split may mask differently by design.
    a = algo(loss_agg_mode=mode, dual_clip_c=3.0, **{"is_correction.enable": True, "is_correction.level": "sequence",
                                                     "opsm.enable": True, "opsm.delta": 0.05})
    splits = [[0, 3], [3, 4], [4, 8], [8, 12]]  # e.g. 2 ranks x 2 micro-batches of uneven sizes
    for seed in range(10):
        lp, old, ro, adv, mask = random_batch(seed, B=12, T=9, nonfinite=seed % 3 == 0)
        D = sum(losses.loss_denominator(mask[s:e], mode, norm_len=16) for s, e in splits)  # the all-reduced sum
        assert D == losses.loss_denominator(mask, mode, norm_len=16)
        full_x = lp.clone().requires_grad_()
        full, _ = losses.ppo(losses.TokenBatch(full_x, old, ro, adv, mask), a, D)
        full.backward()
        x = lp.clone().requires_grad_()
        total = sum(losses.ppo(losses.TokenBatch(x[s:e], old[s:e], ro[s:e], adv[s:e], mask[s:e]), a, D)[0]
                    for s, e in splits)
        total.backward()
        assert total.item() == pytest.approx(full.item(), rel=1e-6, abs=1e-7)
        assert torch.allclose(x.grad, full_x.grad, atol=1e-7)


def test_loss_denominator_values_and_errors():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert losses.loss_denominator(mask, "token-mean") == 3.0
    assert losses.loss_denominator(mask, "seq-mean-token-mean") == 2.0
    assert losses.loss_denominator(mask, "seq-mean-token-sum") == 2.0
    assert losses.loss_denominator(mask, "seq-mean-token-sum-norm", norm_len=10) == 20.0
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm needs"):
        losses.loss_denominator(mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="algorithm.loss_agg_mode 'mean' is unknown"):
        losses.loss_denominator(mask, "mean")


def test_empty_minibatch_gives_zero_loss_and_metrics():
    lp = torch.zeros(2, 3, requires_grad=True)
    a = algo(**{"is_correction.enable": True, "m2_mask.enable": True, "opsm.enable": True})
    loss, m = losses.ppo(losses.TokenBatch(lp, lp.detach(), lp.detach(), torch.ones(2), torch.zeros(2, 3)), a, 0)
    loss.backward()
    assert loss.item() == 0 and torch.all(lp.grad == 0)
    assert all(torch.isfinite(torch.as_tensor(v)) and float(v) == 0 for v in m.values())


# ---------------------------------------------------------------------------------------------------------
# offpolicy_warning
# ---------------------------------------------------------------------------------------------------------

def run_cfg(fully_async=True, use_rollout=True, **kw):
    return SimpleNamespace(fully_async=SimpleNamespace(enable=fully_async),
                           trainer=SimpleNamespace(use_rollout_log_probs=use_rollout), algorithm=algo(**kw))


def test_offpolicy_warning():
    text = losses.offpolicy_warning(run_cfg())
    assert "WARNING" in text and "trainer.use_rollout_log_probs=true" in text and "algorithm.opsm" in text
    assert losses.offpolicy_warning(run_cfg(fully_async=False)) is None
    assert losses.offpolicy_warning(run_cfg(use_rollout=False)) is None
    assert losses.offpolicy_warning(run_cfg(**{"opsm.enable": True})) is None
    # IS correction compares two identical tensors here: still warned about, and the text says why
    assert "algorithm.is_correction.enable=true cannot help" in losses.offpolicy_warning(
        run_cfg(**{"is_correction.enable": True}))
    cfg = config.from_dict({"colocate": False, "fully_async": {"enable": True},
                            "trainer": {"use_rollout_log_probs": True}})
    assert losses.offpolicy_warning(cfg) is not None


# ---------------------------------------------------------------------------------------------------------
# The peers' corrections: AReaL's decoupled PPO, PipelineRL's truncated IS
# ---------------------------------------------------------------------------------------------------------

def test_loglinear_proximal_hand_computed():
    # current version 4; tokens from versions 3 (one behind), 2, 0, 4 (on-policy) and an environment token (-1)
    mu = torch.tensor([[-1.0, -1.0, -2.0, -0.5, 0.0]])
    theta = torch.tensor([[-0.5, -3.0, -1.0, -0.7, -9.0]])
    versions = torch.tensor([[3, 2, 0, 4, -1]])
    prox = losses.loglinear_proximal_log_probs(mu, theta, versions, 4)
    # alpha = 0, (3 - 2) / (4 - 2) = 1/2, 3 / 4, 0 (v - v_t = 0), 0 (not generated)
    assert prox[0].tolist() == pytest.approx([-1.0, -2.0, -2.0 + 0.75 * 1.0, -0.5, 0.0])


def proximal(method, old, behav, lp, versions, current_version):
    """pi_prox as each decoupled loss takes it: decoupled_ppo's is old_log_probs, loglinear's is interpolated."""
    if method == "decoupled_ppo":
        return old
    return losses.loglinear_proximal_log_probs(behav, lp, versions, current_version)


def areal_decoupled_loss(lp, prox, behav, adv, mask, eps_low, eps_high, cap):
    """AReaL's paper's decoupled PPO, written out per token in Python floats: the behaviour weight pi_prox / mu,
    tokens above the cap out of the loss; cap None: no behaviour weight (AReaL 1.0.4's rejection_sampling=None)."""
    lp, prox, behav, adv, mask = lp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist()
    total, n = 0.0, 0
    for i in range(len(lp)):
        for t in range(len(lp[0])):
            if not mask[i][t]:
                continue
            n += 1
            ratio = math.exp(lp[i][t] - prox[i][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            pg = max(-adv[i] * ratio, -adv[i] * clipped)
            w = math.exp(prox[i][t] - behav[i][t])
            if cap is None:
                total += pg
            else:
                total += pg * w if w <= cap else 0.0  # above the cap: out of the loss, still in the denominator
    return total / n


@pytest.mark.parametrize("method", ["decoupled_ppo", "loglinear"])
def test_decoupled_ppo_is_policy_loss_around_the_proximal_policy_with_a_capped_behaviour_weight(method):
    cap = 1.6
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        B, T = 4, 6
        behav = -torch.rand(B, T, generator=g) * 2
        old = behav + torch.randn(B, T, generator=g) * 0.4
        lp = (old + torch.randn(B, T, generator=g) * 0.3).requires_grad_()
        versions = torch.randint(0, 5, (B, T), generator=g)
        adv = torch.randn(B, generator=g)
        mask = torch.rand(B, T, generator=g) > 0.2
        prox = proximal(method, old, behav, lp, versions, 5)
        a = algo(**{"decoupled_ppo.behav_imp_weight_cap": cap})
        loss, m = losses.POLICY_LOSSES[method](losses.TokenBatch(lp, old, behav, adv, mask, versions, 5), a,
                                               losses.loss_denominator(mask, "token-mean"))
        ref = areal_decoupled_loss(lp.detach().double(), prox.double(), behav.double(), adv.double(), mask,
                                   a.clip_low, a.clip_high, cap)
        assert float(loss.detach()) == pytest.approx(ref, rel=1e-5, abs=1e-6), seed
        loss.backward()
        # the gradient flows through the ratio only: masked tokens and capped ones get exactly zero
        w = (prox - behav).exp()
        assert (lp.grad[~mask | (w > cap)] == 0).all()


@pytest.mark.parametrize("method", ["decoupled_ppo", "loglinear"])
def test_decoupled_ppo_without_a_cap_has_no_behaviour_weight_as_areal_1_0_4_by_default(method):
    """AReaL 1.0.4: rejection_sampling=None (its top-level default) multiplies nothing into the loss: decoupled PPO
    is then the plain PPO clip around pi_prox, every token kept however far pi_prox is from mu
    (algorithm.decoupled_ppo.behav_imp_weight_cap=null)."""
    g = torch.Generator().manual_seed(3)
    behav = -torch.rand(4, 6, generator=g) * 2
    old = behav + torch.randn(4, 6, generator=g)  # pi_prox / mu far above any cap
    lp = old + torch.randn(4, 6, generator=g) * 0.3
    versions, adv = torch.randint(0, 5, (4, 6), generator=g), torch.randn(4, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.2
    D = losses.loss_denominator(mask, "token-mean")
    prox = proximal(method, old, behav, lp, versions, 5)
    loss, m = losses.POLICY_LOSSES[method](losses.TokenBatch(lp, old, behav, adv, mask, versions, 5),
                                           algo(**{"decoupled_ppo.behav_imp_weight_cap": None}), D)
    ref = areal_decoupled_loss(lp.double(), prox.double(), behav.double(), adv.double(), mask, 0.2, 0.28, None)
    assert float(loss) == pytest.approx(ref, rel=1e-5, abs=1e-7) and "train/behav_capped_frac" not in m
    weighted = areal_decoupled_loss(lp.double(), prox.double(), behav.double(), adv.double(), mask, 0.2, 0.28, 1e9)
    assert abs(weighted - ref) > 1e-2  # the weight would have changed the loss: the test can tell them apart


def tis(epsilon_high):
    return algo(**{"policy_loss": "truncated_is", "loss_agg_mode": "seq-mean-token-sum",
                   "truncated_is.epsilon_high": epsilon_high})


def test_truncated_is_loss_value_and_gradient_hand_computed():
    lp = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]], requires_grad=True)
    mu = torch.tensor([[math.log(0.25), math.log(0.9), math.log(0.4)]])  # pi / mu = 2, 1, 0.5
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = losses.truncated_is(losses.TokenBatch(lp, None, mu, adv, mask), tis(0.5), 2.0)
    w = [1.5, 1.0]  # 2 truncated at 1 + eps_high; the masked token is out
    assert float(loss) == pytest.approx(-(w[0] * 2 * math.log(0.5) + w[1] * 2 * math.log(0.9)) / 2)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.5 * 2 / 2, -1.0 * 2 / 2, 0.0])  # d/dlp = -w A / D, w detached
    assert float(m["train/tis_mean"]) == pytest.approx(1.25) and float(m["train/tis_truncated_frac"]) == 0.5
    with pytest.raises(ValueError, match="^algorithm.policy_loss=truncated_is divides its token sum by the number of "
                                         "sequences"):
        losses.check_policy_loss(algo(policy_loss="truncated_is"), False)


def test_truncated_is_leaves_non_finite_tokens_out_as_ppo_does():
    """A NaN log-prob (trainer side) or an inf behaviour log-prob (a server's -inf) must not poison the loss or the
    gradient of the other tokens; it leaves the loss and is counted in train/nan_ratio, D unchanged."""
    lp = torch.tensor([[math.log(0.5), float("nan"), math.log(0.2)]], requires_grad=True)
    mu = torch.tensor([[math.log(0.25), math.log(0.9), -float("inf")]])
    adv, mask = torch.tensor([2.0]), torch.tensor([[1, 1, 1]])
    loss, m = losses.truncated_is(losses.TokenBatch(lp, None, mu, adv, mask), tis(0.5), 3.0)
    assert float(loss) == pytest.approx(-(1.5 * 2 * math.log(0.5)) / 3)  # only the finite token, over D = 3
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0].tolist() == pytest.approx([-1.5 * 2 / 3, 0.0, 0.0])
    assert float(m["train/nan_ratio"]) == pytest.approx(2 / 3) and float(m["train/tis_mean"]) == pytest.approx(1.5)


def test_truncated_is_loss_matches_loop_reference():
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        lp = (-torch.rand(3, 5, generator=g) * 3).requires_grad_()
        mu = lp.detach() + torch.randn(3, 5, generator=g)
        adv, mask = torch.randn(3, generator=g), torch.rand(3, 5, generator=g) > 0.3
        loss, _ = losses.truncated_is(losses.TokenBatch(lp, None, mu, adv, mask), tis(0.2),
                                      float(mask.sum()))
        ref = sum(-min(max(math.exp(lp[i, t].item() - mu[i, t].item()), 0.0), 1.2) * adv[i].item() * lp[i, t].item()
                  for i in range(3) for t in range(5) if mask[i, t]) / max(1, int(mask.sum()))
        assert float(loss) == pytest.approx(ref, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------
# algorithm.policy_loss: the registry, what each loss declares, and train.py's call (actor.micro_batch_loss)
# ---------------------------------------------------------------------------------------------------------

def test_every_policy_loss_is_registered_with_one_signature_and_declares_whether_it_reads_old_log_probs():
    assert list(losses.POLICY_LOSSES) == ["ppo", "truncated_is", "decoupled_ppo", "loglinear", "m2po", "gspo",
                                          "cispo"]
    for name, fn in losses.POLICY_LOSSES.items():
        assert fn is getattr(losses, name) and list(inspect.signature(fn).parameters) == [
            "batch", "settings", "denominator"], name
    quiet = {name for name, fn in losses.POLICY_LOSSES.items() if not losses.declaration(fn).reads_old_log_probs}
    assert quiet == {"truncated_is", "loglinear", "m2po"}
    assert losses.declaration(lambda batch, settings, denominator: None) == (True, None)  # declared nothing


def test_register_refuses_a_taken_name_and_a_non_function_in_one_sentence():
    with pytest.raises(ValueError, match="^policy loss 'ppo' is already registered by ppo$"):
        losses.register("ppo")(lambda batch, settings, denominator: None)
    with pytest.raises(TypeError, match=r"^@losses.register\('mine'\) must decorate a function \(batch, settings, "):
        losses.register("mine")(3)
    with pytest.raises(TypeError, match="check=3"):
        losses.register("mine", check=3)(losses.ppo)
    assert "mine" not in losses.POLICY_LOSSES and losses.register("ppo")(losses.ppo) is losses.ppo  # again: fine


@pytest.mark.parametrize("overrides,fragment", [
    (["algorithm.policy_loss=reinforce"], "algorithm.policy_loss must be one of ppo, truncated_is, decoupled_ppo, "
                                          "loglinear, m2po, gspo, cispo or module:function, got 'reinforce'"),
    (["algorithm.policy_loss=truncated_is", "algorithm.loss_agg_mode=token-mean"],
     "algorithm.policy_loss=truncated_is divides its token sum by the number of sequences"),
    (["algorithm.policy_loss=truncated_is", "algorithm.loss_agg_mode=seq-mean-token-sum",
      "algorithm.opsm.enable=true"], "algorithm.policy_loss=truncated_is applies none of the corrections, as "
                                     "published; set algorithm.opsm.enable to false"),
    (["algorithm.policy_loss=m2po", "algorithm.is_correction.enable=true", "algorithm.m2_mask.enable=true"],
     "algorithm.policy_loss=m2po applies none of the corrections, as published; set "
     "algorithm.is_correction.enable and algorithm.m2_mask.enable to false"),
    (["algorithm.policy_loss=decoupled_ppo", "algorithm.is_correction.enable=true"],
     "algorithm.policy_loss=decoupled_ppo weights each token by pi_prox / mu itself"),
    # renamed: refused in one sentence naming the new name
    (["algorithm.policy_loss=recompute"], "^algorithm.policy_loss=recompute is now decoupled_ppo"),
    (["algorithm.m2po.enable=true"], "^algorithm.m2po.enable is now algorithm.m2_mask.enable"),
    (["algorithm.policy_loss=loglinear", "algorithm.is_correction.enable=true"],
     "algorithm.policy_loss=loglinear weights each token by pi_prox / mu"),
    (["algorithm.policy_loss=decoupled_ppo", "trainer.use_rollout_log_probs=true"],
     "algorithm.policy_loss=decoupled_ppo takes its proximal policy from the step-start forward"),
])
def test_policy_loss_combinations_are_refused_in_one_sentence(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        config.load_config(None, ["colocate=false", *overrides])


def test_decoupled_ppo_accepts_ppos_correction_settings_while_it_is_off():
    """A config that sets is_correction's level for another loss, the correction off, switches to decoupled_ppo."""
    cfg = config.load_config(None, ["colocate=false", "algorithm.policy_loss=decoupled_ppo",
                                    "algorithm.is_correction.level=sequence"])
    assert cfg.algorithm.policy_loss == "decoupled_ppo" and not cfg.algorithm.is_correction.enable


def collated_batch(seed, step):
    """A batching.collate micro-batch (3 sequences, uneven lengths, tokens from versions up to `step`) and the
    current, old and entropy tensors on its loss positions."""
    import batching

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i, T in enumerate((4, 6, 3)):
        seqs.append({"prompt": [1] * (2 + i), "response": list(range(3, 3 + T)), "mask": [1] * T,
                     "rollout_lp": (-torch.rand(T, generator=g) * 2).tolist(),
                     "versions": torch.randint(0, step + 1, (T,), generator=g).tolist(),
                     "adv": float(torch.randn(1, generator=g))})
    b = batching.collate(seqs)
    rlp = b["rollout_lp"]
    old = rlp + torch.randn(rlp.shape, generator=g) * 0.4
    lp = (old + torch.randn(rlp.shape, generator=g) * 0.3).requires_grad_()
    ent = torch.rand(rlp.shape, generator=g)
    return b, lp, old, ent


def test_each_policy_loss_choice_through_train_py_gives_its_reference_numbers():
    """actor.micro_batch_loss is the one call in Actor.forward_backward: each algorithm.policy_loss reaches its
    function, and they all give different losses on the same batch (so a trainer that ignored the choice would fail
    here)."""
    import actor as actor_lib

    step, cap = 3, 5.0
    for seed in range(5):
        b, lp, old, ent = collated_batch(seed, step)
        mask, rlp, adv = b["mask"], b["rollout_lp"], b["adv"]
        D = losses.loss_denominator(mask, "token-mean")
        prox = losses.loglinear_proximal_log_probs(rlp, lp, b["versions"], step + 1)
        refs = {
            "ppo": float(losses.ppo(losses.TokenBatch(lp, old, rlp, adv, mask), algo(), D)[0].detach()),
            "truncated_is": float(losses.truncated_is(losses.TokenBatch(lp, None, rlp, adv, mask), algo(),
                                                      D)[0].detach()),
            # AReaL's paper: the behaviour weight pi_prox / mu, masked above the cap (algorithm.decoupled_ppo's 5)
            "decoupled_ppo": areal_decoupled_loss(lp.detach().double(), old.double(), rlp.double(), adv.double(),
                                                  mask, 0.2, 0.28, cap),
            "m2po": float(losses.m2po(losses.TokenBatch(lp, None, rlp, adv, mask), algo(), D)[0].detach()),
            "loglinear": areal_decoupled_loss(lp.detach().double(), prox.double(), rlp.double(), adv.double(),
                                              mask, 0.2, 0.28, cap),
            "gspo": float(losses.gspo(losses.TokenBatch(lp, old, rlp, adv, mask), algo(), D)[0].detach()),
            "cispo": float(losses.cispo(losses.TokenBatch(lp, old, rlp, adv, mask), algo(), D)[0].detach()),
        }
        got = {}
        for name in losses.POLICY_LOSSES:
            cfg = config.from_dict({"algorithm": {"policy_loss": name}})
            loss, metrics = actor_lib.micro_batch_loss(cfg, lp, old, b, D, ent, step)
            got[name] = float(loss.detach())
            assert got[name] == pytest.approx(refs[name], rel=1e-5, abs=1e-6), (seed, name)
            assert float(metrics["train/pg_loss"]) == pytest.approx(got[name], rel=1e-6)
            assert "train/entropy" in metrics
        assert len({round(v, 6) for v in got.values()}) == len(losses.POLICY_LOSSES), got


def test_decoupled_choices_leave_the_run_config_as_it_was():
    import actor as actor_lib

    b, lp, old, ent = collated_batch(0, 2)
    cfg = config.from_dict({"algorithm": {"policy_loss": "loglinear"}})
    actor_lib.micro_batch_loss(cfg, lp, old, b, 10.0, ent, 2)
    assert cfg.algorithm.is_correction.enable is False and cfg.algorithm.is_correction.level == "token"


def test_offpolicy_warning_is_quiet_for_losses_that_do_not_use_old_log_probs(monkeypatch):
    for name in ("truncated_is", "loglinear", "m2po"):
        assert losses.offpolicy_warning(run_cfg(policy_loss=name)) is None
    assert losses.offpolicy_warning(run_cfg(policy_loss="ppo")) is not None
    # what is read is the loss's declaration, so a loss of your own is heard the same way
    quiet = losses.register(reads_old_log_probs=False)(lambda batch, settings, denominator: None)
    monkeypatch.setitem(losses.POLICY_LOSSES, "mine:quiet", quiet)
    assert losses.offpolicy_warning(run_cfg(policy_loss="mine:quiet")) is None


# ---------------------------------------------------------------------------------------------------------
# Staleness diagnostics: train/is_ess, train/is_log_ratio_m2, train/neg_adv_high_ratio_frac
# ---------------------------------------------------------------------------------------------------------

def test_offpolicy_diagnostics_hand_computed():
    # pi / mu = 2, 1, 0.5 on the loss tokens of sequence 0 (A = -1), 4 on sequence 1 (A = +1); one masked token
    pi = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.1)], [math.log(0.8), math.log(0.9), 0.0]])
    mu = torch.tensor([[math.log(0.25), math.log(0.3), math.log(0.2)], [math.log(0.2), math.log(0.1), 0.0]])
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    s = losses.offpolicy_diagnostic_sums(pi, mu, adv, mask, eps_high=0.28)
    w, l2 = [2.0, 1.0, 0.5, 4.0], [math.log(2) ** 2, 0.0, math.log(2) ** 2, math.log(4) ** 2]
    assert s == pytest.approx({"n": 4, "w": sum(w), "w2": sum(x * x for x in w), "m2": sum(l2), "neg_high": 1})
    m = losses.offpolicy_diagnostics(s)
    assert m["train/is_ess"] == pytest.approx(7.5 ** 2 / (4 * 21.25))  # (sum w)^2 / (n sum w^2) = 0.6618
    assert m["train/is_log_ratio_m2"] == pytest.approx(sum(l2) / 4)
    assert m["train/neg_adv_high_ratio_frac"] == 0.25  # only pi / mu = 2 with A < 0; 4 has A > 0
    # on-policy: ESS exactly 1, nothing else; no loss token: the same neutral values
    assert losses.offpolicy_diagnostics(losses.offpolicy_diagnostic_sums(mu, mu, adv, mask, 0.28)) == {
        "train/is_ess": 1.0, "train/is_log_ratio_m2": 0.0, "train/neg_adv_high_ratio_frac": 0.0}
    assert losses.offpolicy_diagnostics(losses.offpolicy_diagnostic_sums(pi, mu, adv, mask * 0, 0.28))[
        "train/is_ess"] == 1.0


def test_offpolicy_diagnostics_are_exact_over_micro_batches_and_skip_non_finite_tokens():
    """Sums over two micro-batches then one ratio equal the ratio over the whole batch (the trainer's aggregation
    over micro-batches and ranks); a mean of the two ESS values would not."""
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(6, 5, generator=g) * 3
    pi = mu + torch.randn(6, 5, generator=g) * torch.tensor([0.1, 0.1, 0.1, 2.0, 2.0, 2.0]).unsqueeze(-1)
    adv, mask = torch.randn(6, generator=g), torch.rand(6, 5, generator=g) > 0.2
    whole = losses.offpolicy_diagnostics(losses.offpolicy_diagnostic_sums(pi, mu, adv, mask, 0.2))
    parts = [losses.offpolicy_diagnostic_sums(pi[r], mu[r], adv[r], mask[r], 0.2) for r in (slice(0, 3), slice(3, 6))]
    summed = losses.offpolicy_diagnostics({k: parts[0][k] + parts[1][k] for k in parts[0]})
    assert summed == pytest.approx(whole)
    halves = [losses.offpolicy_diagnostics(p)["train/is_ess"] for p in parts]
    assert abs(sum(halves) / 2 - whole["train/is_ess"]) > 0.05  # the mean of ratios is a different number
    assert 0 < whole["train/is_ess"] < 1
    bad = pi.clone()
    bad[0, 0], bad[1, 1] = float("nan"), float("inf")
    keep = mask.clone()
    keep[0, 0] = keep[1, 1] = False
    assert losses.offpolicy_diagnostic_sums(bad, mu, adv, mask, 0.2) == pytest.approx(
        losses.offpolicy_diagnostic_sums(pi, mu, adv, keep, 0.2))


# ---------------------------------------------------------------------------------------------------------
# GSPO and CISPO against their papers' formulas (and GSPO against verl's form of it)
# ---------------------------------------------------------------------------------------------------------

def gspo_paper_loss(lp, old, adv, mask, eps_low, eps_high):
    """GSPO (arXiv 2507.18071, eq. 5-7), written from the paper: s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|),
    J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); returns -J, differentiable in lp
    through s_i itself (no stop-gradient trick)."""
    terms = []
    for i in range(lp.shape[0]):
        m = mask[i]
        if not m.any():
            continue
        s = torch.exp((lp[i][m] - old[i][m]).sum() / m.sum())
        terms.append(torch.minimum(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i]))
    return -torch.stack(terms).sum() / len(terms)


def gspo_verl_loss(lp, old, adv, mask, eps_low, eps_high):
    """verl 0.9's compute_policy_loss_gspo (verl/trainer/ppo/core_algos.py), rewritten here from its formula:
    log s_it = sg[mean_t (lp - old)] + lp - sg[lp] (clamped above at 10), the PPO max of the two surrogate terms
    per token, aggregated seq-mean-token-mean (verl forces it for GSPO)."""
    m = mask.to(lp.dtype)
    seq = ((lp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    s = torch.exp(torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0))
    a = adv.unsqueeze(-1)
    pg = torch.maximum(-a * s, -a * s.clamp(1 - eps_low, 1 + eps_high))
    per_seq = (pg * m).sum(-1) / m.sum(-1).clamp(min=1)
    has = m.sum(-1) > 0
    return per_seq[has].sum() / has.sum()


def test_gspo_equals_the_paper_and_verl_in_value_and_gradient():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        B, T = 5, 7
        old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
        lp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.05 * (1 + seed % 4)).requires_grad_()
        adv = torch.randn(B, generator=g, dtype=torch.float64)
        mask = torch.rand(B, T, generator=g) > 0.25
        eps = (0.0003, 0.0004) if seed % 2 else (0.2, 0.28)  # the paper's range, and the PPO defaults
        a = algo(clip_low=eps[0], clip_high=eps[1], loss_agg_mode="seq-mean-token-mean")
        D = losses.loss_denominator(mask, a.loss_agg_mode)
        loss, m = losses.gspo(losses.TokenBatch(lp, old, None, adv, mask), a, D)
        grad, = torch.autograd.grad(loss, lp)
        for ref_fn in (gspo_paper_loss, gspo_verl_loss):
            x = lp.detach().clone().requires_grad_()
            ref = ref_fn(x, old, adv, mask, *eps)
            ref_grad, = torch.autograd.grad(ref, x)
            assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7), seed
            assert torch.allclose(grad.double(), ref_grad, rtol=1e-4, atol=1e-7), (seed, ref_fn.__name__)
        assert (grad[~mask] == 0).all()


def test_gspo_clips_whole_sequences():
    """One sequence whose geometric-mean ratio is 1.5 (> 1 + 0.28) with A > 0: every one of its tokens is clipped
    and gets zero gradient, even the token whose own ratio is below 1 (a token-level clip would keep it)."""
    old = torch.zeros(1, 3)
    lp = torch.tensor([[math.log(0.9), math.log(2.5), math.log(1.5 ** 3 / (0.9 * 2.5))]]).requires_grad_()
    loss, m = losses.gspo(losses.TokenBatch(lp, old, None, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool)),
                          algo(), 3.0)
    assert float(loss.detach()) == pytest.approx(-1.28)  # token-mean of -clip(s) A over its 3 tokens
    loss.backward()
    assert (lp.grad == 0).all() and float(m["train/clip_ratio"]) == 1.0


def cispo_paper_loss(lp, old, adv, mask, eps_low, eps_high):
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5) in Python floats: -(1 / sum_i |o_i|) sum_{i,t}
    sg[clip(r_it, 1 - eps_low, 1 + eps_high)] A_i log pi_theta(o_it), and d/dlog pi_theta = -clip(r) A / sum |o|."""
    n = int(mask.sum())
    total, grad = 0.0, torch.zeros(lp.shape, dtype=torch.float64)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t]:
                r = min(max(math.exp(lp[i, t].item() - old[i, t].item()), 1 - eps_low), 1 + eps_high)
                total -= r * adv[i].item() * lp[i, t].item()
                grad[i, t] = -r * adv[i].item() / n
    return total / n, grad


def test_cispo_equals_the_paper_in_value_and_gradient():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        old = -torch.rand(4, 6, generator=g) * 2
        lp = (old + torch.randn(4, 6, generator=g) * 0.4).requires_grad_()
        adv, mask = torch.randn(4, generator=g), torch.rand(4, 6, generator=g) > 0.2
        eps = (0.99, 0.28) if seed % 2 else (0.2, 0.28)  # the paper's practice (no lower bound), and symmetric
        a = algo(clip_low=eps[0], clip_high=eps[1], dual_clip_c=3.0)  # dual-clip does not touch CISPO
        loss, m = losses.cispo(losses.TokenBatch(lp, old, None, adv, mask), a,
                               losses.loss_denominator(mask, "token-mean"))
        ref, ref_grad = cispo_paper_loss(lp.detach(), old, adv, mask, *eps)
        assert float(loss) == pytest.approx(ref, rel=1e-5, abs=1e-6), seed
        loss.backward()
        assert torch.allclose(lp.grad.double(), ref_grad, rtol=1e-5, atol=1e-7), seed
        r = (lp.detach() - old).exp()
        clipped = (r < 1 - eps[0]) | (r > 1 + eps[1])
        assert float(m["train/clip_ratio"]) == pytest.approx(float(clipped[mask].float().mean()))


# ---------------------------------------------------------------------------------------------------------
# The published estimators against their peers' own functions (tests/fixtures/peer_losses.json, written by
# bench/make_loss_fixtures.py from AReaL v1.0.4 37d6c6400e99a05fa3409d6a067762a44df40d3b and PipelineRL
# 58d393458625ad63ed539f2dcd072c85700c557f; the file names its pins)
# ---------------------------------------------------------------------------------------------------------

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "peer_losses.json")


@pytest.fixture(scope="module")
def peers():
    with open(FIXTURE) as f:
        data = json.load(f)
    assert data["pins"] == {"AReaL": "v1.0.4 37d6c6400e99a05fa3409d6a067762a44df40d3b",
                            "PipelineRL": "58d393458625ad63ed539f2dcd072c85700c557f"}
    x = data["inputs"]
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in x.items() if k not in ("loss_mask", "versions",
                                                                                          "current_version")}
    tensors.update(loss_mask=torch.tensor(x["loss_mask"]), versions=torch.tensor(x["versions"]),
                   current_version=x["current_version"])
    return data, tensors


def run_peer_loss(name, x, settings):
    """losses.<name> on the fixture's inputs, through its registry entry and the run config's denominator."""
    lp = x["log_probs"].clone().requires_grad_()
    batch = losses.TokenBatch(lp, x["old_log_probs"], x["rollout_log_probs"], x["advantages"], x["loss_mask"],
                              x["versions"], x["current_version"])
    D = losses.loss_denominator(x["loss_mask"], settings.loss_agg_mode)
    loss, metrics = losses.POLICY_LOSSES[name](batch, settings, D)
    loss.backward()
    return float(loss.detach()), lp.grad.double(), {k: float(v) for k, v in metrics.items()}


def assert_matches(loss, grad, case, scale=1.0):
    """Our loss and gradient equal the peer's times `scale` (1 unless the normalisations differ, and then the test
    says why), to float32 rounding (AReaL takes its behaviour weight in float32, the project its losses)."""
    assert loss == pytest.approx(case["loss"] * scale, rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, torch.tensor(case["grad"], dtype=torch.float64) * scale, rtol=1e-4, atol=1e-6)


def decoupled_settings(data, **kw):
    st = data["settings"]
    return algo(clip_low=st["clip_low"], clip_high=st["clip_high"], **kw)


@pytest.mark.parametrize("name,case,action,c", [
    ("decoupled_ppo", "decoupled_ppo_mask", "mask", 3.0), ("decoupled_ppo", "decoupled_ppo_clamp", "clamp", 3.0),
    ("loglinear", "loglinear_mask", "mask", None)])
def test_decoupled_ppo_equals_areal_1_0_4(peers, name, case, action, c):
    """ppo_actor_loss_fn with rejection_sampling {token, ratio, upper 5, action}: value, gradient, and its counts of
    clipped (by side), dual-clipped and behaviour-capped tokens; loglinear's proximal policy equals AReaL's
    compute_prox_logp_approximations."""
    data, x = peers
    case = data["cases"][case]
    a = decoupled_settings(data, dual_clip_c=c, **{"decoupled_ppo.behav_imp_weight_cap": 5.0,
                                                   "decoupled_ppo.behav_imp_weight_action": action})
    loss, grad, m = run_peer_loss(name, x, a)
    assert_matches(loss, grad, case)
    n = int(x["loss_mask"].sum())
    kept = case["behave_kept"]  # AReaL's clip masks count the tokens left in the loss
    assert round(m["train/clip_ratio_high"] * kept) == case["clipped_high"] > 0
    assert round(m["train/clip_ratio_low"] * kept) == case["clipped_low"] > 0
    assert round(m["train/dual_clip_ratio"] * kept) == case["dual_clipped"]
    assert m["train/behav_capped_frac"] == pytest.approx(case["filtered_fraction"]) and case["filtered_fraction"] > 0
    assert m["train/behav_imp_weight_mean"] == pytest.approx(case["behave_imp_weight_mean"], rel=1e-5)
    assert kept == (n if action == "clamp" else n - round(case["filtered_fraction"] * n))
    if name == "loglinear":
        prox = losses.loglinear_proximal_log_probs(x["rollout_log_probs"], x["log_probs"], x["versions"],
                                                   x["current_version"])
        assert torch.allclose(prox, torch.tensor(case["proximal_log_probs"], dtype=torch.float64), atol=1e-6)


def test_the_clamped_behaviour_weight_is_not_areals_paper(peers):
    """The old recompute clamped pi_prox / mu (at is_correction.clip, 2) besides masking it above 5; neither that
    nor AReaL's own clamp action gives the paper's numbers, which mask and keep the raw weight below the cap."""
    data, x = peers
    paper = data["cases"]["decoupled_ppo_mask"]
    for action, cap in (("clamp", 5.0), ("clamp", 2.0)):
        a = decoupled_settings(data, dual_clip_c=3.0, **{"decoupled_ppo.behav_imp_weight_cap": cap,
                                                         "decoupled_ppo.behav_imp_weight_action": action})
        loss, grad, _ = run_peer_loss("decoupled_ppo", x, a)
        assert abs(loss - paper["loss"]) > 1e-2, (action, cap)
    # the old hybrid: weight min(w, 2), tokens above 5 masked (is_correction clip 2, mask_high 5 on pi_old / mu)
    a = decoupled_settings(data, dual_clip_c=3.0, **{"decoupled_ppo.behav_imp_weight_cap": None,
                                                     "is_correction.enable": True, "is_correction.clip": 2.0,
                                                     "is_correction.mask_high": 5.0})
    loss, _, _ = run_peer_loss("ppo", x, a)  # ppo around pi_old = pi_prox with that correction is exactly it
    assert abs(loss - paper["loss"]) > 1e-2


def test_m2_mask_equals_areals_m2po_up_to_its_normalisation(peers):
    """algorithm.m2_mask with ppo: AReaL 1.0.4's M2PO (_apply_m2po_masking of (log mu - log pi_prox)^2, then the
    clip around pi_prox). AReaL divides by the tokens the mask keeps; this project's D counts every loss token (masks
    never change D), so our loss is AReaL's times kept / n."""
    data, x = peers
    case = data["cases"]["m2_mask_ppo"]
    a = decoupled_settings(data, **{"m2_mask.enable": True, "m2_mask.tau": data["settings"]["m2po_tau"]})
    loss, grad, m = run_peer_loss("ppo", x, a)
    n, kept = int(x["loss_mask"].sum()), int(torch.tensor(case["loss_mask_in"]).sum())
    assert 0 < kept < n and m["train/m2_masked_frac"] == pytest.approx(1 - kept / n)
    assert_matches(loss, grad, case, scale=kept / n)


def test_m2po_is_the_papers_loss_with_areals_mask(peers):
    """m2po: ratio pi_theta / mu, no clip, the mask of (log pi_theta - log mu)^2 at tau 0.04 (AReaL's
    _apply_m2po_masking with prox = pi_theta: the same tokens), 1 / sum |o_i| (AReaL's kept-token mean times
    kept / n)."""
    data, x = peers
    case = data["cases"]["m2po"]
    loss, grad, m = run_peer_loss("m2po", x, algo(**{"m2po.tau": data["settings"]["m2po_tau"]}))
    n, kept = int(x["loss_mask"].sum()), int(torch.tensor(case["loss_mask_in"]).sum())
    assert 0 < kept < n and m["train/m2po_masked_frac"] == pytest.approx(1 - kept / n)
    assert_matches(loss, grad, case, scale=kept / n)
    assert (grad[~torch.tensor(case["loss_mask_in"])] == 0).all()
    # the clipped m2_mask correction on the same data is another estimator
    other, _, _ = run_peer_loss("ppo", x, algo(**{"m2_mask.enable": True}))
    assert abs(other - loss) > 1e-2


def test_truncated_is_equals_pipelinerls_rl_step(peers):
    """rl_step, policy_loss reinforce, conf/finetune/base.yaml's epsilon_high 0.02 and kl_coef 0: sum of
    -clamp(pi / mu, 0, 1.02) A log pi over the tokens, divided by the step's sequences."""
    data, x = peers
    case = data["cases"]["truncated_is"]
    assert case["config"] == {"policy_loss": "reinforce", "epsilon_high": 0.02, "kl_coef": 0.0, "entropy_bonus": 0.0}
    default = losses.LossSettings()
    assert default.truncated_is.epsilon_high == case["config"]["epsilon_high"]
    loss, grad, m = run_peer_loss("truncated_is", x, algo(loss_agg_mode="seq-mean-token-sum"))
    assert losses.loss_denominator(x["loss_mask"], "seq-mean-token-sum") == case["batch_size"]
    assert_matches(loss, grad, case)
    assert round(m["train/tis_truncated_frac"] * int(x["loss_mask"].sum())) == case["truncated_tokens"] > 0
    # the old form (epsilon 0.28, token-mean) is not PipelineRL's
    old, _, _ = run_peer_loss("truncated_is", x, algo(loss_agg_mode="token-mean",
                                                      **{"truncated_is.epsilon_high": 0.28}))
    assert abs(old - case["loss"]) > 1e-2
