"""bench/packing_bench.py: padded vs packed micro-batches (trainer.packing) on the spec workload's lengths.

Part 1, tokens: one training call of the workload model in docs/results/pipeline_sim.md (M = 128 trajectories,
prompts of ~200 tokens, response lengths from its long-tailed model: per group median exp(Normal(ln 3500, 0.6)), per
trajectory exp(Normal(ln median, 0.45)) clamped to [16, 20480]), split over --ranks data-parallel ranks as train.py
does, then planned into micro-batches of trainer.micro_batch_tokens by batching.plan_micro_batches. Printed per budget:
computed tokens / real tokens (padded: rows x longest row per micro-batch, plus the placeholder micro-batches a rank
runs so every rank does the same number of forwards; packed: the real tokens, plus the placeholders' one token) and
the number of forwards per rank. A model of the workload, not a measurement of it.

Part 2, CPU time: the same length distribution scaled down by --scale (so a step runs in seconds here), one
forward + backward of one training call on a random Qwen3 (--hidden, --layers) with model.token_logprobs and
losses.ppo, padded vs packed, median of --repeats, per budget / --scale. CPU sdpa has no varlen kernel:
a packed row attends over its whole length under a block-diagonal mask (n^2 per row instead of sum of L_i^2), so
on CPU packing saves the padding's linear-layer work but pays more attention; on GPU flash_attention_2 runs varlen
(cu_seqlens from the position_ids) and pays neither. The machine is shared and loaded: read the ratios.

Run: python bench/packing_bench.py [--ranks 8] [--budgets 16384,32768,65536] [--scale 256] [--repeats 3]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import config as config_lib  # noqa: E402
import losses  # noqa: E402
from standins import tiny_model  # noqa: E402
import batching  # noqa: E402
import model as model_lib  # noqa: E402


def spec_lengths(rng: random.Random, groups: int = 16, n: int = 8, prompt: int = 200) -> list[tuple[int, int]]:
    """(prompt, response) lengths of M = groups x n trajectories of the spec workload."""
    out = []
    for _ in range(groups):
        median = math.exp(rng.gauss(math.log(3500), 0.6))
        out += [(prompt, int(min(20480, max(16, math.exp(rng.gauss(math.log(median), 0.45)))))) for _ in range(n)]
    return out


def fake_seqs(lengths: list, vocab: int, rng: random.Random) -> list[dict]:
    return [{"prompt": [rng.randrange(3, vocab) for _ in range(p)], "response": [rng.randrange(3, vocab)
                                                                                   for _ in range(r)],
             "mask": [1] * r, "rollout_lp": [-1.0] * r, "versions": [0] * r, "adv": rng.gauss(0, 1)}
            for p, r in lengths]


def token_ratio(lengths: list, ranks: int, budget: int, packing: bool) -> tuple[float, int]:
    """(computed / real tokens of the call, forwards per rank)."""
    seqs = [{"prompt": [0] * p, "response": [0] * r} for p, r in lengths]
    plans = [batching.plan_micro_batches(share, budget, packing) for share in batching.split_balanced(seqs, ranks)]
    n = max(len(p) for p in plans)
    real = sum(p + r for p, r in lengths)
    computed = sum(sum(batching._length(s) for s in mb) if packing else len(mb) * max(batching._length(s) for s in mb)
                   for p in plans for mb in p) + sum(n - len(p) for p in plans)  # placeholders: one token each
    return computed / real, n


def time_call(model, seqs: list, budget: int, packing: bool, algo) -> float:
    mbs = [batching.collate(mb, packing=packing) for mb in batching.plan_micro_batches(seqs, budget, packing)]
    denom = sum(losses.loss_denominator(b["mask"], algo.loss_agg_mode) for b in mbs)
    t0 = time.perf_counter()
    for b in mbs:
        logp, _ = model_lib.token_logprobs(model, b, 1.0, 1024)
        loss, _ = losses.ppo(losses.TokenBatch(logp, logp.detach(), b["rollout_lp"], b["adv"], b["mask"]), algo, denom)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--budgets", default="16384,32768,65536", help="trainer.micro_batch_tokens values")
    p.add_argument("--scale", type=int, default=256, help="part 2: lengths divided by this")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (more than the free cores spin-wait)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rng = random.Random(a.seed)
    lengths = spec_lengths(rng)
    real = sum(p + r for p, r in lengths)
    print(f"part 1 (a model of the workload): one call of {len(lengths)} trajectories, {real} real tokens, mean "
          f"response {sum(r for _, r in lengths) / len(lengths):.0f}, longest {max(r for _, r in lengths)}; "
          f"{a.ranks} ranks")
    print(f"{'micro_batch_tokens':>18} | {'padded computed/real':>20} {'forwards':>8} | "
          f"{'packed computed/real':>20} {'forwards':>8}")
    for budget in [int(x) for x in a.budgets.split(",")]:
        (pr, pn), (kr, kn) = token_ratio(lengths, a.ranks, budget, False), token_ratio(lengths, a.ranks, budget, True)
        print(f"{budget:>18} | {pr:>20.3f} {pn:>8} | {kr:>20.3f} {kn:>8}")

    torch.manual_seed(a.seed)
    small = [(max(2, p // a.scale), max(1, r // a.scale)) for p, r in lengths]
    with tempfile.TemporaryDirectory() as d:
        from transformers import AutoModelForCausalLM

        path = tiny_model.make_tiny_model(os.path.join(d, "m"), hidden_size=a.hidden, num_layers=a.layers)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    algo = config_lib.load_config(None, []).algorithm
    seqs = fake_seqs(small, model.config.vocab_size, rng)
    print(f"part 2 (CPU, measured, shared and loaded machine, {a.threads} torch thread(s)): lengths / {a.scale} "
          f"({sum(p + r for p, r in small)} real tokens), hidden {a.hidden} x {a.layers} layers, sdpa, one rank; "
          f"forward + backward of the call, median of {a.repeats}")
    for budget in [int(x) // a.scale for x in a.budgets.split(",")]:
        times = {}
        for packing in (False, True):
            time_call(model, seqs, budget, packing, algo)  # warm-up
            times[packing] = statistics.median(time_call(model, seqs, budget, packing, algo)
                                               for _ in range(a.repeats))
        ratio, _ = token_ratio(small, 1, budget, False)
        print(f"  micro_batch_tokens {budget:>5}: padded {times[False]:.3f} s (computed/real {ratio:.3f}), packed "
              f"{times[True]:.3f} s; padded / packed {times[False] / times[True]:.2f}x")


if __name__ == "__main__":
    main()
