"""bench/policies.py: staleness in the real trainer (configs/tiny.yaml, train.py under torchrun).

Two experiments, each run as `torchrun train.py --config configs/tiny.yaml` once per row, one after the other.

--table3 (the default): AReaL's Table 3 asked on the CPU default. The areal preset at eta = 0, 1 and 4 with its
peer's loss (decoupled PPO, algorithm.policy_loss=decoupled_ppo), and at eta = 4 without correction (naive PPO: the
ratio taken against the behaviour policy, trainer.use_rollout_log_probs=true, no IS weight), --seeds seeds each.
Generation is forced ahead of training so that staleness is real: rollout.filter=[failed] (tiny.yaml's
all_equal_reward filter makes generation the bottleneck early on, ~90% of the base's groups are dropped), which
alone puts the measured staleness at the bound (3.9 at eta = 4); --micro-batch-tokens slows training further if a
machine needs it (more, smaller micro-batches: the same gradient, a slower step).
Measured per step and plotted against the step (never against wall time): the trained batch's reward
(train/reward_mean, every group of the step, the filter being off), rollout/staleness_mean and _max, the IS weights
(train/is_*) and train/approx_kl; the greedy eval at the last step. Means over the seeds with 95% t-intervals.

--presets: every preset of strategies.py at the knob for --stale steps of staleness with its peer's loss and mask
(strategies.peer_overrides) and the configured windowed-fifo baseline, one seed each, greedy eval per --eval-every.

Run (--table3: 12 rows of 150 steps, 56-93 s each, 13 min 22 s in all on a quiet 2-core machine):
    python bench/policies.py [--table3] [--steps 150] [--seeds 3] [--etas 0,1,4] [--micro-batch-tokens 512]
                             [--json runs/policies/table3.json] [--png docs/results/areal_table3.png]
    python bench/policies.py --presets [--steps 100] [--eval-every 25] [--stale 1,2,4] [--only areal,roll]
    python bench/policies.py --replot runs/policies/table3.json --png docs/results/areal_table3.png
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import strategies  # noqa: E402
from learning_sim import ci as _ci  # noqa: E402  (mean, 95% t half-width over seeds)

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SERIES = ("train/reward_mean", "rollout/staleness_mean", "rollout/staleness_max", "train/is_mean", "train/is_min",
          "train/is_max", "train/is_masked_frac", "train/approx_kl", "train/clip_ratio", "timing/step")
POLICY_DROPS = ("rollout/staleness_drop", "rollout/policy_drop", "rollout/update_dropped_groups",
                "rollout/partial_dropped_incomplete_groups")  # groups lost to the staleness rule, not the filter


def _port() -> int:
    """A free port below the ephemeral range (20000-30000), for the engine and the weight-sync group."""
    import random
    for _ in range(200):
        p = random.randint(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port in 20000-30000")


def preset_plan(stale_levels: list[int], only: list[str] | None, B: int, N: int) -> list[tuple[str, list[str]]]:
    """(name, overrides) per run: the baseline, then each preset at each staleness level its knob allows."""
    out = [("windowed-fifo-s1", [])] if not only or "windowed-fifo" in only else []
    for name in strategies.PRESETS:
        if only and name not in only:
            continue
        cls = strategies.REGISTRY[name]
        action = (cls.actions or cls(B, B, None, N).actions)[0]
        _, pause_mode = action.rollout_settings
        for k in stale_levels if cls.staleness_knob else [1]:
            param = cls.default(B, N) * k if name in ("pipelinerl", "slime-async") else float(k)
            out.append((f"{name}-s{k}", ["fully_async.stale_steps=0", f"fully_async.sliding_window={name}",
                                         f"fully_async.policy_param={param:g}", f"rollout.pause_mode={pause_mode}",
                                         *strategies.peer_overrides(name)]))  # the peer's loss and mask
    return out


def table3_plan(etas: list[int], seeds: int, micro_batch_tokens: int | None) -> list[tuple[str, list[str]]]:
    """(name, overrides) per run: areal at each eta with decoupled PPO, then at the largest eta with naive PPO."""
    forced = ["fully_async.stale_steps=0", "fully_async.sliding_window=areal", "rollout.pause_mode=abort",
              "rollout.filter=[failed]", *([f"trainer.micro_batch_tokens={micro_batch_tokens}"] if micro_batch_tokens
                                           else [])]
    naive = ["algorithm.policy_loss=ppo", "trainer.use_rollout_log_probs=true", "algorithm.is_correction.enable=false",
             "rollout.mask_offpolicy_in_partial_rollout=false"]
    out = []
    for seed in range(seeds):
        s = [f"seed={seed}", f"data_source.seed={seed}"]
        for eta in etas:
            out.append((f"areal-eta{eta}-s{seed}", [*forced, f"fully_async.policy_param={eta}",
                                                    *strategies.peer_overrides("areal"), *s]))
        out.append((f"areal-eta{max(etas)}-naive-s{seed}", [*forced, f"fully_async.policy_param={max(etas)}", *naive,
                                                            *s]))
    return out


def run_one(name: str, overrides: list[str], args) -> dict:
    run_dir = os.path.join(args.out, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py",
           "--config", TINY, f"run_dir={run_dir}", f"model.path={args.model}", f"rollout.base_port={_port()}",
           f"weight_sync.master_port={_port()}", f"trainer.total_steps={args.steps}",
           f"trainer.eval_freq={args.eval_every}", "trainer.save_freq=0", "trainer.export_hf=false", *overrides]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"name": name, "overrides": overrides, "error": tail[-1] if tail else f"exit {p.returncode}"}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    start = rows[0]["time"]
    evals = {r["step"]: (r["eval/reward_mean"], r["time"] - start) for r in rows if "eval/reward_mean" in r}
    steps = [r for r in rows if r["step"] > 0]
    N = args.N
    series = {k: [r.get(k) for r in steps] for k in SERIES}
    return {"name": name, "overrides": overrides, "wall_s": wall, "evals": evals, "series": series,
            "staleness_mean": sum(r.get("rollout/staleness_mean", 0.0) for r in steps) / max(1, len(steps)),
            "staleness_max": max((r.get("rollout/staleness_max", 0) for r in steps), default=0),
            "dropped_samples": N * sum(r.get(k, 0) for r in steps for k in POLICY_DROPS),
            "filter_dropped_samples": N * sum(r.get("rollout/filter_drop", 0) for r in steps),
            "step_s": sum(r["timing/step"] for r in steps) / max(1, len(steps))}


def table(results: list[dict], eval_steps: list[int]) -> str:
    cols = ["run", *[f"eval @ {s}" for s in eval_steps], "train wall (min)", "s / step", "staleness mean / max",
            "samples dropped (staleness rule)", "samples dropped (filter)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * len(cols)) + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} |" + " - |" * (len(cols) - 2))
            continue
        ev = {int(k): v for k, v in r["evals"].items()}
        last = ev[max(ev)][1]
        lines.append("| " + " | ".join([r["name"], *[f"{ev[s][0]:.3f}" if s in ev else "-" for s in eval_steps],
                                        f"{last / 60:.1f}", f"{r['step_s']:.2f}",
                                        f"{r['staleness_mean']:.2f} / {r['staleness_max']}",
                                        str(r["dropped_samples"]), str(r["filter_dropped_samples"])]) + " |")
    return "\n".join(lines)


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def config_of(name: str) -> str:
    return name.rsplit("-s", 1)[0]


def table3_rows(results: list[dict], window: int) -> list[dict]:
    """One row per configuration: per-seed figures, then their means with 95% intervals over the seeds."""
    by: dict = {}
    for r in results:
        by.setdefault(config_of(r["name"]), []).append(r)
    rows = []
    for cfg_name, rs in by.items():
        ok = [r for r in rs if "error" not in r]
        row = {"config": cfg_name, "seeds": len(ok), "errors": [r["error"] for r in rs if "error" in r]}
        if ok:
            s = [r["series"] for r in ok]
            row["reward_last"] = _ci([_mean(x["train/reward_mean"][-window:]) for x in s])
            row["reward_first"] = _ci([_mean(x["train/reward_mean"][:window]) for x in s])
            row["eval_final"] = _ci([r["evals"][max(r["evals"], key=int)][0] for r in ok])
            for key, out in (("rollout/staleness_mean", "staleness"), ("train/is_mean", "is_mean"),
                             ("train/is_masked_frac", "is_masked"), ("train/approx_kl", "approx_kl"),
                             ("train/clip_ratio", "clip_ratio")):
                row[out] = _ci([_mean(x[key][1:]) for x in s])
            row["staleness_max"] = max(max(v for v in x["rollout/staleness_max"] if v is not None) for x in s)
            row["is_max"] = max(max((v for v in x["train/is_max"] if v is not None), default=0) for x in s)
            row["is_min"] = min(min((v for v in x["train/is_min"] if v is not None), default=1) for x in s)
            row["min_reward_last"] = min(_mean(x["train/reward_mean"][-window:]) for x in s)
        rows.append(row)
    return rows


def table3_table(rows: list[dict], steps: int, window: int) -> str:
    pm = lambda c, f="{:.3f}": f"{f.format(c[0])} +- {f.format(c[1])}"  # noqa: E731
    cols = ["run", "seeds", "staleness mean (max)", f"trained reward, steps 1-{window}",
            f"trained reward, last {window} steps", f"greedy eval @ {steps}", "IS weight mean [min, max]",
            "IS masked", "approx KL", "clip ratio"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * len(cols)) + "|"]
    for r in rows:
        if not r["seeds"]:
            lines.append(f"| {r['config']} | 0 | failed: {r['errors'][0]} |" + " - |" * (len(cols) - 3))
            continue
        lines.append("| " + " | ".join([
            r["config"], str(r["seeds"]), f"{pm(r['staleness'], '{:.2f}')} ({r['staleness_max']})",
            pm(r["reward_first"]), pm(r["reward_last"]), pm(r["eval_final"]),
            f"{r['is_mean'][0]:.3f} [{r['is_min']:.2f}, {r['is_max']:.2f}]" if math.isfinite(r["is_mean"][0])
            else "- (off)",
            f"{r['is_masked'][0]:.4f}" if math.isfinite(r["is_masked"][0]) else "-",
            f"{r['approx_kl'][0]:.2e}", f"{r['clip_ratio'][0]:.3f}"]) + " |")
    return "\n".join(lines)


def plot_table3(results: list[dict], path: str, smooth: int = 10) -> None:
    """Trained reward against the step: per configuration the seeds' mean (each seed smoothed over `smooth` steps)
    with its 95% t-interval band; below, the staleness of the trained trajectories."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    by: dict = {}
    for r in results:
        if "error" not in r:
            by.setdefault(config_of(r["name"]), []).append(r["series"])
    fig, (a, b) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    for name, ss in by.items():
        n = min(len(s["train/reward_mean"]) for s in ss)
        w = min(smooth, n)
        k = np.ones(w) / w
        ys = np.array([np.convolve(np.array(s["train/reward_mean"][:n], float), k, "valid") for s in ss])
        x = np.arange(w, n + 1)
        m = ys.mean(0)
        h = np.array([_ci(list(col))[1] for col in ys.T])
        line, = a.plot(x, m, label=f"{name} ({len(ss)} seeds)", lw=1.4, ls="--" if "naive" in name else "-")
        a.fill_between(x, m - h, m + h, color=line.get_color(), alpha=0.18)
        st = np.array([np.array(s["rollout/staleness_mean"][:n], float) for s in ss]).mean(0)
        b.plot(np.arange(1, n + 1), st, color=line.get_color(), lw=1.0, ls=line.get_linestyle())
    a.set_ylabel(f"trained batch reward ({smooth}-step mean)")
    a.set_title("configs/tiny.yaml, generation forced ahead: areal, decoupled PPO vs naive PPO\n"
                "(mean over seeds, band: 95% t-interval)", fontsize=9)
    a.legend(fontsize=7)
    b.set_ylabel("staleness mean")
    b.set_xlabel("training step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot(results: list[dict], path: str) -> None:
    """--presets: greedy eval against the training step, one line per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        if "error" in r:
            continue
        pts = sorted((int(k), v) for k, v in r["evals"].items())
        ax.plot([s for s, _ in pts], [v[0] for _, v in pts], marker="o", ms=3, label=r["name"],
                linewidth=2.2 if r["name"].startswith("windowed-fifo") else 1.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("greedy eval reward (128 prompts)")
    ax.set_title("configs/tiny.yaml per staleness policy (one seed each)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--table3", action="store_true", help="areal at --etas, decoupled vs naive PPO (the default)")
    mode.add_argument("--presets", action="store_true", help="every preset at --stale, one seed each")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (150 --table3, 100 --presets)")
    ap.add_argument("--seeds", type=int, default=3, help="--table3: seeds per configuration")
    ap.add_argument("--etas", default="0,1,4", help="--table3: areal's eta levels (naive PPO at the largest)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="--table3: trainer.micro_batch_tokens, to slow training further (default: tiny.yaml's)")
    ap.add_argument("--window", type=int, default=25, help="--table3: steps averaged for the table's rewards")
    ap.add_argument("--eval-every", type=int, default=None, help="greedy eval every this many steps")
    ap.add_argument("--stale", default="1", help="--presets: staleness levels in steps, e.g. 1,2,4")
    ap.add_argument("--only", default=None, help="--presets: comma-separated presets (and/or windowed-fifo)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "policies"), help="run directories go here")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--png", default=None, help="the figure (default: OUT/table3.png or OUT/learning.png)")
    ap.add_argument("--replot", default=None, help="--table3: redo the table and figure from this --json file")
    args = ap.parse_args(argv)
    table3 = not args.presets
    args.steps = args.steps or (150 if table3 else 100)
    args.eval_every = args.eval_every or (args.steps if table3 else 25)
    png = args.png or os.path.join(args.out, "table3.png" if table3 else "learning.png")
    t0 = time.monotonic()
    if args.replot:
        with open(args.replot) as f:
            results = json.load(f)
    else:
        import config
        cfg = config.load_config(TINY)
        args.N = cfg.N
        args.model = os.path.join(args.out, "tiny-base")  # one base for every run, made by the first one
        if table3:
            plan = table3_plan([int(x) for x in args.etas.split(",")], args.seeds, args.micro_batch_tokens)
        else:
            plan = preset_plan([int(x) for x in args.stale.split(",")], args.only.split(",") if args.only else None,
                               cfg.B, cfg.N)
        print(f"{len(plan)} runs of {args.steps} steps, eval every {args.eval_every}; load average at start "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
        results = []
        for name, overrides in plan:
            r = run_one(name, overrides, args)
            results.append(r)
            print(f"  {name}: " + (r.get("error") or f"{r['wall_s']:.0f} s, staleness mean "
                                   f"{r['staleness_mean']:.2f}, eval {r['evals']}"), flush=True)
        if args.json_path:
            os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
            with open(args.json_path, "w") as f:
                json.dump(results, f, indent=1)
    print()
    if table3:
        print(table3_table(table3_rows(results, args.window), args.steps, args.window))
        plot_table3(results, png)
    else:
        eval_steps = sorted({0, *range(args.eval_every, args.steps + 1, args.eval_every), args.steps})
        print(table(results, eval_steps))
        plot(results, png)
    print(f"figure: {png}; wall time {time.monotonic() - t0:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
