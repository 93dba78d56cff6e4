"""bench/sampling_support.py: what top_p / top_k sampling does to the ratio pi / mu when the trainer's log-probs are
the whole vocabulary's, and what is left of it once the trainer replays the sampler's support (logprobs.Support).

standins/engine.py serves --model (SGLang 0.5.23's convention: the reported log-prob of a sampled token is the whole
vocabulary's, log_softmax(logits / T), whatever top_p / top_k keep). Chat prompts (sums and one-sentence requests)
are sampled at --temperature / --top-p / --top-k, each with a sampling_seed, with return_logprob and
top_logprobs_num --top (the engine's own whole-vocabulary log-probs of its --top most likely tokens at every
position). From those the sampler's kept set is found by the rule of the engine's sampler, flashinfer's (0.5.23's
default on CUDA; docs/sglang.md), in plain Python: a token is kept when fewer than top_k tokens are more likely and
their mass is < top_p, tied tokens together; so mu, the probability the token was drawn with, is the engine's:
log mu = reported - log(kept mass). The trainer's log-probs of the same tokens come from
model.token_logprobs (the trainer's path: the lm_head fused into the chunked log-softmax), float32, without and
with the support; --weight-noise gives the trainer other weights than the engine's, as staleness does.

Figures, over every sampled token:
  (1) the probability mass outside the set the sampler could draw from, 1 - kept mass (the engine's)
  (2) log pi - log mu of the sampled token: before, pi is the whole vocabulary's (log pi - log mu = log kept mass
      < 0, the same sign on every token); after, pi is renormalised over the support the trainer replays from its
      own logits; and tokens the sampler drew that the trainer's replay puts outside the support (kept anyway)
  (3) what the losses see: old - rollout log-prob, before (both the whole vocabulary's: ~0, it shows nothing) and
      after (old over the support, rollout renormalised by the trainer's log-mass, train.py: ~0 again)
  (4) the trainer's log kept mass minus the engine's: the error the renormalisation of mu leaves in pi_old / mu

Run (after `python -m models.smollm2 --out runs/smollm2`; ~1 min on 2 cores):
    .venv/bin/python bench/sampling_support.py --model runs/smollm2 [--top-p 0.9] [--top-k -1] [--temperature 1]
        [--prompts 16] [--max-new-tokens 32] [--top 4096] [--weight-noise 0]
"""
import argparse
import math
import os
import statistics
import sys
import time

import requests
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import batching  # noqa: E402
import logprobs  # noqa: E402
import model as model_lib  # noqa: E402
from standins import engine  # noqa: E402

QUESTIONS = [f"What is {a} + {b}? Answer with the number only." for a, b in
             ((17, 25), (3, 9), (12, 30), (8, 8), (21, 14), (5, 27), (19, 2), (11, 16))] + [
    f"Write one sentence about {x}." for x in
    ("the sea", "a cat", "winter", "a train", "coffee", "the moon", "a library", "rain")]


def kept_mass(top: list, top_p: float, top_k: int) -> tuple:
    """The engine's top log-probs at one position [[lp, id, text], ...], most likely first -> (log of the mass the
    sampler keeps, its size, whether the list ran out before the rule stopped). A run of ties is tested at its first
    token: count and mass of the more likely ones (flashinfer's count(p > p_j) < top_k and mass(p > p_j) < top_p)."""
    mass, n, above, more = 0.0, 0, 0.0, 0
    for rank, (lp, _, _) in enumerate(top):
        if rank and lp != top[rank - 1][0]:
            above, more = mass, rank
        if (top_k > 0 and more >= top_k) or (top_p < 1 and above >= top_p):
            return math.log(mass), n, False
        mass, n = mass + math.exp(lp), n + 1
    return math.log(mass), n, True


