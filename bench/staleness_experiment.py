"""bench/staleness_experiment.py: does staleness hurt a real (tiny) transformer, and which estimator protects it?

A controlled experiment, not the pipeline: one process trains the tiny Qwen3 of tiny_model.make_tiny_model with this
project's losses (losses.POLICY_LOSSES, losses.compute_advantages), and imposes staleness exactly instead of
letting a fleet produce it:
  - step t's batch is sampled with the snapshot of step t - eta (version max(0, t - eta));
  - with eta > 0, half of the trajectories were in flight at a step boundary: each draws its own cut, uniform in
    [1, max_new - 1]; its tokens before the cut come from version t - eta, the rest from version
    t - eta + ceil(eta / 2) (re-prefilled, as a resumed request is); a cut past its end means it never switched. The
    share of response tokens from the newer snapshot is recorded per step (new_snapshot_token_frac);
  - every token keeps the log-prob of the snapshot that sampled it (log mu) and that snapshot's version.

The task: a prompt "8341=" (Setup.min_digits to max_digits digits), a free scratchpad of up to Setup.scratch
tokens, then ">" and the digits reversed, then eos; reward 1 when the text after the first ">" is exactly the
reversed digits and the response stopped on eos, else 0 (binary, sparse, per sequence), in up to Setup.max_new
tokens. A base is the same Qwen3 pretrained on the task's format with a random scratchpad until its greedy pass
rate reaches Setup.base_pass (checked every 25 steps on held-out prompts); two bases (base_seed 0 and 1, seed s on
base s % 2), cached under --base-dir, keyed by their recipe.

Arms (two mini-batches a step, dual clip off):
  naive          ppo with the ratio against mu (trainer.use_rollout_log_probs=true), no weight: AReaL's baseline
  decoupled_ppo  AReaL's decoupled PPO as published: clip around the step-start forward, behaviour weight
                 pi_old / mu masked above its cap (5), raw below (losses.decoupled_ppo)
  m2po           M2PO as published: ratio against mu, the second-moment mask in place of the clip (losses.m2po)
Eta 0 is one on-policy run per seed shared by every arm (ETA0_IS). Records per step: reward, the pre-clip grad norm of
each mini-batch, the staleness diagnostics of docs/metrics.md (is_ess, is_log_ratio_m2, neg_adv_high_ratio_frac),
the loss's own metrics (clip fractions low / high and dual, mask fractions: what the estimator applied), KL(pi_t ||
pi_0) exact over the vocabulary on a fixed probe set (the base's own samples of 32 eval prompts); per eval (every
--eval-every steps): greedy and temperature-1 pass@1 on 512 held-out prompts.

Before any sweep, the gate (GATE, stated before the pilot ran): a two-seed pilot of on-policy and naive at the
largest eta must show an on-policy gain >= 0.15, at most half of it by step 40, and naive's neg_adv_high_ratio_frac
>= 0.03 (--pilot prints the table). --lr-scan finds the learning rate. The sweep's pre-registered outcomes
(`outcomes`): an arm degrades if its largest-eta minus on-policy difference is below -max(0.03, 0.25 x gain) with
the 95% interval excluding 0, or >= 3 of 8 runs drop >= 0.2; it holds only with equivalence at that margin and a
final KL from the base >= 70% of on-policy's. Every finished run is appended to --out (jsonl) and skipped when the
command is run again, so an interrupted sweep continues where it stopped.

Run (docs/results/staleness.md has the figures and wall times):
    python bench/staleness_experiment.py --lr-scan 1e-4,2e-4,4e-4,8e-4 --out runs/i49_lrscan.jsonl
    python bench/staleness_experiment.py --pilot --lr 1e-4 --grad-clip 1.5 --out runs/i49_pilot.jsonl
    python bench/staleness_experiment.py --out runs/i49_sweep.jsonl --lr ... --grad-clip ... [--workers 2]
    python bench/staleness_experiment.py --out runs/i49_sweep.jsonl --summary --png docs/results/....png
    python bench/staleness_experiment.py --quick --out /tmp/q.jsonl                   # seconds: the CI check
The first experiment (docs/results/staleness.md: its regime could not show harm) ran this file's earlier version:
4-12 digits, 30 new tokens, 300 steps, one base, one cut a step, and the old recompute / m2po arms.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import logprobs  # noqa: E402
import losses  # noqa: E402
from standins import tiny_model  # noqa: E402

SEP = ">"


@dataclass
class Setup:
    """One run's recipe; everything that changes a result is here (and in the results file). The defaults are the
    regime of issue 49's design, gated by --pilot before any sweep (docs/results/staleness.md)."""
    loss: str = "decoupled_ppo"
    eta: int = 0
    seed: int = 0
    steps: int = 400
    lr: float = 1e-4  # set by the pilot (--lr-scan, then --pilot): see docs/results/staleness.md
    grad_clip: float = 1.0  # max grad norm; the pilot sets ~5x the on-policy median norm
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    mini_batches: int = 2
    eval_every: int = 20
    eval_prompts: int = 512
    probe_prompts: int = 32  # KL(pi_t || pi_0) on this many fixed base samples, every step
    min_digits: int = 4
    max_digits: int = 16
    scratch: int = 16
    max_new: int = 40
    hidden: int = 128
    layers: int = 2
    base_pass: tuple = (0.10, 0.20)
    base_seed: int = 0  # the sweep splits seeds between two bases: base_seed = seed % 2


