"""The sampler's kept set at its edges: ties and exact boundary masses, min_p, and which backend's rule applies.

logprobs.Support replays, and standins/scheduler.py's sampler draws from, the set sglang 0.5.23's sampler keeps
(layers/sampler.py: Sampler._sample_from_probs). Each rule is checked against a literal port of its source here:
flashinfer 0.7.2's kernels (0.5.23 pins it; the default backend on CUDA) and 0.5.23's pytorch backend. Rows are
built from multiples of float32's ln 2, whose softmax is exact powers of two, so a mass can equal top_p exactly.

Run: python -m pytest -q -n 0 tests/test_sampling_support.py
"""
import math

import pytest
import torch

import config
import logprobs
import rollout
import sglang_client
from standins import engine, scheduler, tiny_model

LN2 = torch.tensor(math.log(2.0)).item()  # float32's ln 2


def halvings(*steps):
    """Scaled logits [V] float32 whose softmax is 2^-steps normalised, exactly (checked)."""
    x = torch.tensor(steps, dtype=torch.float32) * -LN2
    p = torch.tensor([2.0 ** -s for s in steps])
    assert torch.equal(torch.softmax(x, -1), p / p.sum()), "float32 softmax of multiples of ln 2 is not exact here"
    return x


ROW = halvings(0, 1, 2, 3, 3)  # p = [0.5, 0.25, 0.125, 0.0625, 0.0625]: the last two tied


def kept(x, targets, support):
    """The set Support replays per row of scaled logits x [R, V] (a target outside it joins it) -> bool [R, V]."""
    lowest, last, _ = logprobs._support_bounds(x, targets, support)
    return logprobs._restrict_(x.clone(), targets, lowest, last) > logprobs.OUTSIDE


def sets(mask):
    return [set(row.nonzero().flatten().tolist()) for row in mask]


# ---------------------------------------------------------------------------------------------------------------
# Literal ports of the sources

def flashinfer_joint(p, top_k, top_p):
    """flashinfer 0.7.2 sampling.cuh TopKTopPSamplingFromProbKernel (top_k_top_p_sampling_from_probs,
    filter_apply_order="joint"): a drawn token of probability pivot_0 is accepted when
    `aggregate_gt_pivot_0.count < k && aggregate_gt_pivot_0.value < p`, the count and mass of probs > pivot_0.
    p [R, V] float32 -> the accepted tokens, bool [R, V]."""
    k = top_k if top_k > 0 else 1 << 30  # sampling_params.py: TOP_K_ALL
    gt = p[:, None, :] > p[:, :, None]  # [R, j, i]: p_i > p_j
    return (gt.sum(-1) < k) & ((p[:, None, :] * gt).sum(-1) < torch.tensor(top_p, dtype=torch.float32))


def flashinfer_min_p(p, top_k, top_p, min_p):
    """0.5.23 layers/sampler.py Sampler._sample_from_probs with need_min_p_sampling: top_k_renorm_prob (flashinfer
    0.7.2 topk.cuh RadixTopKRenormProb: probs >= the k-th largest, renormalised), top_p_renorm_prob (sampling.cuh
    TopPRenormProbKernel: probs > low, where sum(probs > low) >= top_p > sum(probs > next value up); p >= 1: all,
    renormalised), min_p_sampling_from_probs (MinPSamplingFromProbKernel: probs >= max * min_p)."""
    k = min(top_k if top_k > 0 else 1 << 30, p.shape[-1])
    q = torch.where(p >= p.topk(k, -1).values[:, -1:], p, 0.0)
    q = q / q.sum(-1, keepdim=True)
    if top_p < 1:
        gt = q[:, None, :] > q[:, :, None]
        q = torch.where((q > 0) & ((q[:, None, :] * gt).sum(-1) < top_p), q, 0.0)
        q = q / q.sum(-1, keepdim=True)
    return (q > 0) & (q >= q.max(-1, keepdim=True).values * torch.tensor(min_p, dtype=torch.float32))