def summary(values: list) -> str:
    v = sorted(values)
    return (f"mean {statistics.fmean(v):+.2e}, mean |x| {statistics.fmean(map(abs, v)):.2e}, median "
            f"{v[len(v) // 2]:+.2e}, min {v[0]:+.2e}, max {v[-1]:+.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runs/smollm2")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=4096, help="top_logprobs_num: must cover the kept set")
    ap.add_argument("--weight-noise", type=float, default=0.0,
                    help="the trainer's weights times 1 + this x N(0, 1): other weights than the engine's (staleness)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"] for q in questions]
    sp = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
          "max_new_tokens": args.max_new_tokens}
    url, handle = engine.launch(args.model, num_threads=2)
    try:
        outs = [requests.post(url + "/generate", timeout=600, json={
            "input_ids": p, "return_logprob": True, "top_logprobs_num": args.top,
            "sampling_params": {**sp, "sampling_seed": i}}).json() for i, p in enumerate(prompts)]
    finally:
        handle.stop()
    seqs, engine_mass, sizes, ran_out = [], [], [], 0
    for p, o in zip(prompts, outs):
        m = o["meta_info"]
        rows = [kept_mass(top, args.top_p, args.top_k) for top in m["output_top_logprobs"]]
        ran_out += sum(r[2] for r in rows)
        engine_mass.append([r[0] for r in rows])
        sizes += [r[1] for r in rows]
        seqs.append({"prompt": p, "response": o["output_ids"], "mask": [1] * len(o["output_ids"]),
                     "rollout_lp": [lp for lp, _, _ in m["output_token_logprobs"]],
                     "versions": [0] * len(o["output_ids"]), "adv": 0.0})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if args.weight_noise:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for w in model.parameters():
                w.mul_(1 + args.weight_noise * torch.randn(w.shape, generator=g))
    support = logprobs.Support(top_k=args.top_k, top_p=args.top_p)
    mass_outside, before, after, flips, seen_before, seen_after, mass_gap = [], [], [], 0, [], [], []
    seconds = [0.0, 0.0]  # logprobs.token_logprobs on the response logits: whole vocabulary, with the support
    with torch.no_grad():
        for s, e_mass in zip(seqs, engine_mass):
            b = batching.collate([s])
            n = len(s["response"])
            pos = b["mask"][0].nonzero()[:, 0]  # the response tokens' positions in the loss layout
            full, _ = model_lib.token_logprobs(model, b, args.temperature, 1024)
            trunc, _, t_mass = model_lib.token_logprobs(model, b, args.temperature, 1024, support=support)
            full, trunc, t_mass = full[0, pos].tolist(), trunc[0, pos].tolist(), t_mass[0, pos].tolist()
            # sampled tokens that the trainer's own logits put outside the support (the kernels keep them in)
            ids = torch.tensor([s["prompt"] + s["response"]])
            scaled = model(ids).logits[0, len(s["prompt"]) - 1:-1].float() / args.temperature
            ranked = scaled.sort(-1, descending=True).values
            p = ranked.softmax(-1)
            kept = ((p.cumsum(-1) - p) < args.top_p).sum(-1) if args.top_p < 1 else torch.full(p.shape[:1], p.shape[1])
            if args.top_k > 0:
                kept = kept.clamp(max=args.top_k)
            targets = torch.tensor(s["response"])
            drawn = scaled.gather(-1, targets[:, None])[:, 0]
            for k, extra in enumerate(({}, {"support": support})):  # the kernel alone, on these logits
                t0 = time.perf_counter()
                logprobs.token_logprobs(scaled, targets, 1.0, **extra)
                seconds[k] += time.perf_counter() - t0
            flips += int((drawn < ranked.gather(-1, kept[:, None] - 1)[:, 0]).sum())
            for i in range(n):
                reported, e_lm = s["rollout_lp"][i], e_mass[i]
                mu = reported - e_lm  # log of the probability the engine drew the token with
                mass_outside.append(1 - math.exp(e_lm))
                before.append(full[i] - mu)
                after.append(trunc[i] - mu)
                seen_before.append(full[i] - reported)
                seen_after.append(trunc[i] - (reported - t_mass[i]))
                mass_gap.append(t_mass[i] - e_lm)
    n = len(before)
    print(f"model {args.model}; temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}; {len(seqs)} "
          f"prompts, {n} sampled tokens; kept-set size median {sorted(sizes)[len(sizes) // 2]}, max {max(sizes)} "
          f"(positions whose kept set ran past top_logprobs_num {args.top}: {ran_out})")
    print(f"(1) mass outside the sampler's kept set (the engine's):  {summary(mass_outside)}")
    print(f"(2) log pi - log mu of the sampled token, before (pi over the whole vocabulary):  {summary(before)}")
    print(f"    pi / mu before: mean {statistics.fmean(math.exp(x) for x in before):.4f}, "
          f"min {math.exp(min(before)):.4f}")
    print(f"    after (pi renormalised over the support the trainer replays):  {summary(after)}")
    print(f"    sampled tokens outside the support the trainer replays from its own logits: {flips} of {n}")
    print(f"(3) old - rollout log-prob as the losses see it, before:  {summary(seen_before)}")
    print(f"    after (rollout renormalised by the trainer's log-mass):  {summary(seen_after)}")
    print(f"(4) log kept mass, the trainer's replay minus the engine's (what (3) after misses of (2) after):  "
          f"{summary(mass_gap)}; |x| above 1e-4 at "
          f"{sum(abs(x) > 1e-4 for x in mass_gap)} positions")
    print(f"logprobs.token_logprobs alone on these {n} positions' logits: {seconds[0]:.3f} s over the whole "
          f"vocabulary, {seconds[1]:.3f} s with the support")


if __name__ == "__main__":
    main()