LOSSES = ("naive", "decoupled_ppo", "m2po")
ETAS = (0, 4, 16)
# eta 0 is one on-policy run per seed shared by every loss (naive PPO with pi_old = mu): the question is how far each
# estimator's stale run falls from on-policy learning of the same seed, not whether the estimators differ on-policy.
ETA0_IS = {"decoupled_ppo": "naive", "m2po": "naive"}


# ---------------------------------------------------------------------------------------------------------------
# The task

def _example(rng: random.Random, s: Setup) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(s.min_digits, s.max_digits)))
    return f"{digits}=", digits[::-1]


def prompts(s: Setup, split: str, n: int, seed: int) -> list[tuple[str, str]]:
    """n prompts of `split`: eval prompts are those whose hash falls in 1 of 8 buckets, train the rest."""
    rng, out = random.Random(f"{split}:{seed}"), []
    while len(out) < n:
        p, target = _example(rng, s)
        if (hash_bucket(p) == 0) == (split == "eval"):
            out.append((p, target))
    return out


def hash_bucket(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest(), 16) % 8


def reward(text: str, target: str, stopped: bool) -> float:
    """1 when the response stopped on eos and the text after the first '>' is exactly the reversed digits."""
    if not stopped or SEP not in text:
        return 0.0
    return float(text.split(SEP, 1)[1] == target)


# ---------------------------------------------------------------------------------------------------------------
# The base: the task's format with a random scratchpad, pretrained until its greedy pass rate is in BASE_PASS

def _base_recipe(s: Setup) -> dict:
    return {"hidden": s.hidden, "layers": s.layers, "min_digits": s.min_digits, "max_digits": s.max_digits,
            "scratch": s.scratch, "base_pass": list(s.base_pass), "seed": s.base_seed, "version": 1,
            **({"max_new": s.max_new} if s.max_new != 30 else {})}  # 30: the first experiment's, keyed without it