def pytorch_backend(p, top_k, top_p, min_p, targets):
    """0.5.23 layers/sampler.py top_k_top_p_min_p_sampling_from_probs_torch's filter, line for line, on p [R, V]
    float32. Its sort's order among ties is torch.sort's (unspecified); this port puts the target first, then the
    lowest ids, the order Support replays. -> bool [R, V]."""
    out = torch.zeros(p.shape, dtype=torch.bool)
    for r in range(p.shape[0]):
        order = sorted(range(p.shape[1]), key=lambda v: (-p[r, v].item(), v != targets[r].item(), v))
        probs_idx = torch.tensor(order)[None]
        probs_sort = p[r, probs_idx]
        top_ks = torch.tensor([top_k if top_k > 0 else 1 << 30])
        top_ps, min_ps = torch.tensor([top_p]), torch.tensor([min_p])
        probs_sum = torch.cumsum(probs_sort, dim=-1)
        probs_sort[torch.arange(0, probs_sort.shape[-1]).view(1, -1) >= top_ks.view(-1, 1)] = 0.0
        probs_sort[(probs_sum - probs_sort) > top_ps.view(-1, 1)] = 0.0
        if min_p > 0:
            min_p_thresholds = probs_sort[:, 0] * min_ps
            probs_sort[probs_sort < min_p_thresholds.view(-1, 1)] = 0.0
        out[r, probs_idx[probs_sort > 0]] = True
    return out


def stand_in(x, sps):
    """standins/scheduler.py filter_scores on one batch: row i of x [R, V] under sampling params sps[i]."""
    params = [engine.parse_sampling_params(sp, x.shape[1]) for sp in sps]
    return scheduler.filter_scores(torch.log_softmax(x, -1), params) > float("-inf")


# ---------------------------------------------------------------------------------------------------------------
# Rows built to tell the rules apart

def test_flashinfer_keeps_ties_together_and_drops_a_token_with_exactly_top_p_above():
    """flashinfer 0.7.2 sampling.cuh TopKTopPSamplingFromProbKernel (0.5.23 layers/sampler.py
    Sampler._sample_from_probs, filter_apply_order="joint"), on p = [0.5, 0.25, 0.125, 0.0625, 0.0625]: top_p 0.75
    keeps {0, 1}: token 2 has exactly 0.75 above it and `value < p` is strict; top_p 0.9 keeps all five: the tied
    tokens both have 0.875 above them; top_k 4 keeps all five: count(p > 0.0625) = 3 < 4. The replay (Support,
    backend "flashinfer") and the stand-in's sampler agree."""
    targets = torch.zeros(1, dtype=torch.long)
    for top_k, top_p, want in ((-1, 0.75, {0, 1}), (-1, 0.9, {0, 1, 2, 3, 4}), (4, 1.0, {0, 1, 2, 3, 4}),
                               (3, 0.9, {0, 1, 2}), (2, 0.76, {0, 1})):
        assert sets(flashinfer_joint(torch.softmax(ROW, -1)[None], top_k, top_p)) == [want]
        assert sets(kept(ROW[None], targets, logprobs.Support(top_k, top_p))) == [want], (top_k, top_p)
        assert sets(stand_in(ROW[None], [{"top_k": top_k, "top_p": top_p}])) == [want], (top_k, top_p)
    # through the kernels: the log-mass is the kept mass, 0.75 where a <= test would give 0.875
    _, _, mass = logprobs.token_logprobs(ROW[None], targets, 1.0, support=logprobs.Support(top_p=0.75))
    assert mass.exp().item() == 0.75


