"""Packed micro-batches (trainer.packing): the attention keeps packed sequences apart given position_ids alone, and
the packed log-probs, losses and gradients equal the padded ones (float32, CPU, 1e-5).

Run: .venv/bin/python -m pytest -q tests/test_packing.py
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import config  # noqa: E402
import logprobs  # noqa: E402
import losses  # noqa: E402
from standins import tiny_model  # noqa: E402
import batching  # noqa: E402
import model as model_lib  # noqa: E402


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return tiny_model.make_tiny_model(str(tmp_path_factory.mktemp("packing") / "tiny"))


def _model(path, impl):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl)
    with torch.no_grad():  # random norm gains: a fresh tiny model's attention would be near uniform
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape))
    return model


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(lengths):
        out.append({"prompt": torch.randint(3, 90, (p,), generator=g).tolist(),
                    "response": torch.randint(3, 90, (r,), generator=g).tolist(),
                    "mask": (torch.rand(r, generator=g) > 0.2).long().tolist(),
                    "rollout_lp": (-torch.rand(r, generator=g) * 3).tolist(), "versions": [0] * r,
                    "adv": float(torch.randn((), generator=g))})
    return out


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex_attention"])
def test_packed_position_ids_keep_sequences_apart(tiny_path, impl):
    """Each CPU attention path of the installed transformers masks across packed sequences from position_ids
    (with no attention mask and no cache); the control shows the mask comes from them."""
    model = _model(tiny_path, impl).eval()
    a, b = torch.randint(3, 90, (1, 9)), torch.randint(3, 90, (1, 6))
    ids = torch.cat([a, b], 1)
    with torch.no_grad():
        alone = [model(input_ids=x, use_cache=False).logits[0] for x in (a, b)]
        pos = torch.cat([torch.arange(9), torch.arange(6)])[None]
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        run_on = model(input_ids=ids, position_ids=torch.arange(15)[None], use_cache=False).logits[0]
    assert (packed[:9] - alone[0]).abs().max() < 1e-5 and (packed[9:] - alone[1]).abs().max() < 1e-5
    assert (run_on[9:] - alone[1]).abs().max() > 1e-2  # one sequence: b attends to a


@pytest.mark.parametrize("agg,level", [("token-mean", "token"), ("seq-mean-token-mean", "sequence")])
def test_packed_log_probs_losses_and_gradients_equal_padded(tiny_path, agg, level):
    cfg = config.load_config(None, [f"algorithm.loss_agg_mode={agg}", "algorithm.is_correction.enable=true",
                                    f"algorithm.is_correction.level={level}"])
    seqs = _seqs([(5, 9), (3, 2), (7, 14), (4, 1), (6, 6)])
    results = {}
    for packing in (False, True):
        model = _model(tiny_path, "sdpa")
        b = batching.collate(seqs, packing=packing)
        logp, ent = model_lib.token_logprobs(model, b, 1.0, 16, with_entropy=True)  # chunks smaller than a row
        denom = losses.loss_denominator(b["mask"], agg)
        old = logp.detach() + 0.05 * torch.linspace(-1, 1, logp.numel()).view_as(logp)  # ratios away from 1
        loss, _ = losses.ppo(losses.TokenBatch(logp, old, b["rollout_lp"], b["adv"], b["mask"], entropy=ent),
                             cfg.algorithm, denom)
        loss.backward()
        results[packing] = (logp.detach() * b["mask"], ent.detach() * b["mask"], loss.detach(),
                            {n: p.grad.clone() for n, p in model.named_parameters()})
        if packing:  # one row, no padding: n = the sequences' tokens
            assert b["ids"].shape == (1, sum(p + r for p, r in [(5, 9), (3, 2), (7, 14), (4, 1), (6, 6)]))
            assert b["pos"][0, :14].tolist() == list(range(14)) and b["pos"][0, 14:19].tolist() == list(range(5))
            # flash-attention's varlen boundaries, made once here rather than in every layer
            assert b["cu"].tolist() == [0, 14, 19, 40, 45, 57] and b["cu"].dtype == torch.int32 and b["max_len"] == 21
    (lp0, e0, l0, g0), (lp1, e1, l1, g1) = results[False], results[True]
    assert (lp0 - lp1).abs().max() < 1e-5 and (e0 - e1).abs().max() < 1e-5
    assert abs(float(l0 - l1)) < 1e-5 and float(l0.abs()) > 1e-3
    for n in g0:
        assert (g0[n] - g1[n]).abs().max() < 1e-5, n
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-3


def test_fused_lm_head_log_probs_entropy_and_gradients_equal_the_logits_path(tiny_path):
    """model_lib.token_logprobs swaps the model's lm_head for logprobs.linear_token_logprobs inside model(...):
    log-probs, entropy and every parameter's gradient (the lm_head / tied embedding included) equal those of the
    model's own logits through logprobs.token_logprobs, within 1e-5 in float32; the model's lm_head is itself again
    after."""
    seqs = _seqs([(5, 9), (3, 2), (7, 14)])
    b = batching.collate(seqs, packing=False)
    results = []
    for fused in (True, False):
        model = _model(tiny_path, "sdpa")
        if fused:
            logp, ent = model_lib.token_logprobs(model, b, 0.7, 5, with_entropy=True)
            assert "forward" not in vars(model.get_output_embeddings())
        else:
            logits = model(input_ids=b["ids"], attention_mask=b["attn"], use_cache=False).logits[:, :-1]
            logp, ent = logprobs.token_logprobs(logits, b["ids"][:, 1:], 0.7, 5, with_entropy=True)
        ((logp * b["mask"]).sum() + 0.3 * (ent * b["mask"]).sum()).backward()
        results.append((logp.detach() * b["mask"], ent.detach() * b["mask"],
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, e0, g0), (lp1, e1, g1) = results
    assert (lp0 - lp1).abs().max() < 1e-5 and (e0 - e1).abs().max() < 1e-5
    assert g0.keys() == g1.keys() and any("lm_head" in n or "embed_tokens" in n for n in g0)
    for n in g0:
        assert (g0[n] - g1[n]).abs().max() < 1e-5, n
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-3


def test_a_support_gives_the_same_log_probs_mass_and_gradients_padded_packed_and_from_the_logits(tiny_path):
    """rollout.sampling.top_k / top_p (logprobs.Support) through model_lib.token_logprobs, padded and packed (the
    fused lm_head), against the model's own logits through logprobs.token_logprobs: the renormalised log-probs, the
    entropy, the log of the support's mass and every parameter's gradient agree within 1e-5 in float32 (relative,
    for gradients up to ~40)."""
    seqs = _seqs([(5, 9), (3, 2), (7, 14)])
    support = logprobs.Support(top_k=20, top_p=0.8)
    results = []
    for way in ("logits", "padded", "packed"):
        model = _model(tiny_path, "sdpa")
        b = batching.collate(seqs, packing=way == "packed")
        if way == "logits":
            logits = model(input_ids=b["ids"], attention_mask=b["attn"], use_cache=False).logits[:, :-1]
            logp, ent, mass = logprobs.token_logprobs(logits, b["ids"][:, 1:], 0.7, 5, True, support)
        else:
            logp, ent, mass = model_lib.token_logprobs(model, b, 0.7, 5, True, support)
        ((logp * b["mask"]).sum() + 0.3 * (ent * b["mask"]).sum()).backward()
        results.append([t.detach() * b["mask"] for t in (logp, ent, mass)]
                       + [{n: p.grad.clone() for n, p in model.named_parameters()}])
    (*ref, ref_grads), *others = results
    assert ref[2].min() < -1e-2  # the support truncates
    for *values, grads in others:
        assert all((a - b).abs().max() < 1e-5 for a, b in zip(values, ref))
        assert all(torch.allclose(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5) for n in ref_grads)


def test_packed_micro_batches_hold_at_most_the_token_budget():
    seqs = _seqs([(4, n) for n in (30, 2, 2, 2, 10, 9, 8, 7, 25, 3)])
    packed = batching.plan_micro_batches(seqs, 40, packing=True)
    padded = batching.plan_micro_batches(seqs, 40)
    assert sorted(id(s) for mb in packed for s in mb) == sorted(id(s) for s in seqs)
    assert all(sum(batching._length(s) for s in mb) <= 40 for mb in packed)
    # first-fit decreasing: 134 tokens in 4 micro-batches (34+5|29+6+5|14+13+12+6|11+...) vs padded's
    assert len(packed) == -(-sum(batching._length(s) for s in seqs) // 40) < len(padded)
    long = batching.plan_micro_batches(_seqs([(4, 50), (4, 3)]), 40, packing=True)  # too long for the budget: alone
    assert [len(mb) for mb in long] == [1, 1]


@pytest.mark.parametrize("packing", [False, True])
def test_routes_stay_in_their_dtype_with_a_mask_of_the_positions_the_server_ran(packing):
    """Routing replay's routes are collated in the trajectories' dtype (uint8: a quarter of int32's bytes through
    the scatter and on the device; moe.py widens one layer's ids at a time in the forward), with `routed` marking the
    positions that have them: a trajectory's routed prefix (an aborted item's tail may have none yet), none for
    padding or a trajectory without routes."""
    def seq(P, T, R):
        s = {"prompt": list(range(1, P + 1)), "response": [7] * T, "mask": [1] * T, "rollout_lp": [0.0] * T,
             "versions": [0] * T, "adv": 0.0}
        if R is not None:
            s["routes"] = torch.arange(R * 3 * 2).view(R, 3, 2).to(torch.uint8)
        return s
    seqs = [seq(3, 4, 6), seq(2, 2, 2), seq(4, 1, None)]  # full (P + T - 1), short of 1 position, none
    b = batching.collate(seqs, packing=packing)
    assert b["routes"].dtype == torch.uint8 and b["routed"].dtype == torch.bool
    lengths = [3 + 4, 2 + 2, 4 + 1]
    known = [6, 2, 0]
    if packing:
        assert b["routes"].shape == (1, sum(lengths), 3, 2)
        want = torch.cat([torch.arange(n) < k for n, k in zip(lengths, known)])[None]
        assert torch.equal(b["routed"], want)
        assert torch.equal(b["routes"][0, :6], seqs[0]["routes"])
        assert torch.equal(b["routes"][0, 7:9], seqs[1]["routes"])
        padded = model_lib.pad_packed(b, 32)  # flex_attention's padding sequence: no routes, the dtype kept
        assert padded["routes"].shape == (1, 32, 3, 2) and padded["routes"].dtype == torch.uint8
        assert torch.equal(padded["routes"][:, :16], b["routes"]) and not padded["routes"][:, 16:].any()
        assert torch.equal(padded["routed"][:, :16], b["routed"]) and not padded["routed"][:, 16:].any()
    else:
        assert b["routes"].shape == (3, 7, 3, 2)
        assert b["routed"].sum(1).tolist() == known
        assert torch.equal(b["routes"][1, :2], seqs[1]["routes"]) and not b["routes"][2].any()


def test_entropy_is_computed_only_for_the_metric_and_changes_no_gradient(tiny_path):
    """trainer.entropy_metric: no loss term uses the entropy, so the training forward computes it only for
    train/entropy; without it the metric is absent and the loss, every gradient and the other metrics are the same."""
    import actor as actor_lib

    b = batching.collate(_seqs([(5, 9), (3, 2), (7, 14)]), packing=True)
    runs = []
    for on in (True, False):
        actor = object.__new__(actor_lib.Actor)
        actor.cfg = config.load_config(None, ["trainer.use_rollout_log_probs=true", f"trainer.entropy_metric={on}"])
        actor.model, actor.world = _model(tiny_path, "sdpa"), 1
        sums, weights, _ = actor.forward_backward([b], 0, float(b["mask"].sum())).state()
        runs.append((sums, {n: p.grad.clone() for n, p in actor.model.named_parameters()}))
    (s1, g1), (s0, g0) = runs
    assert s1["train/entropy"] > 0 and "train/entropy" not in s0
    assert {k: v for k, v in s1.items() if k != "train/entropy"} == pytest.approx(s0, abs=1e-6)
    assert all(torch.allclose(g1[n], g0[n], atol=1e-6) for n in g1) and any(g.abs().max() > 0 for g in g1.values())


def test_top_p_renormalises_mu_over_the_support_the_trainer_replays(tiny_path):
    """actor.Actor.forward_backward with rollout.sampling.top_p=0.8, top_k=20 (the in-process actor of the test
    above, trainer.use_rollout_log_probs=true): rollout_lp is what an engine on these weights reports, the whole
    vocabulary's log-probs. Renormalised by the support's mass the trainer finds, pi_old = mu equals pi_theta over
    the support: the ratio is 1 (approx_kl 0, nothing clipped), where the whole vocabulary's mu would put it at
    1 / mass (up to 1 / 0.8 here) for every token; train/sampling_mass_outside is the mass outside."""
    import actor as actor_lib

    b = batching.collate(_seqs([(5, 9), (3, 2), (7, 14)]), packing=True)
    actor = object.__new__(actor_lib.Actor)
    actor.cfg = config.load_config(None, ["trainer.use_rollout_log_probs=true", "rollout.sampling.top_p=0.8",
                                          "rollout.sampling.top_k=20", "rollout.sampling.temperature=0.7"])
    actor.model, actor.world = _model(tiny_path, "sdpa"), 1
    with torch.no_grad():
        full, _ = model_lib.token_logprobs(actor.model, b, 0.7, 1024)
        _, _, mass = model_lib.token_logprobs(actor.model, b, 0.7, 1024, support=logprobs.Support(20, 0.8))
    b["rollout_lp"] = full * b["mask"]
    sums, weights, _ = actor.forward_backward([b], 0, float(b["mask"].sum())).state()
    met = {k: sums[k] / weights[k] for k in sums}
    assert abs(met["train/approx_kl"]) < 1e-6 and met["train/clip_ratio"] == 0.0
    outside = float(((1 - mass.exp()) * b["mask"]).sum() / b["mask"].sum())
    assert outside > 0.02 and met["train/sampling_mass_outside"] == pytest.approx(outside, abs=1e-6)


def test_a_short_packed_row_is_padded_for_flex_attention_with_the_same_log_probs(tiny_path, monkeypatch):
    """flex_attention's compiled training forward failed on an H200 for a 110-token packed row (docs/gpu.md):
    token_logprobs pads a packed row under flex_attention (only) with model.pad_packed, a padding sequence up to
    FLEX_MIN_TOKENS outside the loss index, which leaves the log-probs as they were."""
    seqs = _seqs([(5, 9), (3, 2), (4, 1)])
    b = batching.collate(seqs, packing=True)
    padded = model_lib.pad_packed(b, model_lib.FLEX_MIN_TOKENS)
    n = b["ids"].shape[1]
    assert n == 24 and padded["ids"].shape == (1, model_lib.FLEX_MIN_TOKENS)
    assert padded["pos"][0, n:].tolist() == list(range(model_lib.FLEX_MIN_TOKENS - n))  # its own sequence
    assert padded["cu"].tolist() == b["cu"].tolist() + [model_lib.FLEX_MIN_TOKENS]
    assert model_lib.pad_packed(padded, model_lib.FLEX_MIN_TOKENS) is padded  # long enough: unchanged
    model = _model(tiny_path, "sdpa")
    with torch.no_grad():
        ref, _ = model_lib.token_logprobs(model, b, 1.0, 16)
        out, _ = model_lib.token_logprobs(model, padded, 1.0, 16)
    assert out.shape == ref.shape == b["mask"].shape
    assert ((out - ref) * b["mask"]).abs().max() < 1e-5 and float((ref * b["mask"]).abs().max()) > 1e-2

    class Padded(Exception):
        pass

    def spy(b_, k):
        raise Padded(b_["ids"].shape[1], k)

    monkeypatch.setattr(model_lib, "pad_packed", spy)  # which attention pads (without compiling flex on CPU)
    with torch.no_grad():
        model_lib.token_logprobs(model, b, 1.0, 16)  # sdpa: not padded
        model.config._attn_implementation = "flex_attention"
        with pytest.raises(Padded) as e:
            model_lib.token_logprobs(model, b, 1.0, 16)
    assert e.value.args == (24, model_lib.FLEX_MIN_TOKENS)
