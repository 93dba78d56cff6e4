"""plot.py: metrics.jsonl of a run -> a PNG: reward, eval, step-time breakdown, buffer, recycling, staleness.

    python plot.py RUN_DIR [--out PNG] [--dpi N]      # also: python train.py plot RUN_DIR
"""
from __future__ import annotations

import argparse
import json
import os


def plot_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="plot.py", description="metrics.jsonl of a run -> a PNG")
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    p.add_argument("--dpi", type=int, default=100, help="resolution (the README's figure: 60)")
    a = p.parse_args(argv)
    path = os.path.join(a.run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"error: {path} does not exist; give the run_dir of a run")
    out = plot(path, a.out or os.path.join(a.run_dir, "metrics.png"), a.dpi)
    print(f"wrote {out}")


# One quantity per panel (its unit on the y axis). A metric logged on fewer than half of the steps (eval,
# checkpoints, recycling at the boundary) is drawn as points: a line between them would invent values.
PLOT_PANELS = [
    ("reward", ["rollout/reward_mean", "train/reward_mean", "eval/reward_mean"]),
    ("eval exact answers (fraction)", ["eval/exact_ratio"]),
    ("seconds per step", ["timing/step", "timing/train", "timing/rollout", "timing/pause_delay",
                          "timing/update_weights", "timing/save_ckpt", "timing/eval"]),
    ("prompt groups", ["rollout/pipeline_buf_size", "rollout/filter_drop", "rollout/restored_groups"]),
    ("trajectories at the step boundary", ["rollout/partial_restored_count",
                                           "rollout/partial_dropped_incomplete_count"]),
    ("weight versions behind", ["rollout/staleness_mean", "rollout/staleness_max", "rollout/partial_span_max"]),
    ("fraction", ["rollout/partial_ratio", "perf/wait_ratio"]),
]


def plot(metrics_path: str, out: str, dpi: int = 100) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    panels = [(t, [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)])
              for t, keys in PLOT_PANELS]
    panels = [(t, keys) for t, keys in panels if keys]
    cols = 2
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(12, 3.2 * ((len(panels) + 1) // cols)),
                             squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
            if 2 * len(pts) < len(rows):
                ax.plot(*zip(*pts), label=k, linestyle="none", marker="o", markersize=3)
            else:
                ax.plot(*zip(*pts), label=k, marker="." if len(pts) < 50 else None, linewidth=1)
        ax.set_ylabel(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


if __name__ == "__main__":
    plot_main(__import__("sys").argv[1:])