def test_pytorch_backend_keeps_the_token_crossing_top_p_and_cuts_ties_in_sort_order():
    """0.5.23 layers/sampler.py top_k_top_p_min_p_sampling_from_probs_torch on p = [0.5, 0.25, 0.125, 0.0625,
    0.0625]: top_p 0.75 keeps {0, 1, 2} (`(probs_sum - probs_sort) > top_ps` removes, so exactly 0.75 above
    stays); top_p 0.9 and top_k 4 keep four positions of the sorted row, one of the two tied tokens: the sampled one
    when it is tied, else the lower id. The kept mass is 0.9375 either way, and so are the log-probs, the entropy and
    the gradient of the kept tokens; the dropped tie gets none."""
    support = logprobs.Support(top_p=0.9, backend="pytorch")
    every = torch.arange(5)
    rows = ROW.expand(5, 5)
    got = kept(rows, every, support)
    assert sets(got) == [{0, 1, 2, 3}] * 4 + [{0, 1, 2, 4}]
    assert torch.equal(got, pytorch_backend(torch.softmax(rows, -1), -1, 0.9, 0.0, every))
    assert sets(kept(rows[:1], every[:1], logprobs.Support(top_p=0.75, backend="pytorch"))) == [{0, 1, 2}]
    assert sets(kept(rows[:1], every[:1], logprobs.Support(top_k=4, backend="pytorch"))) == [{0, 1, 2, 3}]
    logits = rows.clone().requires_grad_()
    lp, ent, mass = logprobs.token_logprobs(logits, every, 1.0, with_entropy=True, support=support)
    assert torch.equal(mass.exp(), torch.full((5,), 0.9375))
    renormalised = torch.tensor([0.5, 0.25, 0.125, 0.0625]) / 0.9375
    assert torch.allclose(lp, renormalised[[0, 1, 2, 3, 3]].log(), atol=1e-6)
    assert torch.allclose(ent, -(renormalised * renormalised.log()).sum().expand(5), atol=1e-6)
    lp.sum().backward()
    assert logits.grad[0, 4] == 0 and logits.grad[4, 3] == 0 and logits.grad[0, 3] != 0 and logits.grad[4, 4] != 0


def test_min_p_follows_each_backend():
    """min_p on p = [0.5, 0.25, 0.125, 0.0625, 0.0625]. Alone (min_p 0.25: threshold 0.125, kept when >=) both
    backends keep {0, 1, 2}. With top_k 2 and top_p 0.6: flashinfer's min_p order (0.5.23 layers/sampler.py
    Sampler._sample_from_probs: top_k_renorm_prob, top_p_renorm_prob, min_p_sampling_from_probs; flashinfer 0.7.2
    sampling.cuh TopPRenormProbKernel) measures top_p within the top-k set, [2/3, 1/3], so token 1 (2/3 above it)
    goes even at min_p 0.01; the joint rule (no min_p) and the pytorch backend (top_k_top_p_min_p_sampling_from_
    probs_torch: top_p on the whole distribution, 0.5 above token 1) keep {0, 1}."""
    p, targets = torch.softmax(ROW, -1)[None], torch.zeros(1, dtype=torch.long)
    for top_k, top_p, min_p, fi, pt in ((-1, 1.0, 0.25, {0, 1, 2}, {0, 1, 2}), (2, 0.6, 0.01, {0}, {0, 1}),
                                        (2, 0.6, 0.0, {0, 1}, {0, 1}), (-1, 0.8, 0.3, {0, 1}, {0, 1})):
        assert sets(flashinfer_min_p(p, top_k, top_p, min_p) if min_p else flashinfer_joint(p, top_k, top_p)) == [fi]
        assert sets(pytorch_backend(p, top_k, top_p, min_p, targets)) == [pt]
        assert sets(kept(ROW[None], targets, logprobs.Support(top_k, top_p, min_p))) == [fi], (top_k, top_p, min_p)
        assert sets(kept(ROW[None], targets, logprobs.Support(top_k, top_p, min_p, "pytorch"))) == [pt]
        assert sets(stand_in(ROW[None], [{"top_k": top_k, "top_p": top_p, "min_p": min_p}])) == [fi]
    assert logprobs.Support(min_p=0.1).truncates() and not logprobs.Support(backend="pytorch").truncates()


