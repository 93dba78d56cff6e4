"""bench/policies.py: every staleness policy learning the CPU default side by side (configs/tiny.yaml, train.py).

Each preset of strategies.py (areal, verl, pipelinerl, prime-rl, roll, slime-async) and the configured baseline
(windowed-fifo, stale_steps 1) runs `torchrun train.py --config configs/tiny.yaml` for the same steps, one after the
other, with the update-time action its rule takes (rollout.pause_mode in_place for pipelinerl and prime-rl, abort
otherwise) and its peer's loss (strategies.peer_overrides; tiny.yaml's off-policy mask stays on for slime-async
only). With --stale 1,2,4 a preset whose knob scales the staleness runs once per level (areal eta, verl s,
pipelinerl max_lag = k B N, roll alpha, slime-async C = k B; prime-rl's lead is fixed at one step and its M only
bounds what is dropped, so it runs at M = 1 only). Printed per run: greedy eval reward at the --eval-every steps,
wall time, staleness mean / max of the trained trajectories and the samples dropped (filter drops, which every rule
has on this task, counted apart). A plot of eval against wall time per run.

What this measures: one seed per run on a shared CPU, whose load moves the wall times; the eval of a policy in
training moves by a few hundredths between evaluations (README). Read differences of ~0.05 as noise.

Run (about 2-5 minutes per run of 100 steps on a 2-core machine, more under load):
    python bench/policies.py [--steps 100] [--eval-every 25] [--stale 1,2,4] [--only areal,roll]
                             [--json runs/policies/learning.json] [--png docs/policies_learning.png]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import strategies  # noqa: E402

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
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


def runs(stale_levels: list[int], only: list[str] | None, B: int, N: int) -> list[tuple[str, list[str]]]:
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
        return {"name": name, "error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "failed"}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    start = rows[0]["time"]
    evals = {r["step"]: (r["eval/reward_mean"], r["time"] - start) for r in rows if "eval/reward_mean" in r}
    steps = [r for r in rows if r["step"] > 0]
    N = args.N
    return {"name": name, "overrides": overrides, "wall_s": wall, "evals": evals,
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


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        if "error" in r:
            continue
        pts = sorted((int(k), v) for k, v in r["evals"].items())
        ax.plot([v[1] / 60 for _, v in pts], [v[0] for _, v in pts], marker="o", ms=3, label=r["name"],
                linewidth=2.2 if r["name"].startswith("windowed-fifo") else 1.2)
    ax.set_xlabel("wall time since the first eval (min)")
    ax.set_ylabel("greedy eval reward (128 prompts)")
    ax.set_title("configs/tiny.yaml per staleness policy (one seed each, shared CPU)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="training steps per run")
    ap.add_argument("--eval-every", type=int, default=25, help="greedy eval every this many steps")
    ap.add_argument("--stale", default="1", help="staleness levels in steps, e.g. 1,2,4")
    ap.add_argument("--only", default=None, help="comma-separated presets (and/or windowed-fifo)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "policies"), help="run directories go here")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--png", default=None, help="eval against wall time (default: OUT/learning.png)")
    args = ap.parse_args(argv)
    import config
    cfg = config.load_config(TINY)
    args.N = cfg.N
    args.model = os.path.join(args.out, "tiny-base")  # one base for every run, made by the first one
    only = args.only.split(",") if args.only else None
    plan = runs([int(x) for x in args.stale.split(",")], only, cfg.B, cfg.N)
    print(f"{len(plan)} runs of {args.steps} steps, eval every {args.eval_every}; load average at start "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    results = []
    for name, overrides in plan:
        r = run_one(name, overrides, args)
        results.append(r)
        print(f"  {name}: " + (r.get("error") or f"{r['wall_s']:.0f} s, eval {r['evals']}"), flush=True)
    eval_steps = sorted({0, *range(args.eval_every, args.steps + 1, args.eval_every), args.steps})
    print()
    print(table(results, eval_steps))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    png = args.png or os.path.join(args.out, "learning.png")
    plot(results, png)
    print(f"figure: {png}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
