"""bench/step_bench.py: the system's step time against a plain single-process GRPO loop on the same config.

The plain loop is the least a step can cost on this machine: one process, the HF model, `model.generate` for the
B x N samples of a step (left-padded, KV cache, temperature and max_new_tokens of the config), the config's reward,
`losses.compute_advantages` and `losses.policy_loss` with the config's algorithm, (B x N) // M AdamW updates, and
a greedy eval every trainer.eval_freq steps on the same held-out prompts. No HTTP, no RPC, no FSDP, no pause, no
weight sync, no overlap of generation with training.

The system is `torchrun train.py --config CONFIG` itself (the config's processes, servers and mode), run for the
same steps; its step time and breakdown come from its metrics.jsonl (`timing/*`, wait). Both start from the same
base model, so the learning curves printed beside the times compare too.

Printed: per side the mean step time over the steps after --warmup (wall clock between logged steps, so evaluation
and checkpoints count), the eval curve, then the ratio system / plain loop and the system's breakdown per step
(train, waiting for data, pause, weight sync, processing, checkpoint, eval, the rest).

Run:
    python bench/step_bench.py [--config configs/tiny.yaml] [--steps 60] [--warmup 5] [--only plain|system]
                               [KEY=VALUE ...]   # config overrides for both sides, e.g. fully_async.enable=false
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import config as config_lib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_base(cfg) -> None:
    import tasks

    if not os.path.isdir(cfg.model.path):
        tasks.make_tiny_for(cfg)


def greedy_eval(model, tokenizer, prompts, max_new_tokens, reward_fn) -> tuple[float, float]:
    import torch

    rewards = []
    with torch.no_grad():
        for i in range(0, len(prompts), 64):
            chunk = prompts[i:i + 64]
            out, _ = sample(model, tokenizer, [p["prompt_ids"] for p in chunk], max_new_tokens, 0.0)
            for p, resp in zip(chunk, out):
                rewards.append(score(tokenizer, resp, p["label"], reward_fn))
    return sum(rewards) / len(rewards), sum(r >= 1.0 for r in rewards) / len(rewards)


def sample(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float):
    """Left-padded batched generation; returns (responses as token lists, cut after eos; width of the prompt)."""
    import torch

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    attn = (ids != pad).long()
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, pad_token_id=pad,
                         eos_token_id=eos, **kw)[:, width:].tolist()
    responses = []
    for row in out:
        resp = []
        for t in row:
            resp.append(t)
            if t == eos:
                break
        responses.append(resp)
    return responses, width


def score(tokenizer, resp: list[int], label, reward_fn) -> float:
    stopped = bool(resp) and resp[-1] == tokenizer.eos_token_id
    return reward_fn(tokenizer.decode(resp[:-1] if stopped else resp), label, stopped)


def plain_loop(cfg, steps: int) -> dict:
    """The reference GRPO loop; returns {"step_s": [...], "eval": [(step, reward, exact)]}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import batching
    import losses
    import tasks

    torch.manual_seed(cfg.seed)
    ds = cfg.data_sources[0]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    t = cfg.trainer
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    prompts = tasks.load_prompts(ds, tokenizer, "train")
    random.Random(ds.seed).shuffle(prompts)
    evals = tasks.load_prompts(ds, tokenizer, "eval")
    reward_fn = tasks.get_reward_fn(ds.reward or tasks.default_reward(ds.task))
    s = cfg.rollout.sampling
    temp, N, B, M = s.temperature, cfg.N, cfg.B, cfg.M
    out = {"step_s": [], "eval": [(0, *greedy_eval(model, tokenizer, evals, s.max_new_tokens, reward_fn))],
           "generated_at": []}
    cursor = generated = 0
    kept: list = []  # groups that passed the filter, (prompt, responses, rewards); the surplus goes to the next step
    for step in range(steps):
        t0 = time.perf_counter()
        model.eval()
        while len(kept) < B:  # rollout.filter all_equal_reward drops groups; the step still trains B of them
            # Whole batches of B prompts (B x N samples in one generate call), as the system keeps its fleet busy;
            # groups beyond this step's B are trained next step (one step stale at most, like stale_steps 1).
            draw = [prompts[(cursor + i) % len(prompts)] for i in range(B)]
            cursor += len(draw)
            generated += len(draw) * N
            with torch.no_grad():
                drawn, _ = sample(model, tokenizer, [p["prompt_ids"] for p in draw for _ in range(N)],
                                  s.max_new_tokens, temp)
            for g, p in enumerate(draw):
                r = [score(tokenizer, x, p["label"], reward_fn) for x in drawn[g * N:(g + 1) * N]]
                if "all_equal_reward" in cfg.rollout.filter and len(set(r)) == 1:
                    continue
                kept.append((p, drawn[g * N:(g + 1) * N], r))
        groups, kept = kept[:B], kept[B:]
        batch = [p for p, _, _ in groups]
        resps = [x for _, rs, _ in groups for x in rs]
        rewards = torch.tensor([x for _, _, r in groups for x in r])
        adv = losses.compute_advantages(rewards.view(B, N), cfg.algorithm.adv.std_normalize,
                                        cfg.algorithm.adv.eps).flatten()
        seqs = [{"prompt": batch[i // N]["prompt_ids"], "response": r, "mask": [1] * len(r),
                 "rollout_lp": [0.0] * len(r), "versions": [0] * len(r), "adv": float(adv[i])}
                for i, r in enumerate(resps)]
        batches = [batching.collate(seqs[c * M:(c + 1) * M]) for c in range(B * N // M)]
        with torch.no_grad():  # the old policy: the weights at the step's start, for every update of the step
            olds = [losses.token_logprobs(model(input_ids=b["ids"], attention_mask=b["attn"]).logits[:, :-1],
                                          b["ids"][:, 1:], temp, t.logprob_chunk_tokens)[0] for b in batches]
        model.train()
        for b, old in zip(batches, olds):
            logits = model(input_ids=b["ids"], attention_mask=b["attn"]).logits[:, :-1]
            logp, _ = losses.token_logprobs(logits, b["ids"][:, 1:], temp, t.logprob_chunk_tokens)
            denom = losses.loss_denominator(b["mask"], cfg.algorithm.loss_agg_mode, s.max_new_tokens)
            # the sampling policy is the old policy here (rollout log-probs = old: IS weights of 1)
            loss, _ = losses.policy_loss(logp, old, old, b["adv"], b["mask"], cfg.algorithm, denom)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if t.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
        if t.eval_freq and (step + 1) % t.eval_freq == 0:
            out["eval"].append((step + 1, *greedy_eval(model, tokenizer, evals, s.max_new_tokens, reward_fn)))
            out["generated_at"].append((step + 1, generated))
        out["step_s"].append(time.perf_counter() - t0)
        print(f"[plain] step {step + 1}/{steps} {out['step_s'][-1]:.2f} s"
              + (f" eval {out['eval'][-1][1]:.3f}" if out["eval"][-1][0] == step + 1 else ""), flush=True)
    return out


BREAKDOWN = [("train", "timing/train"), ("wait for data", "timing/rollout"), ("pause", "timing/pause_delay"),
             ("weight sync", "timing/update_weights"), ("process", "timing/process_traj"),
             ("checkpoint", "timing/save_ckpt"), ("eval", "timing/eval")]


def system_run(config_path: str, overrides: list[str], steps: int, run_dir: str) -> list[dict]:
    port = random.randint(32000, 39999)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "train.py"), "--config", config_path, *overrides, f"run_dir={run_dir}",
           f"trainer.total_steps={steps}", "trainer.save_freq=0", "trainer.export_hf=false",
           f"rollout.base_port={port}", f"weight_sync.master_port={port + 10000}"]
    print("[system] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the mean step time")
    p.add_argument("--only", choices=["plain", "system"])
    args, overrides = p.parse_known_args()
    cfg = config_lib.load_config(args.config, overrides)
    cfg.trainer.total_steps = args.steps
    ensure_base(cfg)
    res = {}
    if args.only != "system":
        import torch

        torch.set_num_threads(2)  # the machine's two cores, as the system's processes share them
        plain = plain_loop(cfg, args.steps)
        res["plain"] = statistics.mean(plain["step_s"][args.warmup:])
        print("plain eval (reward/exact): " + ", ".join(f"{s}: {r:.3f}/{e:.3f}" for s, r, e in plain["eval"]))
        print("plain loop trajectories generated by step: "
              + ", ".join(f"{s}: {n}" for s, n in plain["generated_at"]))
    if args.only != "plain":
        rows = system_run(args.config, overrides, args.steps, tempfile.mkdtemp(prefix="step-bench-"))
        steps = [r for r in rows if r["step"] > args.warmup]
        wall = [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if b["step"] > args.warmup]
        res["system"] = statistics.mean(wall)
        print("system eval: " + ", ".join(f"{r['step']}: {r['eval/reward_mean']:.3f}/{r['eval/exact_ratio']:.3f}"
                                          for r in rows if "eval/reward_mean" in r))
        print(f"\nsystem step breakdown (mean s per step over steps {args.warmup + 1}-{args.steps}):")
        accounted = 0.0
        for label, key in BREAKDOWN:
            v = sum(r.get(key, 0.0) for r in steps) / len(steps)
            accounted += v
            print(f"  {label:<14}{v:7.3f}")
        print(f"  {'other':<14}{res['system'] - accounted:7.3f}  (metrics, logging, the step's RPC calls)")
        print(f"  {'wall':<14}{res['system']:7.3f}")
    for side in ("plain", "system"):
        if side in res:
            print(f"{side} loop: {res[side]:.3f} s/step")
    if len(res) == 2:
        print(f"ratio system / plain loop: {res['system'] / res['plain']:.2f}")


if __name__ == "__main__":
    main()