def test_a_min_p_request_changes_the_support_of_its_batch_mates():
    """On flashinfer one request with min_p > 0 puts the whole batch on the min_p order (0.5.23
    sampling/sampling_batch_info.py: need_min_p_sampling = any(min_p > 0), read once per batch by
    layers/sampler.py Sampler._sample_from_probs): a top_k 2 / top_p 0.6 request keeps {0, 1} alone and {0} beside a
    min_p request. The stand-in does the same; the trainer's Support assumes its own min_p decides (docs/sglang.md)."""
    rows = ROW.expand(2, 5)
    alone = stand_in(rows, [{"top_k": 2, "top_p": 0.6}, {"top_k": 2, "top_p": 0.6}])
    shared = stand_in(rows, [{"top_k": 2, "top_p": 0.6}, {"min_p": 0.01}])
    assert sets(alone) == [{0, 1}, {0, 1}] and sets(shared) == [{0}, {0, 1, 2, 3, 4}]


# ---------------------------------------------------------------------------------------------------------------
# Random rows with many ties, every rule

SETTINGS = [(-1, 0.9, 0.0), (5, 1.0, 0.0), (8, 0.8, 0.0), (-1, 0.5, 0.0), (-1, 1.0, 0.1), (6, 0.7, 0.05),
            (12, 0.95, 0.02)]


@pytest.mark.parametrize("backend", ["flashinfer", "pytorch"])
def test_random_rows_with_ties_equal_the_literal_ports(backend):
    """400 rows of 48 logits in steps of 0.5 (ties at most cuts) under each of 7 settings, 2,800 per backend and
    5,600 in all: Support's set equals the literal port of the backend's source (flashinfer_joint, flashinfer_min_p,
    pytorch_backend above) plus the sampled token, at every row; for flashinfer the stand-in's sampler keeps the
    same set (a batch of rows with one setting, so min_p > 0 switches all of it, as in 0.5.23)."""
    g = torch.Generator().manual_seed(0)
    for top_k, top_p, min_p in SETTINGS:
        x = (torch.randn(400, 48, generator=g) * 2).mul(2).round().div(2)
        targets = torch.randint(0, 48, (400,), generator=g)
        p = torch.softmax(x, -1)
        if backend == "pytorch":
            want = pytorch_backend(p, top_k, top_p, min_p, targets)
        else:
            want = flashinfer_min_p(p, top_k, top_p, min_p) if min_p else flashinfer_joint(p, top_k, top_p)
            assert torch.equal(stand_in(x, [{"top_k": top_k, "top_p": top_p, "min_p": min_p}] * 400), want)
        want[torch.arange(400), targets] = True
        got = kept(x, targets, logprobs.Support(top_k, top_p, min_p, backend))
        assert torch.equal(got, want), (top_k, top_p, min_p)
        assert (want.sum(-1) < 48).all() and (want.sum(-1) > 1).any()  # the sets truncate


