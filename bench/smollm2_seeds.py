"""bench/smollm2_seeds.py: configs/smollm2.yaml (SmolLM2-135M-Instruct learning the add task on the CPU) over seeds,
one run after another, and what the runs show: the table and the figure of docs/results/smollm2.md.

Seed S runs `torchrun --standalone --nproc_per_node 2 train.py --config configs/smollm2.yaml seed=S
data_source.seed=S run_dir=RUNS/seedS` (data_source.seed gives each seed its own training order and held-out split);
the launch time is kept in RUNS/seedS/launch.json, so every time here counts from the launch (start-up and the
step-0 eval included). A seed whose run finished (launch.json has its exit code) is not run again; --summarise only
reads.

Printed per seed, from its metrics.jsonl: the greedy eval (eval/reward_mean on the held-out prompts) at step 0, its
best and its last, each with a 95% Wilson interval over the prompts; the gain at the last eval; the first eval >=
step 0's + --gain, by step and minutes since launch; the largest fall of an eval below an earlier one (the "held"
test: at most --drop); the run's wall time. Then the mean of each over the seeds with its 95% t-interval, and whether
every seed met the target (the gain within --minutes, and held). The figure: every seed's eval by step and by minutes.

--base measures the gate before any run: the base model's pass rate on the held-out prompts of --seeds' first seed,
greedy and sampled at the config's temperature, and the lengths of its answers (what max_new_tokens cuts).

Run (from the repository root, after `python -m models.smollm2 --out runs/smollm2`; ~12.5 min a seed on 2 cores):
    python bench/smollm2_seeds.py [--seeds 0 1 2] [--runs runs/smollm2_seeds] [--png docs/results/smollm2.png]
                                  [--summarise] [KEY=VALUE ...]   # config overrides for every seed
    python bench/smollm2_seeds.py --base [--seeds 0] [--samples 2] [--budget 64] [KEY=VALUE ...]   # ~10-20 min
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from staleness_experiment import mean_ci, wilson  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_seed(seed: int, run_dir: str, overrides: list[str]) -> None:
    """One run of the config (unless it finished before), its launch time and exit code in run_dir/launch.json."""
    marker = os.path.join(run_dir, "launch.json")
    if os.path.isfile(marker) and "returncode" in json.load(open(marker)):
        print(f"[smollm2_seeds] seed {seed}: {run_dir} ran before, not run again", flush=True)
        return
    os.makedirs(run_dir, exist_ok=True)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2",
           "train.py", "--config", "configs/smollm2.yaml", f"seed={seed}", f"data_source.seed={seed}",
           f"run_dir={run_dir}", *overrides]
    launch = {"time": time.time(), "command": " ".join(["torchrun", *cmd[1:]])}
    json.dump(launch, open(marker, "w"))
    print(f"[smollm2_seeds] seed {seed}: {launch['command']}", flush=True)
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        launch["returncode"] = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    launch["wall_s"] = time.time() - launch["time"]
    json.dump(launch, open(marker, "w"))
    if launch["returncode"] != 0:
        raise SystemExit(f"error: seed {seed} exited {launch['returncode']}; see {run_dir}/stdout.log")


def evals(run_dir: str) -> tuple[list[tuple[int, float, float, int]], float]:
    """[(step, minutes since launch, eval/reward_mean, number of eval prompts)] of a run, and its wall time (s)."""
    launch = json.load(open(os.path.join(run_dir, "launch.json")))
    n = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))["data_source"]["num_eval_prompts"]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    out = [(r["step"], (r["time"] - launch["time"]) / 60, r["eval/reward_mean"], n)
           for r in rows if "eval/reward_mean" in r]
    return out, launch.get("wall_s", rows[-1]["time"] - launch["time"])


def _p(k_n: tuple[float, int]) -> str:
    """A pass rate with its 95% Wilson interval over the n prompts."""
    p, n = k_n
    lo, hi = wilson(round(p * n), n)
    return f"{p:.3f} ({lo:.2f}-{hi:.2f})"


def summarise(seeds: list[int], runs: str, gain: float, minutes: float, drop: float, png: str | None) -> str:
    lines = [f"| seed | eval at step 0 | best | last | gain at the last | first >= step 0 + {gain:.2f} | largest fall "
             "below an earlier eval | run (min) |", "|---|---|---|---|---|---|---|---|"]
    per, curves, met = [], {}, True
    for s in seeds:
        ev, wall = evals(os.path.join(runs, f"seed{s}"))
        curves[s] = ev
        start = ev[0][2]
        ib = max(range(len(ev)), key=lambda i: ev[i][2])
        hit = next((e for e in ev if e[2] >= start + gain - 1e-9), None)
        fall = max(max(e[2] for e in ev[:i]) - ev[i][2] for i in range(1, len(ev))) if len(ev) > 1 else 0.0
        met &= hit is not None and hit[1] <= minutes and fall <= drop
        per.append((start, ev[ib][2], ev[-1][2], ev[-1][2] - start, hit[1] if hit else float("nan"), wall / 60))
        reach = f"step {hit[0]}, {hit[1]:.1f} min" if hit else "not reached"
        lines.append(f"| {s} | {_p(ev[0][2:])} | {_p(ev[ib][2:])} at step {ev[ib][0]} | {_p(ev[-1][2:])} | "
                     f"{ev[-1][2] - start:+.3f} | {reach} | {max(fall, 0.0):.3f} | {wall / 60:.1f} |")
    if len(seeds) > 1:
        cells = [f"{m:{'+' if i == 3 else ''}.3f} ({lo:.2f} to {hi:.2f})" if i < 4 else
                 f"{m:.1f} ({lo:.1f} to {hi:.1f}){' min' if i == 4 else ''}"
                 for i, (m, lo, hi) in enumerate(mean_ci(list(c)) for c in zip(*per))]
        lines.append(f"| mean (95% t-interval over seeds) | {' | '.join(cells[:5])} | | {cells[5]} |")
    lines.append(f"\nTarget (+{gain:.2f} within {minutes:g} min of the launch, no eval more than {drop:g} below an "
                 f"earlier one): {'met by every seed' if met else 'NOT met by every seed'}.")
    if png:
        _figure(curves, png)
        lines.append(f"wrote {png}")
    return "\n".join(lines)


def _figure(curves: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for s, ev in curves.items():
        steps, mins, rates, _ = zip(*ev)
        axes[0].plot(steps, rates, marker="o", markersize=3, label=f"seed {s}")
        axes[1].plot(mins, rates, marker="o", markersize=3, label=f"seed {s}")
    for ax, x in zip(axes, ("step", "minutes since launch (2-core CPU)")):
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("greedy eval (held-out pass rate)")
    fig.suptitle("configs/smollm2.yaml: SmolLM2-135M-Instruct, task add, fully-async", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)


def base_rates(seed: int, samples: int, budget: int, overrides: list[str], batch: int = 64) -> str:
    """The base model's pass rate on the config's held-out prompts (data_source.seed=seed), greedy and sampled at
    the config's temperature (`samples` a prompt), and its answers' lengths in tokens (eos included): generated up to
    `budget` tokens, so what the config's max_new_tokens cuts is seen; a response the config would cut scores 0, as
    last_number scores it. HF generate with the weights the engine serves (the same transformers model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import config as config_lib
    import tasks

    cfg = config_lib.load_config(os.path.join(ROOT, "configs", "smollm2.yaml"), [f"data_source.seed={seed}", *overrides])
    ds, sampling = cfg.data_source[0], cfg.rollout.sampling
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    prompts = tasks.load_prompts(ds, tok, "eval")
    reward, stop = tasks.get_reward_fn(tasks.default_reward(ds.task)), tasks.stop_token_ids(tok, cfg.model.path)
    torch.manual_seed(seed)
    lines = [f"base model {cfg.model.path}, {len(prompts)} held-out prompts of task {ds.task} (data_source.seed="
             f"{seed}), generated up to {budget} tokens; the config cuts at max_new_tokens={sampling.max_new_tokens}"]
    for name, temperature, k in (("greedy", 0.0, 1), (f"sampled at temperature {sampling.temperature}",
                                                      sampling.temperature, samples)):
        scored, lengths = [], []
        for i in range(0, len(prompts), batch):
            part = [p for p in prompts[i:i + batch] for _ in range(k)]
            width = max(len(p["prompt_ids"]) for p in part)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(p["prompt_ids"])) + p["prompt_ids"] for p in part])
            # left padding, masked by length: the pad id is <|im_end|>, which the prompts hold too
            mask = torch.tensor([[0] * (width - len(p["prompt_ids"])) + [1] * len(p["prompt_ids"]) for p in part])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask,
                                     max_new_tokens=budget, do_sample=temperature > 0,
                                     temperature=temperature or None, top_p=None, top_k=None,
                                     eos_token_id=stop, pad_token_id=tok.pad_token_id)
            for p, row in zip(part, out[:, width:].tolist()):
                end = next((j for j, t in enumerate(row) if t in stop), None)
                n = len(row) if end is None else end + 1  # eos counted: max_new_tokens must hold it
                stopped = end is not None and n <= sampling.max_new_tokens
                scored.append(reward(tok.decode(row[:n if end is None else end]), p["label"], stopped))
                lengths.append((n if end is not None else budget + 1, scored[-1]))
        hits = sum(scored)
        lo, hi = wilson(round(hits), len(scored))
        cut = sum(n > sampling.max_new_tokens for n, _ in lengths) / len(lengths)
        right = sorted(n for n, r in lengths if r)
        pct = sorted(n for n, _ in lengths)
        lines.append(f"  {name}: pass rate {hits / len(scored):.3f} (95% Wilson {lo:.3f}-{hi:.3f}, n={len(scored)}"
                     f"{f' = {samples} x {len(prompts)}' if k > 1 else ''}); lengths p50 {pct[len(pct) // 2]}, p90 "
                     f"{pct[int(0.9 * len(pct))]} ({budget + 1} = not ended within {budget}); cut at "
                     f"{sampling.max_new_tokens}: {cut:.0%}; the right answers' lengths: min {right[0] if right else '-'}"
                     f", p50 {right[len(right) // 2] if right else '-'}, max {right[-1] if right else '-'}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs", default="runs/smollm2_seeds", help="one run_dir per seed under it: seedS")
    p.add_argument("--png", default=None, help="the figure (docs/results/smollm2.png)")
    p.add_argument("--summarise", action="store_true", help="read the runs only, run nothing")
    p.add_argument("--base", action="store_true", help="only the base model's pass rates and answer lengths")
    p.add_argument("--samples", type=int, default=2, help="--base: sampled answers per held-out prompt")
    p.add_argument("--budget", type=int, default=64, help="--base: tokens generated per answer at most")
    p.add_argument("--gain", type=float, default=0.40, help="the target gain over step 0's eval")
    p.add_argument("--minutes", type=float, default=15.0, help="within this many minutes of launch")
    p.add_argument("--drop", type=float, default=0.10, help="no later eval more than this below the best")
    a, overrides = p.parse_known_args(argv)
    if a.base:
        return print(base_rates(a.seeds[0], a.samples, a.budget, overrides))
    if not a.summarise:
        for s in a.seeds:
            run_seed(s, os.path.join(a.runs, f"seed{s}"), overrides)
    print(summarise(a.seeds, a.runs, a.gain, a.minutes, a.drop, a.png))


if __name__ == "__main__":
    main()