def make_base(s: Setup, base_dir: str, log=print) -> str:
    """The pretrained base for `s` (made once per recipe, cached in base_dir/<hash of the recipe>)."""
    from transformers import AutoModelForCausalLM

    recipe = _base_recipe(s)
    key = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    path = os.path.join(base_dir, f"base-{key}")
    if os.path.exists(os.path.join(path, "recipe.json")):
        return path
    tiny_model.make_tiny_model(path + ".init", s.hidden, s.layers, s.base_seed)
    model = AutoModelForCausalLM.from_pretrained(path + ".init").float()
    tok = tiny_model.build_tokenizer()
    rng = random.Random(f"base:{s.base_seed}")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    held = prompts(s, "eval", 256, seed=10_000 + s.base_seed)
    low, high = s.base_pass
    t0, step, rate = time.perf_counter(), 0, 0.0
    while True:
        rows, masks = [], []
        for _ in range(64):
            p, target = _example(rng, s)
            scratch = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, s.scratch)))
            a = tok(scratch + SEP + target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = tok(p, add_special_tokens=False)["input_ids"]
            rows.append(ids + a)
            masks.append([0] * len(ids) + [1] * len(a))
        width = max(map(len, rows))
        ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 25 == 0:
            model.eval()
            rate = evaluate(model, tok, held, s)
            model.train()
            log(f"[base] step {step}: loss {loss.item():.3f}, greedy pass rate {rate:.3f} (target {low}-{high})")
            if rate >= low:
                break
            if step >= 20_000:
                raise RuntimeError(f"the base did not reach a pass rate of {low} in 20,000 steps (last {rate:.3f})")
    if rate > high:
        log(f"[base] warning: the pass rate {rate:.3f} overshot {high} within 25 steps; kept")
    model.eval()
    model.save_pretrained(path + ".tmp", safe_serialization=True)
    tok.save_pretrained(path + ".tmp")
    with open(os.path.join(path + ".tmp", "recipe.json"), "w") as f:
        json.dump({**recipe, "steps": step, "pass_rate": rate, "seconds": round(time.perf_counter() - t0, 1)}, f)
    os.replace(path + ".tmp", path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Sampling with snapshots: one KV cache per snapshot over all rows; a row that switches snapshot is re-prefilled

@torch.no_grad()
def sample(models: list, row_model: torch.Tensor, cut, prompt_ids: list[list[int]], s: Setup, tok,
           greedy: bool = False, gen: Optional[torch.Generator] = None) -> dict:
    """Sample a response per prompt. row_model [R, 2] long: the index into `models` of the snapshot that samples a
    row's positions < cut and >= cut; cut an int (every row) or a [R] tensor (each row its own). Returns response
    ids, the sampling log-probs (log mu), the index of the snapshot of each token, and whether the row stopped on eos.

    Each snapshot keeps a KV cache over every row; at each position only the snapshots some live row uses run, and
    one that joins late (the second snapshot at `cut`) first reads every column it has not seen, so its first
    token conditions on the whole prefix, as a resumed request re-prefilled on new weights does. (The first
    version recomputed every prefix at every position: the same log-probs, tests/test_staleness_experiment.py,
    at ~4x the time.)"""
    from transformers import DynamicCache

    eos, pad = tok.eos_token_id, tok.pad_token_id
    R = len(prompt_ids)
    plen = torch.tensor([len(p) for p in prompt_ids])
    width = int(plen.max()) + s.max_new
    ids = torch.full((R, width), pad, dtype=torch.long)
    for i, p in enumerate(prompt_ids):  # left-padded prompts, so every row's next position is the same column
        ids[i, width - s.max_new - len(p): width - s.max_new] = torch.tensor(p)
    start = width - s.max_new
    attn = torch.zeros(R, width, dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        attn[i, start - len(p): start] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    done = torch.zeros(R, dtype=torch.bool)
    stopped = torch.zeros(R, dtype=torch.bool)
    mu = torch.zeros(R, s.max_new)
    who = torch.full((R, s.max_new), -1, dtype=torch.long)
    length = torch.zeros(R, dtype=torch.long)
    cut = torch.as_tensor(cut).expand(R)
    caches: dict = {}  # snapshot index -> [its DynamicCache, the columns it has read]
    # the cache's keyword: `past_key_values` up to transformers 5.24, `cache` from 5.25 (the old name warns)
    kw = "cache" if "cache" in inspect.signature(models[0].forward).parameters else "past_key_values"
    for t in range(s.max_new):
        col = start + t
        use = torch.where(t < cut, row_model[:, 0], row_model[:, 1])
        logits = torch.empty(R, models[0].config.vocab_size)
        for m in use[~done].unique().tolist():
            cache = caches.setdefault(m, [DynamicCache(), 0])
            out = models[m](input_ids=ids[:, cache[1]:col], attention_mask=attn[:, :col],
                            position_ids=pos[:, cache[1]:col], use_cache=True, **{kw: cache[0]})
            cache[1] = col
            rows = (use == m) & ~done
            logits[rows] = out.logits[rows, -1].float()
        live = ~done
        logp = torch.log_softmax(logits[live], -1)
        nxt = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        ids[live, col] = nxt
        attn[live, col] = 1
        pos[live, col] = pos[live, col - 1] + 1
        mu[live, t] = logp.gather(-1, nxt[:, None]).squeeze(-1)
        who[live, t] = use[live]
        length[live] += 1
        hit = torch.zeros(R, dtype=torch.bool)
        hit[live] = nxt == eos
        stopped |= hit
        done |= hit
        if bool(done.all()):
            break
    return {"ids": ids, "attn": attn, "pos": pos, "start": start, "mu": mu, "who": who, "length": length,
            "stopped": stopped}


def evaluate(model, tok, held: list[tuple[str, str]], s: Setup, batch: int = 256,
             gen: Optional[torch.Generator] = None) -> float:
    """Pass rate on `held`: greedy, or with `gen` one sample at temperature 1 per prompt (pass@1)."""
    total = 0.0
    for i in range(0, len(held), batch):
        part = held[i:i + batch]
        p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in part]
        out = sample([model], torch.zeros(len(part), 2, dtype=torch.long), s.max_new, p_ids, s, tok,
                     greedy=gen is None, gen=gen)
        for r, (_, target) in enumerate(part):
            n = int(out["length"][r])
            text = tok.decode(out["ids"][r, out["start"]: out["start"] + n].tolist(), skip_special_tokens=True)
            total += reward(text, target, bool(out["stopped"][r]))
    return total / len(held)


# ---------------------------------------------------------------------------------------------------------------
# One run

def _algo(s: Setup) -> tuple[losses.LossSettings, str, bool]:
    """The LossSettings, policy_loss name and whether old_log_probs are mu (the rollout's) for s.loss. Dual clip is
    off (LossSettings' default) in every arm."""
    algo = losses.LossSettings()
    if s.loss == "naive":  # PPO clipped around mu, no correction: AReaL's naive baseline
        return algo, "ppo", True
    if s.loss in ("decoupled_ppo", "m2po"):  # the published estimators at their published defaults (losses.py)
        return algo, s.loss, False
    raise ValueError(f"--losses: '{s.loss}' is unknown; accepted: {', '.join(LOSSES)}")


def _seq_logprobs(model, ids, attn, pos, start, full: bool = False) -> torch.Tensor:
    """Log-probs of the response tokens [R, T], or with full=True the whole log-softmax [R, T, V]."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, start - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    return logp if full else logp.gather(-1, ids[:, start:, None]).squeeze(-1)


def make_probe(model, tok, s: Setup) -> dict:
    """The fixed probe set of KL(pi_t || pi_0): s.probe_prompts eval-split prompts (their own seed), one sample each
    from the base at temperature 1 (a fixed generator, so every run on a base shares it), and the base's full
    log-softmax at their response positions."""
    held = prompts(s, "eval", s.probe_prompts, seed=30_000)
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in held]
    out = sample([model], torch.zeros(len(p_ids), 2, dtype=torch.long), s.max_new, p_ids, s, tok,
                 gen=torch.Generator().manual_seed(30_000))
    mask = torch.arange(s.max_new)[None] < out["length"][:, None]
    with torch.no_grad():
        ref = _seq_logprobs(model, out["ids"], out["attn"], out["pos"], out["start"], full=True)
    return {**out, "mask": mask, "ref": ref}


@torch.no_grad()
def kl_to_base(model, probe: dict) -> float:
    """KL(pi_t || pi_0), exact over the vocabulary (logprobs.kl_rows, the trainer's train/kl_to_start), averaged
    over the probe's response positions (contexts fixed: the base's own samples)."""
    cur = _seq_logprobs(model, probe["ids"], probe["attn"], probe["pos"], probe["start"], full=True)
    return float(logprobs.kl_rows(cur[probe["mask"]], probe["ref"][probe["mask"]]).mean())


def _mean_metrics(per_batch: list[dict]) -> dict:
    """The loss's own train/* metrics (clip and mask fractions: what the estimator applied), averaged over the
    step's mini-batches, keyed without the prefix."""
    keys = {k for m in per_batch for k in m if k != "train/pg_loss"}
    return {k.split("/", 1)[1]: sum(float(m[k]) for m in per_batch if k in m) / sum(k in m for m in per_batch)
            for k in sorted(keys)}


def run(s: Setup, base: str, log=print) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    eval_gen = torch.Generator()
    rng = random.Random(s.seed)
    tok = tiny_model.build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(base).float()
    model.eval()  # no dropout: the forward that trains is the forward that scored
    opt = torch.optim.Adam(model.parameters(), lr=s.lr)
    algo, name, against_mu = _algo(s)
    if name not in losses.POLICY_LOSSES:
        raise ValueError(f"losses.py has no policy loss '{name}' (--losses {s.loss}); it has "
                         f"{', '.join(losses.POLICY_LOSSES)}")
    loss_fn = losses.POLICY_LOSSES[name]
    train_prompts = prompts(s, "train", 4096, seed=s.seed)
    held = prompts(s, "eval", s.eval_prompts, seed=20_000)
    probe = make_probe(model, tok, s)
    snaps = {0: copy.deepcopy(model.state_dict())}  # version -> weights, the last eta + 1 kept
    behaviour = [copy.deepcopy(model), copy.deepcopy(model)]
    rows, evals, evals_t1, t0 = [], [], [], time.perf_counter()

    def do_eval(step: int) -> dict:  # greedy, and temperature-1 pass@1 (one sample a prompt, seeded by the step)
        e = {"greedy": evaluate(model, tok, held, s),
             "t1": evaluate(model, tok, held, s, gen=eval_gen.manual_seed(40_000 + step))}
        evals.append((step, e["greedy"]))
        evals_t1.append((step, e["t1"]))
        return e

    do_eval(0)
    for step in range(1, s.steps + 1):
        v = step - 1  # the version the step starts from
        v_old = max(0, v - s.eta)
        v_new = max(0, min(v, v - s.eta + math.ceil(s.eta / 2)))
        behaviour[0].load_state_dict(snaps[v_old])
        behaviour[1].load_state_dict(snaps[v_new])
        batch = [train_prompts[rng.randrange(len(train_prompts))] for _ in range(s.prompts_per_step)]
        p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in batch for _ in range(s.samples_per_prompt)]
        R = len(p_ids)
        row_model = torch.zeros(R, 2, dtype=torch.long)
        if s.eta > 0:  # half the trajectories were in flight at a step boundary: each switches at its own cut
            switch = torch.randperm(R, generator=gen)[: R // 2]
            row_model[switch, 1] = 1
        cut = torch.randint(1, s.max_new, (R,), generator=gen)  # past a row's end: that row never switched
        out = sample(behaviour, row_model, cut, p_ids, s, tok, gen=gen)
        start, T = out["start"], s.max_new
        mask = torch.arange(T)[None] < out["length"][:, None]
        rewards = torch.zeros(R)
        for r in range(R):
            n = int(out["length"][r])
            text = tok.decode(out["ids"][r, start: start + n].tolist(), skip_special_tokens=True)
            rewards[r] = reward(text, batch[r // s.samples_per_prompt][1], bool(out["stopped"][r]))
        adv = losses.compute_advantages(rewards.view(-1, s.samples_per_prompt)).view(-1)
        token_version = torch.where(out["who"] == 1, v_new, v_old)
        versions = torch.where(mask, token_version, -1)
        with torch.no_grad():
            old = _seq_logprobs(model, out["ids"], out["attn"], out["pos"], start)
        diag = {k.split("/")[1]: v for k, v in losses.offpolicy_diagnostics(  # the trainer's train/* diagnostics
            losses.offpolicy_diagnostic_sums(old, out["mu"], adv, mask.float(), algo.clip_high)).items()}
        grad_norms, per_batch = [], []
        for idx in torch.randperm(R, generator=gen).chunk(s.mini_batches):
            lp = _seq_logprobs(model, out["ids"][idx], out["attn"][idx], out["pos"][idx], start)
            ref = out["mu"][idx] if against_mu else old[idx]
            batch = losses.TokenBatch(lp, ref, out["mu"][idx], adv[idx], mask[idx].float(), versions[idx], v + 1)
            loss, metrics = loss_fn(batch, algo, float(mask[idx].sum()))
            per_batch.append(metrics)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)))  # pre-clip
            opt.step()
        snaps[v + 1] = copy.deepcopy(model.state_dict())
        for old_v in [k for k in snaps if k < v + 1 - s.eta - 1]:
            del snaps[old_v]
        row = {"step": step, "reward": float(rewards.mean()), "grad_norm": max(grad_norms),
               "grad_norms": grad_norms, "staleness": float((v - token_version.float())[mask].mean()),
               "new_snapshot_token_frac": float((out["who"] == 1)[mask].float().mean()), **diag,
               "loss_metrics": _mean_metrics(per_batch), "kl_to_base": kl_to_base(model, probe),
               "response_len": float(out["length"].float().mean())}
        if step % s.eval_every == 0 or step == s.steps:
            e = do_eval(step)
            row["eval"], row["eval_t1"] = e["greedy"], e["t1"]
            log(f"[{s.loss} eta={s.eta} seed={s.seed}] step {step}: eval {e['greedy']:.3f} (t=1 {e['t1']:.3f}), "
                f"reward {row['reward']:.3f}, ess {diag['is_ess']:.3f}, m2 {diag['is_log_ratio_m2']:.4f}, "
                f"neg_high {diag['neg_adv_high_ratio_frac']:.4f}, kl0 {row['kl_to_base']:.4f}, "
                f"grad {row['grad_norm']:.3f}, {time.perf_counter() - t0:.0f} s")
        rows.append(row)
    result = summarise_run(s, rows, evals, time.perf_counter() - t0)
    result["evals_t1"] = evals_t1
    return result


def _eval_drop(evals: list) -> Optional[int]:
    """The first eval step 0.2 below the running maximum of the evals, or None."""
    best = -1.0
    for st, e in evals:
        best = max(best, e)
        if e < best - 0.2:
            return st
    return None


def summarise_run(s: Setup, rows: list, evals: list, seconds: float) -> dict:
    values = [e for _, e in evals]
    collapsed_at = _eval_drop(evals)
    norms = [r["grad_norm"] for r in rows]
    for i in range(20, len(norms)):
        med = sorted(norms[:i])[i // 2]
        if norms[i] > 10 * med:
            collapsed_at = rows[i]["step"] if collapsed_at is None else min(collapsed_at, rows[i]["step"])
            break
    best, drop = -1.0, 0.0
    for v in values:
        best = max(best, v)
        drop = max(drop, best - v)
    return {"setup": asdict(s), "final_eval": sum(values[-3:]) / len(values[-3:]), "auc": sum(values) / len(values),
            "collapsed": collapsed_at is not None, "collapsed_at": collapsed_at, "max_drop": drop,
            "final_kl_to_base": (sum(r["kl_to_base"] for r in rows[-3:]) / len(rows[-3:])
                                 if rows and "kl_to_base" in rows[0] else None),
            "evals": evals, "rows": rows, "seconds": round(seconds, 1)}


# ---------------------------------------------------------------------------------------------------------------
# The sweep: resumable, a process per run

def _key(setup: dict) -> tuple:
    return (setup["loss"], setup["eta"], setup["seed"], setup["steps"], setup["lr"], setup.get("grad_clip", 1.0),
            setup.get("base_seed", 0), setup.get("max_new", 30), setup.get("max_digits", 12))


def _done(path: str) -> set:
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {_key(json.loads(line)["setup"]) for line in f if line.strip()}


def _worker(args):
    s, base = args
    torch.set_num_threads(1)
    return run(s, base, log=lambda m: print(m, flush=True))


def sweep(setups: list[Setup], bases: dict, out: str, workers: int) -> None:
    """Run `setups` (each on bases[its base_seed]) on `workers` processes, appending each finished run to `out`."""
    import multiprocessing as mp

    todo = [s for s in setups if _key(asdict(s)) not in _done(out)]
    print(f"[sweep] {len(setups) - len(todo)} of {len(setups)} runs already in {out}; {len(todo)} to go", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        for i, result in enumerate(pool.imap_unordered(_worker, [(s, bases[s.base_seed]) for s in todo]), 1):
            with open(out, "a") as f:  # one line per finished run: an interrupted sweep loses only the runs in flight
                f.write(json.dumps(result) + "\n")
            st = result["setup"]
            print(f"[sweep] {i}/{len(todo)} {st['loss']} eta={st['eta']} seed={st['seed']}: final eval "
                  f"{result['final_eval']:.3f}, collapsed {result['collapsed']}, {result['seconds']} s "
                  f"({time.perf_counter() - t0:.0f} s in all)", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Statistics

T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20,
        12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 19: 2.09, 24: 2.06, 29: 2.05}
T95 = {1: 6.31, 2: 2.92, 3: 2.35, 4: 2.13, 5: 2.02, 6: 1.94, 7: 1.89, 8: 1.86, 9: 1.83, 10: 1.81, 11: 1.80,
       12: 1.78, 13: 1.77, 14: 1.76, 15: 1.75, 19: 1.73, 24: 1.71, 29: 1.70}


def _t(table: dict, df: int) -> float:
    return table[max(k for k in table if k <= df)] if df >= 1 else math.inf


def mean_ci(xs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, -math.inf, math.inf
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = _t(T975, n - 1) * sd / math.sqrt(n)
    return m, m - h, m + h


def ci_text(xs: list[float]) -> str:
    """A paired difference as the tables print it: mean (95% t-interval)."""
    m, lo, hi = mean_ci(xs)
    return f"{m:+.3f} ({lo:+.3f}, {hi:+.3f})"


def equivalent(xs: list[float], margin: float) -> bool:
    """TOST at 5%: the mean paired difference lies within +-margin (the 90% t-interval inside it)."""
    n = len(xs)
    if n < 2:
        return False
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = _t(T95, n - 1) * sd / math.sqrt(n)
    return -margin < m - h and m + h < margin


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def summary(path: str, margin: float, png: Optional[str], seeds: Optional[list] = None) -> str:
    """The table of a results file (of `seeds` only, if given: one seed set against another): a row per (learning
    rate, loss, eta), paired differences against eta 0 of the same learning rate, loss and seed."""
    with open(path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    results = [r for r in results if seeds is None or r["setup"]["seed"] in seeds]
    by = {}
    for r in results:
        st = r["setup"]
        by[(st["lr"], st["loss"], st["eta"], st["seed"])] = r
    lrs = sorted({k[0] for k in by})
    losses_ = sorted({k[1] for k in by}, key=lambda x: LOSSES.index(x) if x in LOSSES else 99)
    etas = sorted({k[2] for k in by})
    # eta 0 of a loss in ETA0_IS is its twin's run (the same algorithm on-policy); its own eta-0 runs, where they
    # exist (--every-eta0), are kept apart as the check that they are
    twins = {k: by[k] for k in by if k[2] == 0 and k[1] in ETA0_IS}
    for lr, loss, eta, seed in list(by):
        if (lr, ETA0_IS.get(loss), 0, seed) in by:
            by[(lr, loss, 0, seed)] = by[(lr, ETA0_IS[loss], 0, seed)]
    lines = [f"| lr | loss | eta | runs | final eval (95% CI) | diff vs eta 0 (95% CI) | within +-{margin:.2f}? | AUC | "
             "collapse (Wilson 95%) | of which an eval drop | min is_ess | max is_log_ratio_m2 | "
             "mean neg_adv_high_ratio_frac |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lr in lrs:
        for loss in losses_:
            for eta in etas:
                runs = [by[k] for k in sorted(by) if k[:3] == (lr, loss, eta)]
                if not runs:
                    continue
                fe = [r["final_eval"] for r in runs]
                m, lo, hi = mean_ci(fe)
                diffs = [r["final_eval"] - by[(lr, loss, 0, r["setup"]["seed"])]["final_eval"]
                         for r in runs if (lr, loss, 0, r["setup"]["seed"]) in by]
                if eta and len(diffs) >= 2:
                    diff = ci_text(diffs)
                    eq = "yes" if equivalent(diffs, margin) else "not shown"
                else:
                    diff, eq = "-", "-"
                k = sum(r["collapsed"] for r in runs)
                drops = sum(_eval_drop(r["evals"]) is not None for r in runs)  # the rest: a grad-norm spike alone
                wl, wh = wilson(k, len(runs))
                auc = mean_ci([r["auc"] for r in runs])[0]
                ess = min(row["is_ess"] for r in runs for row in r["rows"])
                m2 = max(row["is_log_ratio_m2"] for r in runs for row in r["rows"])
                nah = (sum(row["neg_adv_high_ratio_frac"] for r in runs for row in r["rows"])
                       / sum(len(r["rows"]) for r in runs))
                lines.append(f"| {lr:g} | {loss} | {eta} | {len(runs)} | {m:.3f} ({lo:.3f}, {hi:.3f}) | {diff} | {eq} | "
                             f"{auc:.3f} | {k}/{len(runs)} ({wl:.2f}, {wh:.2f}) | {drops} | {ess:.3f} | {m2:.3f} | "
                             f"{nah:.4f} |")
    if twins:
        lines += ["", "The eta-0 runs of " + ", ".join(f"{k} (shared with {v})" for k, v in ETA0_IS.items()) +
                  " against the run they share (final eval, paired; one algorithm on-policy, so the seed noise of "
                  "float-level differences):", "", "| lr | loss | pairs | own eta-0 run - shared (95% CI) |",
                  "|---|---|---|---|"]
        for lr in lrs:
            for loss in losses_:
                d = [r["final_eval"] - by[(lr, ETA0_IS[loss], 0, k[3])]["final_eval"] for k, r in sorted(twins.items())
                     if k[:2] == (lr, loss) and (lr, ETA0_IS[loss], 0, k[3]) in by]
                if len(d) >= 2:
                    lines.append(f"| {lr:g} | {loss} | {len(d)} | {ci_text(d)} |")
    lines += ["", "Against naive PPO at the same learning rate, eta and seed (final eval, paired):", "",
              "| lr | loss | eta | pairs | loss - naive (95% CI) |", "|---|---|---|---|---|"]
    for lr in lrs:
        for loss in losses_:
            if loss == "naive":
                continue
            for eta in [e for e in etas if e > 0 or loss not in ETA0_IS]:  # a shared eta 0 differs by 0
                d = [r["final_eval"] - by[(lr, "naive", eta, k[3])]["final_eval"]
                     for k, r in sorted(by.items()) if k[:3] == (lr, loss, eta) and (lr, "naive", eta, k[3]) in by]
                if len(d) >= 2:
                    lines.append(f"| {lr:g} | {loss} | {eta} | {len(d)} | {ci_text(d)} |")
    if png:
        _plot({k[1:]: r for k, r in by.items() if k[0] == lrs[-1]}, losses_, etas, png)
    return "\n".join(lines)


GATE = {"gain": 0.15, "half_by": 40, "half_frac": 0.5, "neg_high": 0.03}  # stated before any sweep (issue 49)


def _eval_at(r: dict, step: int) -> float:
    """The eval at `step`, or the last one before it (evals run every eval_every steps: 20 puts one at step 40)."""
    return [e for st, e in r["evals"] if st <= step][-1]


def pilot_gate(path: str, eta: int) -> tuple[str, bool]:
    """The gate a regime must meet before the sweep, on the two-seed pilot in `path` (naive at eta 0 = on-policy,
    naive at `eta`): mean on-policy gain (final eval - step-0 eval) >= 0.15; at most half of it reached by step 40
    (mean over seeds of the step-40 gain); naive's neg_adv_high_ratio_frac at `eta`, averaged over its steps,
    >= 0.03. Returns the table and whether every item holds."""
    with open(path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    lines, ok_all = [], True
    for lr, clip in sorted({(r["setup"]["lr"], r["setup"].get("grad_clip", 1.0)) for r in results}):
        on = [r for r in results if r["setup"]["loss"] == "naive" and r["setup"]["eta"] == 0
              and (r["setup"]["lr"], r["setup"].get("grad_clip", 1.0)) == (lr, clip)]
        st = [r for r in results if r["setup"]["loss"] == "naive" and r["setup"]["eta"] == eta
              and (r["setup"]["lr"], r["setup"].get("grad_clip", 1.0)) == (lr, clip)]
        if not on:
            continue
        gains = [r["final_eval"] - r["evals"][0][1] for r in on]
        gain = sum(gains) / len(gains)
        early = sum(_eval_at(r, GATE["half_by"]) - r["evals"][0][1] for r in on) / len(on)
        frac = early / gain if gain > 0 else math.inf
        nh = (sum(row["neg_adv_high_ratio_frac"] for r in st for row in r["rows"]) / sum(len(r["rows"]) for r in st)
              if st else math.nan)
        norms = sorted(n for r in on for row in r["rows"] for n in row.get("grad_norms", [row["grad_norm"]]))
        items = [gain >= GATE["gain"], frac <= GATE["half_frac"], nh >= GATE["neg_high"]]
        ok_all &= all(items)
        curves = "; ".join(f"seed {r['setup']['seed']}: " + " ".join(f"{e:.2f}" for _, e in r["evals"]) for r in on)
        st_final = ", ".join(f"{r['final_eval']:.3f}" for r in st)
        met = ["met" if x else "NOT met" for x in items]
        lines.append(f"| {lr:g} | {clip:g} | {len(on)} + {len(st)} | {gain:+.3f} ({met[0]}) | {frac:.2f} ({met[1]}) | "
                     f"{nh:.4f} ({met[2]}) | {norms[len(norms) // 2]:.3f} | {st_final} | {curves} |")
    head = [f"| lr | grad clip | runs (on-policy + naive eta {eta}) | on-policy gain (>= {GATE['gain']}) | "
            f"share of it by step {GATE['half_by']} (<= {GATE['half_frac']}) | naive neg_adv_high_ratio_frac at eta "
            f"{eta} (>= {GATE['neg_high']}) | on-policy median grad norm | naive eta {eta} final evals | "
            "on-policy greedy evals (every eval step) |", "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(head + lines), ok_all


def plot_pilot(path: str, eta: int, png: str) -> None:
    """The pilot's figure: greedy eval of on-policy (solid) and naive at `eta` (dashed) per seed, and naive's
    neg_adv_high_ratio_frac per step (a 25-step running mean) against the gate's 0.03."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4))
    for r in results:
        st = r["setup"]
        style = "-" if st["eta"] == 0 else "--"
        label = f"seed {st['seed']} (base {st.get('base_seed', 0)}), {'on-policy' if st['eta'] == 0 else f'naive eta {eta}'}"
        ax.plot([x for x, _ in r["evals"]], [e for _, e in r["evals"]], style, color=f"C{st['seed']}", label=label)
        if st["eta"] == eta:
            nh = [row["neg_adv_high_ratio_frac"] for row in r["rows"]]
            run = [sum(nh[max(0, i - 24): i + 1]) / len(nh[max(0, i - 24): i + 1]) for i in range(len(nh))]
            bx.plot(range(1, len(run) + 1), run, "--", color=f"C{st['seed']}", label=label)
    bx.axhline(GATE["neg_high"], color="k", lw=0.8, label="gate")
    ax.set_xlabel("step")
    ax.set_ylabel("greedy pass rate (512 held-out prompts)")
    bx.set_xlabel("step")
    bx.set_ylabel("neg_adv_high_ratio_frac (25-step mean)")
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def outcomes(path: str, eta: int = 16) -> str:
    """The pre-registered outcomes of the sweep (issue 49), per loss at `eta` against the shared on-policy run of the
    same seed: degrades if the mean paired difference is below -max(0.03, 0.25 x gain) with its 95% interval
    excluding 0, or if >= 3 of 8 runs drop >= 0.2 below their running maximum; holds only with equivalence at that
    margin (TOST, 90% interval inside +-margin) AND its final KL from the base >= 70% of on-policy's (mean over
    seeds); otherwise undecided."""
    with open(path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    on = {r["setup"]["seed"]: r for r in results if r["setup"]["loss"] == "naive" and r["setup"]["eta"] == 0}
    gain = sum(r["final_eval"] - r["evals"][0][1] for r in on.values()) / max(1, len(on))
    margin = max(0.03, 0.25 * gain)
    lines = [f"On-policy gain {gain:+.3f} over {len(on)} seeds; margin max(0.03, 0.25 x gain) = {margin:.3f}.", "",
             f"| loss | eta | pairs | diff vs on-policy (95% CI) | runs dropping >= 0.2 | equivalent at +-{margin:.3f} "
             "| KL from base, end (vs on-policy) | outcome |", "|---|---|---|---|---|---|---|---|"]
    for loss in LOSSES:
        for e in sorted({r["setup"]["eta"] for r in results if r["setup"]["eta"] > 0}):
            runs = [r for r in results if r["setup"]["loss"] == loss and r["setup"]["eta"] == e
                    and r["setup"]["seed"] in on]
            if len(runs) < 2:
                continue
            d = [r["final_eval"] - on[r["setup"]["seed"]]["final_eval"] for r in runs]
            m, lo, hi = mean_ci(d)
            drops = sum(r.get("max_drop", 0.0) >= 0.2 for r in runs)
            eq = equivalent(d, margin)
            kl = sum(r["final_kl_to_base"] for r in runs) / len(runs)
            kl_on = sum(on[r["setup"]["seed"]]["final_kl_to_base"] for r in runs) / len(runs)
            if (m < -margin and hi < 0) or drops >= 3:
                verdict = "degrades"
            elif eq and kl_on > 0 and kl >= 0.7 * kl_on:
                verdict = "holds"
            elif eq:
                verdict = "equivalent but moved < 70% as far (slowed, not shown to hold)"
            else:
                verdict = "undecided"
            lines.append(f"| {loss} | {e} | {len(d)} | {m:+.3f} ({lo:+.3f}, {hi:+.3f}) | {drops} | "
                         f"{'yes' if eq else 'not shown'} | {kl:.4f} "
                         f"({f'{kl / kl_on:.2f}x' if kl_on > 0 else 'on-policy 0'}) | {verdict} |")
    return "\n".join(lines)


def _plot(by: dict, losses_: list, etas: list, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(losses_), figsize=(4 * len(losses_), 3.2), sharey=True, squeeze=False)
    for ax, loss in zip(axes[0], losses_):
        for eta in etas:
            runs = [r for k, r in by.items() if k[0] == loss and k[1] == eta]
            if not runs:
                continue
            steps = [s for s, _ in runs[0]["evals"]]
            mean = [sum(r["evals"][i][1] for r in runs) / len(runs) for i in range(len(steps))]
            ax.plot(steps, mean, label=f"eta {eta} ({len(runs)} seeds)")
        ax.set_title(loss)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("greedy eval (mean over seeds)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ---------------------------------------------------------------------------------------------------------------

def _seeds(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results file (jsonl, appended; finished runs are skipped)")
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--etas", default=",".join(map(str, ETAS)))
    p.add_argument("--seeds", default="0-7", help="e.g. 0-7 or 8,9,10; seed s runs on base s %% 2")
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--lr", type=float, default=Setup.lr)
    p.add_argument("--grad-clip", type=float, default=Setup.grad_clip)
    p.add_argument("--max-digits", type=int, default=Setup.max_digits, help="the task's longest number")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--base-dir", default=os.path.join(ROOT, "runs", "staleness_bases"))
    p.add_argument("--summary", action="store_true", help="print the tables of --out (and draw --png) and stop")
    p.add_argument("--png", default=None)
    p.add_argument("--summary-seeds", default=None, help="--summary of these seeds only (e.g. 0-3), to compare seed sets")
    p.add_argument("--margin", type=float, default=0.05, help="equivalence margin of the first experiment's table")
    p.add_argument("--lr-scan", default=None, metavar="LRS",
                   help="on-policy (naive, eta 0) on seed 0 at each of these learning rates (e.g. 1e-4,2e-4,4e-4): "
                        "the largest whose eval still rises steadily to the last step, halved, is the pilot's")
    p.add_argument("--scan-seeds", default="0", help="--lr-scan on these seeds (seed s on base s %% 2)")
    p.add_argument("--pilot", action="store_true",
                   help="the gate before a sweep: on-policy and naive at the largest --etas, seeds 0-1 (one on each "
                        "base), at --lr and --grad-clip; prints the gate table and whether it is met")
    p.add_argument("--quick", action="store_true", help="a few steps of a smaller setup (seconds), for tests")
    a = p.parse_args(argv)
    etas = [int(e) for e in a.etas.split(",")]
    if a.summary:
        print(summary(a.out, a.margin, a.png, _seeds(a.summary_seeds) if a.summary_seeds else None))
        print()
        print(outcomes(a.out, max(etas)))
        return
    base_setup = Setup(steps=a.steps, lr=a.lr, grad_clip=a.grad_clip, max_digits=a.max_digits)
    if a.quick:
        base_setup = replace(base_setup, steps=4, eval_every=2, eval_prompts=16, prompts_per_step=2,
                             samples_per_prompt=4, min_digits=1, max_digits=3, scratch=2, max_new=8, hidden=32,
                             layers=1, base_pass=(0.1, 1.0), probe_prompts=4)
    names = a.losses.split(",")
    for name in names:
        if name not in LOSSES:
            p.error(f"--losses: '{name}' is unknown; accepted: {', '.join(LOSSES)}")
    if a.lr_scan:
        setups = [replace(base_setup, loss="naive", eta=0, seed=seed, base_seed=seed % 2, lr=float(lr))
                  for seed in _seeds(a.scan_seeds) for lr in a.lr_scan.split(",")]
    elif a.pilot:
        setups = [replace(base_setup, loss="naive", eta=eta, seed=seed, base_seed=seed % 2)
                  for seed in (0, 1) for eta in (0, max(etas))]
    else:  # eta 0 is one on-policy run per seed, shared by every loss (ETA0_IS)
        setups = [replace(base_setup, loss=loss, eta=eta, seed=seed, base_seed=seed % 2)
                  for seed in _seeds(a.seeds) for eta in etas for loss in names
                  if eta > 0 or loss not in ETA0_IS]
        if 0 in etas and any(n in ETA0_IS for n in names) and "naive" not in names:
            setups += [replace(base_setup, loss="naive", eta=0, seed=seed, base_seed=seed % 2)
                       for seed in _seeds(a.seeds)]
        # the cells the pre-registered outcomes read first (eta 0 and the largest), then the rest: a sweep cut short
        # still answers its main question
        setups.sort(key=lambda x: (x.eta not in (0, max(etas)), x.seed))
    bases = {b: make_base(replace(base_setup, base_seed=b), a.base_dir) for b in sorted({x.base_seed for x in setups})}
    if a.quick:
        todo = [x for x in setups if _key(asdict(x)) not in _done(a.out)]
        print(f"[sweep] {len(setups) - len(todo)} of {len(setups)} runs already in {a.out}; {len(todo)} to go")
        for x in todo:  # in this process: seconds
            result = run(x, bases[x.base_seed])
            with open(a.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    else:
        sweep(setups, bases, a.out, a.workers)
    if a.pilot:
        table, ok = pilot_gate(a.out, max(etas))
        print(table)
        print(f"[pilot] gate {'MET' if ok else 'NOT met'}")
        if a.png:
            plot_pilot(a.out, max(etas), a.png)
    elif not a.lr_scan:
        print(summary(a.out, a.margin, a.png))
        print()
        print(outcomes(a.out, max(etas)))


if __name__ == "__main__":
    main()