def test_the_kernels_match_the_kept_set_with_ties_values_and_gradients():
    """token_logprobs (bf16 logits, as a forward gives them) and linear_token_logprobs under each backend's rule with
    tied logits (0.5 steps): log-probs, entropy, log-mass and the logits' gradient equal log_softmax over the kept set
    (autograd, the set held fixed), chunked at 3 tokens; tokens outside the set get no gradient."""
    g = torch.Generator().manual_seed(1)
    logits = ((torch.randn(2, 9, 40, generator=g) * 4).round() / 2).to(torch.bfloat16)
    targets = torch.randint(0, 40, (2, 9), generator=g)
    for support in (logprobs.Support(6, 0.8), logprobs.Support(6, 0.8, 0.05), logprobs.Support(-1, 0.7, 0, "pytorch"),
                    logprobs.Support(10, 0.9, 0.02, "pytorch")):
        mask = kept(logits.float().reshape(-1, 40), targets.reshape(-1), support).view(2, 9, 40)
        ref_in = logits.detach().float().requires_grad_()
        inside = ref_in.masked_fill(~mask, float("-inf"))
        ref_all = torch.log_softmax(inside, -1)
        ref_lp = ref_all.gather(-1, targets[..., None])[..., 0]
        inside_lp = torch.where(mask, ref_all, 0.0)  # no -inf in the product (0 * -inf: a NaN gradient)
        ref_h = -(torch.where(mask, inside_lp.exp(), 0.0) * inside_lp).sum(-1)
        (ref_lp.sum() + ref_h.sum()).backward()
        live = logits.detach().clone().requires_grad_()
        lp, h, mass = logprobs.token_logprobs(live, targets, 1.0, 3, True, support)
        (lp.sum() + h.sum()).backward()
        assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(h, ref_h, atol=1e-5)
        assert torch.allclose(mass, torch.logsumexp(inside, -1) - torch.logsumexp(ref_in, -1), atol=1e-5)
        assert torch.allclose(live.grad.float(), ref_in.grad, atol=1e-2) and torch.all(live.grad[~mask] == 0)
        hidden = logits.detach().float().clone().requires_grad_()  # the fused path: weight = I, logits = hidden
        lpf, hf, massf = logprobs.linear_token_logprobs(hidden, torch.eye(40), targets, 1.0, 3, True, support)
        (lpf.sum() + hf.sum()).backward()
        assert torch.allclose(lpf, ref_lp, atol=1e-5) and torch.allclose(hf, ref_h, atol=1e-5)
        assert torch.allclose(massf, mass) and torch.allclose(hidden.grad, ref_in.grad, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Which backend, and min_p reaching the servers

def test_the_backend_follows_the_servers_launch_flags():
    """logprobs.sampling_backend as 0.5.23 resolves --sampling-backend (arg_groups/overrides.py:
    _sampling_backend_default, _deterministic_sampling_backend; attention_hook.py handle_deterministic_inference for
    --rl-on-policy-target): flashinfer by default, pytorch when the flags say so or force it; an explicit setting the
    flags contradict, an unknown setting or a backend without a replay are refused naming the setting."""
    sb = logprobs.sampling_backend
    assert sb("auto", []) == "flashinfer" and sb("pytorch", []) == "pytorch" and sb("flashinfer", []) == "flashinfer"
    assert sb("auto", ["--sampling-backend", "pytorch"]) == "pytorch" == sb("auto", ["--sampling-backend=pytorch"])
    assert sb("auto", ["--context-length", "4096", "--enable-deterministic-inference"]) == "pytorch"
    assert sb("auto", ["--sampling-backend", "flashinfer", "--rl-on-policy-target", "fsdp"]) == "pytorch"
    assert sb("pytorch", ["--sampling-backend", "pytorch"]) == "pytorch"
    with pytest.raises(ValueError, match="rollout.sampling.backend is flashinfer but .*--enable-deterministic"):
        sb("flashinfer", ["--enable-deterministic-inference"])
    with pytest.raises(ValueError, match="selects --sampling-backend ascend"):
        sb("auto", ["--sampling-backend", "ascend"])
    with pytest.raises(ValueError, match="rollout.sampling.backend must be auto, flashinfer or pytorch"):
        config.load_config(None, ["rollout.sampling.backend=triton"])
    with pytest.raises(ValueError, match=r"rollout.sampling.min_p must be in \[0, 1\], got 1.5"):
        config.load_config(None, ["rollout.sampling.min_p=1.5"])
    with pytest.raises(ValueError, match="Support backend must be one of flashinfer, pytorch"):
        logprobs.Support(backend="auto")


def test_min_p_is_sent_with_every_request():
    """rollout.sampling.min_p goes into the sampling params the rollout sends (as SGLang's `min_p`, 0 by default)."""
    tok = tiny_model.build_tokenizer()
    for overrides, want in (([], 0.0), (["rollout.sampling.min_p=0.05"], 0.05)):
        cfg = config.load_config(None, ["rollout.servers=[http://127.0.0.1:9]", *overrides])
        sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
        try:
            assert rollout.Rollout(cfg, None, sync, tok).sampling_params["min_p"] == want
        finally:
            sync.close()
