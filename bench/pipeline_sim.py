"""bench/pipeline_sim.py: the project's scheduler on a simulated 16-GPU cluster, against the ideal overlap bound.

What is real: the orchestration. Each configuration runs the project's own `buffer.PipelineServer` (+ the window
strategies), `rollout.Rollout` and `sglang_client.Fleet` (HTTP, pause / abort / restore / resume) and the trainer's step
loop `train.run_steps`, as threads of one process forked after the imports (train.py puts them in separate
processes joined by RPC; here there is no RPC hop).
What is simulated: the inference fleet (bench/sim_server.py, one port per replica, requests progress by the latency
model of docs/results/pipeline_sim.md) and the training compute (`SimActor`: 760 response tokens/s per training
GPU, weight update 10 s, colocate memory release 8 s + resume 8 s). Both run on a clock compressed `--compression`
times, so a 500 s step takes 500 / compression s of wall time; the real code's own time is scaled up with it, and
the per-phase table shows it ("overhead"; `--overhead-check` measures it from runs at two compressions).
The workload numbers are a model calibrated to the spec's experiment, not a measurement; step times are simulated
seconds.

The grid: the spec's configurations, a concurrency sweep, a split sweep of the 16 GPUs, and fifo-s2 at 8:8, 10:6 and
12:4 with in-flight weight updates (rollout.pause_mode=in_place: the step boundary keeps every request on the paused
servers instead of aborting, restoring and re-sending them).
Efficiency = ideal / achieved step time (steady state, step 0 excluded), where the ideal is
max(generated tokens / fleet peak throughput, trained tokens / training throughput + weight update). A server does not
decode while it takes new weights in, so a generation-bound configuration is also held to generation + update; the
acceptance lines print the efficiency against that bound too.

Simplifications of the harness: automatic garbage collection is off in each run and young objects are collected
inside the simulated training time (full collections of the shared interpreter stalled every thread, x compression);
torch uses one intra-op thread, as in the buffer process.

--sweep: the fair comparison. Every rule over its knob (k = 1, 2, 4 steps: stale_steps k for the spec's three, the
presets' knobs as bench/policies.py maps them) plus rows at the peers' own default knobs, at 8:8 and 10:6, each
--repeats times in alternating order, scored against one ideal per split (the expected tokens of a step of fresh
groups, the same for every rule, so a rule that throws tokens away does not raise its own bar); the figure plots
trained tokens per second against the measured mean staleness, so rules are compared at equal staleness, not at
equal knob values.

--policies: every staleness policy side by side (the spec's three strategies and the six peers' presets of
strategies.py), each with the parameter that allows one step of staleness, at 8:8 and 10:6, in one table: step time,
efficiency, staleness, off-policy tokens, tokens thrown away, samples dropped; and each run's prompt accounting
(dispatched = trained once + counted as dropped + still pending at the end).

--agentic: the agentic workload (episodes of several model turns, each but the last followed by a tool call of
log-normal latency that waits for one of rollout.env_max_concurrent sandboxes), rollout.async_max_concurrent_samples
at B N, 2 B N and 4 B N with and without rollout.partial, plus sensitivity rows, each over --seeds seeds with 95%
intervals. Unlike the modes above it is a discrete-event model: only the window rule (strategies.py) is the
project's code; the buffer's bounds, the boundary and the trainer are re-stated in it (section "The agentic
workload" below; docs/results/pipeline_sim.md, "Agentic episodes", gives the figures it assumes).

Run (7-9 minutes on 2 CPU cores, more on a loaded machine; --quick: a small grid in well under a minute):
    python bench/pipeline_sim.py [--quick] [--json out.json] [--png out.png] [--steps 9] [--compression 120]
    python bench/pipeline_sim.py --policies [--quick] [--steps 6]
    python bench/pipeline_sim.py --sweep [--levels 1,2,4] [--repeats 3] [--batch-scale 4] [--png docs/results/x.png]
    (the figure docs/results/pipeline_sim_sweep.png: --sweep --batch-scale 4 --levels 1,2,4 --repeats 3 --steps 5
    --compression 200 --json runs/pipeline_sweep.json --png docs/results/pipeline_sim_sweep.png: 174 runs,
    31 min 35 s of wall time on a quiet 2-core machine, load average 0.1)
    python bench/pipeline_sim.py --only colocate,fifo-s1 --workload my_workload.yaml
    python bench/pipeline_sim.py --overhead-check --only colocate,fifo-s2
    python bench/pipeline_sim.py --agentic --seeds 5 --steps 16 --warmup 4 --json runs/pipeline_sim_agentic.json
    --png docs/results/pipeline_sim_agentic.png (80 runs, ~2.5 min of CPU; [--turns 8] [--tool-median-s 24]
    [--tool-sigma 0.6] [--sandboxes 384] [--only "S=1BN partial;S=2BN partial, tool x4"] [--batch-scale 4])
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import requests  # noqa: E402

import config  # noqa: E402
import sim_server  # noqa: E402

SIMULATION_NOTE = ("Simulated: the inference fleet (bench/sim_server.py) and the training compute run a latency "
                   "model on a compressed clock; the orchestration (buffer, strategies, rollout producer, HTTP, "
                   "pause/abort/restore, train.run_steps) is the project's own code. The workload numbers are a "
                   "model calibrated to the spec (docs/results/pipeline_sim.md), not a measurement.")
TOTAL_GPUS = 16
# The spec's measured avg step excluding step 0 (docs/design.md, the reference experiment), for the
# side-by-side column.
SPEC_EXCL0 = {"colocate": 578.63, "colocate+partial": 486.34, "nowin-s1": 451.74, "fifo-s1": 424.30,
              "fifo-s2": 414.58}


@dataclass
class Setup:
    """One configuration of the grid."""
    name: str
    label: str  # as printed in the table
    section: str  # spec | concurrency | split
    train_gpus: int
    infer_gpus: int
    colocate: bool = False
    window: str = "windowed-fifo"
    stale: float = 1.0
    partial: bool = True
    oversample: int = 0
    max_concurrent: Optional[int] = None  # rollout.async_max_concurrent_samples
    pause_mode: str = "abort"  # rollout.pause_mode
    param: Optional[float] = None  # fully_async.policy_param of a preset (window is then the preset's name)

    @property
    def replicas(self) -> list[int]:
        """GPUs per inference replica: TP=4 replicas where the GPUs allow, else TP=2 (the workload model, 10:6)."""
        size = 4 if self.infer_gpus % 4 == 0 else 2
        return [size] * (self.infer_gpus // size)

    @property
    def resource(self) -> str:
        return str(TOTAL_GPUS) if self.colocate else f"{self.train_gpus}:{self.infer_gpus}"


def grid(quick: bool) -> list[Setup]:
    fa = dict(train_gpus=8, infer_gpus=8)
    spec = [
        Setup("colocate", "colocate", "spec", 16, 16, colocate=True, partial=False),
        Setup("colocate+partial", "colocate + partial (16 oversampled groups)", "spec", 16, 16, colocate=True,
              oversample=16),
        Setup("nowin-s1", "fully_async no-window, stale 1", "spec", window="no-window", **fa),
        Setup("fifo-s1", "fully_async windowed-fifo, stale 1", "spec", **fa),
        Setup("fifo-s2", "fully_async windowed-fifo, stale 2", "spec", stale=2.0, **fa),
        Setup("gated-s1", "fully_async window-gated, stale 1", "spec", window="window-gated", **fa),
    ]
    conc = [Setup(f"fifo-s1-conc{c}", f"windowed-fifo, stale 1, async_max_concurrent_samples {c}", "concurrency",
                  max_concurrent=c, **fa) for c in (128, 256, 512)]
    # The split sweep uses the spec's best configuration (windowed-fifo, stale 2); its 8:8 point is fifo-s2.
    split = [Setup(f"fifo-s2-{t}:{TOTAL_GPUS - t}", f"windowed-fifo, stale 2, split {t}:{TOTAL_GPUS - t}", "split",
                   t, TOTAL_GPUS - t, stale=2.0) for t in (6, 10, 12)]
    # The same configuration with in-flight weight updates (rollout.pause_mode=in_place) beside its abort rows.
    in_place = [Setup(f"fifo-s2-{t}:{TOTAL_GPUS - t}-inplace", f"windowed-fifo, stale 2, split {t}:{TOTAL_GPUS - t}, "
                      "pause_mode in_place", "in_place", t, TOTAL_GPUS - t, stale=2.0, pause_mode="in_place")
                for t in (8, 10, 12)]
    if quick:
        return [spec[0], spec[1], spec[3], conc[1], split[1], in_place[1]]
    return spec + conc + split + in_place


def one_step_param(name: str, B: int, N: int) -> tuple[Optional[float], str]:
    """The preset's knob that allows one step of staleness, and how the table states it."""
    import strategies
    cls = strategies.REGISTRY[name]
    value = cls.default(B, N)
    return value, f"{cls.param_name.split(' (')[0]} = {value:g}"


def policy_grid(quick: bool, B: int, N: int, splits=((8, 8), (10, 6))) -> list[Setup]:
    """Every policy at one step of staleness: the spec's three at stale_steps 1, the presets at their one-step knob,
    each with the update-time action its rule takes."""
    import strategies
    out = []
    for t, i in splits[:1] if quick else splits:
        if not quick:
            for window, short in (("no-window", "nowin"), ("window-gated", "gated"), ("windowed-fifo", "fifo")):
                out.append(Setup(f"{short}-s1-{t}:{i}", f"{window}, stale_steps = 1", "policies", t, i,
                                 window=window))
        for name in strategies.PRESETS:
            param, label = one_step_param(name, B, N)
            cls = strategies.REGISTRY[name]
            action = (cls.actions or cls(B, B, param, N).actions)[0]
            partial, pause_mode = action.rollout_settings
            out.append(Setup(f"{name}-{t}:{i}", f"{name}, {label}", "policies", t, i, window=name, stale=0.0,
                             partial=partial, pause_mode=pause_mode, param=param))
    return out


SPEC_RULES = ("no-window", "window-gated", "windowed-fifo")
# The peers' own default knobs, where their source says it (docs/staleness.md; AReaL areal/api/cli_args.py
# InferenceEngineConfig.max_head_offpolicyness default 0; prime-rl max_off_policy_steps default 8).
PEER_DEFAULTS = (("areal", 0.0, "eta = 0, AReaL's default"), ("prime-rl", 8.0, "M = 8, prime-rl's default"))


def sweep_param(name: str, k: int, B: int, N: int) -> tuple[float, Optional[float]]:
    """(stale_steps, policy_param) of rule `name` at knob level k (k steps; bench/policies.py's mapping): the spec's
    rules take stale_steps k, pipelinerl max_lag k B N, slime-async C = k B groups, the others k in their unit."""
    if name in SPEC_RULES:
        return float(k), None
    return 0.0, float(k * B * N if name == "pipelinerl" else k * B if name == "slime-async" else k)


def sweep_grid(B: int, N: int, levels: list[int], splits=((8, 8), (10, 6)), only: Optional[list] = None) -> list:
    """Every rule at every knob level, then the rows at the peers' default knobs, per split (section "sweep")."""
    import strategies
    out = []
    for t, i in splits:
        rows = [(name, k, None) for name in (*SPEC_RULES, *strategies.PRESETS) for k in levels]
        rows += [(name, None, (param, label)) for name, param, label in PEER_DEFAULTS]
        for name, k, default in rows:
            if only and name not in only:
                continue
            if default is None:
                stale, param = sweep_param(name, k, B, N)
                tag, label = f"k{k}", f"{name}, k = {k}"
            else:
                (param, label), stale = default, 0.0
                tag, label = "default", f"{name}, {label}"
            if name in SPEC_RULES:
                partial, pause_mode = True, "abort"
            else:
                cls = strategies.REGISTRY[name]
                partial, pause_mode = (cls.actions or cls(B, B, param, N).actions)[0].rollout_settings
            s = Setup(f"{name}-{tag}-{t}:{i}", label, "sweep", t, i, window=name, stale=stale, partial=partial,
                      pause_mode=pause_mode, param=param)
            s.rule, s.level = name, k  # for the sweep table and figure
            out.append(s)
    return out


def scaled_workload(wl: sim_server.Workload, f: int) -> sim_server.Workload:
    """The workload with B, M, the fleet's concurrency and the training throughput divided by f: the same step time
    and generation:training ratio with 1/f of the trajectories, i.e. of the real code's own time per step."""
    return dataclasses.replace(wl, num_prompts_per_step=wl.num_prompts_per_step // f,
                               mini_batch_size=wl.mini_batch_size // f, c_half=wl.c_half / f,
                               max_running=max(1, wl.max_running // f),
                               train_tokens_per_s_per_gpu=wl.train_tokens_per_s_per_gpu / f)


@functools.lru_cache(maxsize=8)
def _mean_length(*length_fields) -> float:
    """E[L] of the workload's response lengths over 4,000 groups of 8 (deterministic; the lengths' fields only)."""
    seed, median, group_sigma, traj_sigma, lo, hi = length_fields
    wl = sim_server.Workload(seed=seed, median_tokens=median, group_sigma=group_sigma, traj_sigma=traj_sigma,
                             min_tokens=lo, max_new_tokens=hi)
    lengths = [wl.response_length(f"ideal{g}", 0, i)[0] for g in range(4000) for i in range(8)]
    return sum(lengths) / len(lengths)


def split_ideal(wl: sim_server.Workload, s: Setup) -> dict:
    """One ideal per split, the same for every rule: the expected generated tokens of a step of fresh groups
    (B N E[L], E[L] over 4,000 groups of the workload's lengths) at max(fleet peak, training + weight update)."""
    tokens = wl.num_prompts_per_step * wl.num_trajectories_per_prompt * _mean_length(
        wl.seed, wl.median_tokens, wl.group_sigma, wl.traj_sigma, wl.min_tokens, wl.max_new_tokens)
    peak = sum(wl.replica_peak_tokens_per_s(g) for g in s.replicas)
    step = max(tokens / peak, tokens / (wl.train_tokens_per_s_per_gpu * s.train_gpus) + wl.update_weights_s)
    return {"ideal_step_s": step, "ideal_trained_tokens_per_s": tokens / step}


def run_sweep(setups: list[Setup], args, wl: sim_server.Workload) -> list[dict]:
    """Each setup args.repeats times, the grid in alternating order (forward, backward, ...), so that a drift of the
    machine's load over the run does not fall on the same rules every time."""
    results = []
    ideals = {s.resource: split_ideal(wl, s) for s in setups}
    for rep in range(args.repeats):
        order = setups if rep % 2 == 0 else setups[::-1]
        print(f"[sweep] repeat {rep + 1} of {args.repeats}, {'forward' if rep % 2 == 0 else 'backward'}", flush=True)
        for r, s in zip(run_grid(order, args, wl), order):
            r.update(rule=s.rule, level=s.level, repeat=rep, resource=s.resource, **ideals[s.resource])
            if "error" not in r:
                r["trained_tokens_per_s"] = r["trained_tokens_per_step"] / r["avg_step_excl0_s"]
                r["efficiency_split"] = r["trained_tokens_per_s"] / r["ideal_trained_tokens_per_s"]
            results.append(r)
    return results


def sweep_rows(results: list[dict]) -> list[dict]:
    """Per setup: mean and spread (min, max) over the repeats of throughput, efficiency and staleness."""
    by: dict = {}
    for r in results:
        by.setdefault(r["name"], []).append(r)
    rows = []
    for name, rs in by.items():
        ok = [r for r in rs if "error" not in r]
        row = {k: rs[0].get(k) for k in ("name", "label", "rule", "level", "resource", "ideal_step_s",
                                         "ideal_trained_tokens_per_s")}
        row.update(repeats=len(ok), errors=[r["error"] for r in rs if "error" in r])
        for key in ("trained_tokens_per_s", "efficiency_split", "avg_step_excl0_s", "staleness_mean",
                    "offpolicy_token_share", "discarded_share"):
            vals = [r["discarded_tokens_per_step"] / max(1.0, r["generated_tokens_per_step"]) if key ==
                    "discarded_share" else r[key] for r in ok]
            row[key] = (_mean(vals), min(vals), max(vals)) if vals else (math.nan,) * 3
        row["staleness_max"] = max((r["staleness_max"] for r in ok), default=None)
        rows.append(row)
    return rows


def sweep_table(rows: list[dict]) -> str:
    cols = ["rule, knob", "resource", "trained tokens / s: mean [min-max]", "of the split's ideal", "step (excl. 0)",
            "staleness mean [min-max] / max", "off-policy tokens", "thrown away", "repeats"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * len(cols)) + "|"]

    def spread(x, fmt):
        return f"{fmt.format(x[0])} [{fmt.format(x[1])}-{fmt.format(x[2])}]"
    for r in rows:
        if not r["repeats"]:
            lines.append(f"| {r['label']} | {r['resource']} | failed: {r['errors'][0]} |" + " - |" * (len(cols) - 3))
            continue
        lines.append("| " + " | ".join([
            r["label"], r["resource"], spread(r["trained_tokens_per_s"], "{:.0f}"),
            spread(r["efficiency_split"], "{:.2f}"), spread(r["avg_step_excl0_s"], "{:.0f}"),
            f"{spread(r['staleness_mean'], '{:.2f}')} / {r['staleness_max']}",
            f"{r['offpolicy_token_share'][0]:.0%}", f"{r['discarded_share'][0]:.1%}",
            str(r["repeats"]) + (f" ({len(r['errors'])} failed)" if r["errors"] else "")]) + " |")
    ideals = {r["resource"]: r for r in rows}
    lines.append("")
    lines.append("One ideal per split (the expected tokens of a step of fresh groups at the larger of the fleet's peak "
                 "and training + weight update): " + "; ".join(
                     f"{k}: {v['ideal_step_s']:.0f} s a step, {v['ideal_trained_tokens_per_s']:.0f} trained tokens / s"
                     for k, v in ideals.items()))
    return "\n".join(lines)


def sweep_plot(rows: list[dict], path: str) -> None:
    """Throughput against measured staleness, one panel per split, a line per rule through its knob levels; the
    bars are the spread (min-max) over the repeats; stars are the peers' default knobs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    splits = list(dict.fromkeys(r["resource"] for r in rows))
    fig, axes = plt.subplots(1, len(splits), figsize=(7.5 * len(splits), 6), squeeze=False)
    names = list(dict.fromkeys(r["rule"] for r in rows))
    colors = {n: plt.get_cmap("tab10").colors[i % 10] for i, n in enumerate(names)}
    for ax, split in zip(axes[0], splits):
        for name in names:
            pts = sorted((r for r in rows if r["resource"] == split and r["rule"] == name and r["repeats"]),
                         key=lambda r: (r["level"] is None, r["level"] or 0))
            for default in (False, True):
                sel = [r for r in pts if (r["level"] is None) == default]
                if not sel:
                    continue
                x = [r["staleness_mean"][0] for r in sel]
                y = [r["trained_tokens_per_s"][0] for r in sel]
                # (max(0, .): the mean of equal values can round a hair outside them)
                xerr = [[max(0.0, r["staleness_mean"][0] - r["staleness_mean"][1]) for r in sel],
                        [max(0.0, r["staleness_mean"][2] - r["staleness_mean"][0]) for r in sel]]
                yerr = [[max(0.0, r["trained_tokens_per_s"][0] - r["trained_tokens_per_s"][1]) for r in sel],
                        [max(0.0, r["trained_tokens_per_s"][2] - r["trained_tokens_per_s"][0]) for r in sel]]
                ax.errorbar(x, y, xerr=xerr, yerr=yerr, color=colors[name], capsize=3,
                            fmt="*" if default else "-o", ms=12 if default else 5,
                            label=f"{name} (peer default)" if default else name)
                if not default:
                    for r, xi, yi in zip(sel, x, y):
                        ax.annotate(f"k{r['level']}", (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ideal = next(r["ideal_trained_tokens_per_s"] for r in rows if r["resource"] == split)
        ax.axhline(ideal, color="k", linestyle=":", linewidth=1)
        ax.text(0.02, ideal, "the split's ideal", fontsize=7, va="bottom", transform=ax.get_yaxis_transform())
        ax.set_xlabel("measured staleness of the trained trajectories, mean (trainer version - start version)")
        ax.set_ylabel("trained tokens per simulated second")
        ax.set_title(f"split {split}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save_figure(fig, path, "pipeline_sim --sweep: each rule over its knob; bars: min-max over the repeats "
                 "(alternating order)")


# ---------------------------------------------------------------------------------------------------------------
# Simulated training compute

class SimActor:
    """The trainer's compute, simulated: what train.run_steps calls on its `actor`.

    Training time is the trained response tokens / (tokens per s per GPU x GPUs); weight updates and colocate
    memory release/resume are HTTP calls to the simulated fleet, whose handlers take the modeled time. Records
    trained tokens and the staleness of every trained trajectory.
    """

    def __init__(self, wl: sim_server.Workload, fleet, train_gpus: int, compression: float, token_scale: int,
                 flush: bool):
        self.wl, self.fleet, self.gpus, self.k, self.scale = wl, fleet, train_gpus, compression, token_scale
        self.flush = flush  # config.Config.flush_on_update: not with in-place pauses, as train.py
        self.version = 0
        self.trained_tokens: list[float] = []  # per step
        self.staleness: dict[int, int] = {}  # version lag -> trajectories
        self.tokens = [0, 0]  # trained response tokens: all, generated by weights older than the trainer's
        self.modeled: dict[str, float] = {}  # modeled sim seconds per phase, this step
        self.spent: dict[str, float] = {}  # the same phases' wall time x compression, this step

    def _spend(self, phase: str, sim_s: float, t0: float) -> None:
        """Book `sim_s` modeled seconds and the wall time since t0 (in simulated seconds) to `phase`."""
        self.modeled[phase] = self.modeled.get(phase, 0.0) + sim_s
        self.spent[phase] = self.spent.get(phase, 0.0) + (time.monotonic() - t0) * self.k

    def train_minibatch(self, groups, step: int) -> dict:
        t0 = time.monotonic()
        trajs = [t for g in groups for t in g.trajectories]
        tokens = sum(int(t.response_ids.numel()) for t in trajs) * self.scale
        sim_s = tokens / (self.wl.train_tokens_per_s_per_gpu * self.gpus)
        # Automatic GC is off in a run (see _child): the young generations are collected here, inside the simulated
        # compute, as the rollout's collections in its own process would not stall the trainer. (A run is short
        # enough to leave the long-lived generation alone.)
        gc.collect(1)
        time.sleep(max(0.0, sim_s / self.k - (time.monotonic() - t0)))
        while len(self.trained_tokens) <= step:
            self.trained_tokens.append(0.0)
        self.trained_tokens[step] += tokens
        for t in trajs:
            lag = self.version - (t.start_version if t.start_version >= 0 else self.version)
            self.staleness[lag] = self.staleness.get(lag, 0) + 1
            self.tokens[0] += int(t.versions.numel())
            self.tokens[1] += int((t.versions < self.version).sum())
        self._spend("train", sim_s, t0)
        return {"sim/trained_tokens": float(tokens)}

    def sync_weights(self, version: int) -> dict:
        t0 = time.monotonic()
        self.fleet.update_weights_from_disk("sim://weights", version, self.flush)
        self.version = version
        self._spend("update", self.wl.update_weights_s, t0)
        return {"timing/update_weights": time.monotonic() - t0}

    def save_checkpoint(self, step: int, run_state) -> None:
        return None  # checkpoints are not part of the spec's workload model

    def memory_to_trainer(self) -> None:
        t0 = time.monotonic()
        self.fleet.release_memory()
        self._spend("release_resume", self.wl.release_s, t0)

    def memory_to_servers(self) -> None:
        t0 = time.monotonic()
        self.fleet.resume_memory()
        self._spend("release_resume", self.wl.resume_s, t0)


class NoCheckpointPause:
    """The rollout as the workload model sees it: no checkpoint is written (SimActor.save_checkpoint), so no pause
    brings the kept requests back for one (train.run_steps asks for that at the run's last step)."""

    def __init__(self, ro):
        self._ro = ro

    def pause(self, checkpoint: bool = False) -> dict:
        return self._ro.pause()

    def __getattr__(self, name):
        return getattr(self._ro, name)


class Timed:
    """Forwards every attribute of `obj`; the wall time of the named methods is added to `sink[name]`."""

    def __init__(self, obj, methods: dict, sink: dict):
        self._obj, self._methods, self._sink = obj, methods, sink

    def __getattr__(self, name):
        attr = getattr(self._obj, name)
        phase = self._methods.get(name)
        if phase is None:
            return attr

        def timed(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return attr(*args, **kwargs)
            finally:
                self._sink[phase] = self._sink.get(phase, 0.0) + time.monotonic() - t0
        return timed


class StepLogger:
    """Receives run_steps' per-step metrics; records step time, phases and the fleet's counters per step."""

    def __init__(self, actor: SimActor, phases: dict, fleet_urls: list[str], compression: float):
        self.actor, self.phases, self.urls, self.k = actor, phases, fleet_urls, compression
        self.http = requests.Session()
        self.rows: list[dict] = []

    def fleet_stats(self) -> dict:
        tot: dict = {}
        for u in self.urls:
            for k, v in self.http.get(u + "/sim_stats", timeout=30).json().items():
                if isinstance(v, (int, float)):
                    tot[k] = tot.get(k, 0.0) + v
        return tot

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, "step_s": float(metrics["timing/step"]) * self.k, "fleet": self.fleet_stats(),
               "wall": {k: v * self.k for k, v in self.phases.items()}, "modeled": dict(self.actor.modeled),
               "spent": dict(self.actor.spent)}
        row["metrics"] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        row["trained_ids"] = [tuple(p) for p in metrics.get("data/prompt_ids", [])]
        self.phases.clear()
        self.actor.modeled.clear()
        self.actor.spent.clear()
        self.rows.append(row)

    __call__ = log

    def waiting(self, step: int, record: dict) -> None:
        print(f"[pipeline_sim] step {step}: waiting {record['waited_s']:.0f} s for groups, {record['ready']}/"
              f"{record['needed']} ready", flush=True)

    def close(self) -> None:
        return None


# ---------------------------------------------------------------------------------------------------------------
# One configuration

def make_cfg(s: Setup, wl: sim_server.Workload, urls: list[str], steps: int, token_scale: int, run_dir: str,
             max_running: int):
    d = {
        "name": f"sim-{s.name}", "run_dir": run_dir, "colocate": s.colocate, "device": "cpu",
        "data_source": {"task": "reverse_digits", "num_prompts_per_step": wl.num_prompts_per_step,
                        "num_trajectories_per_prompt": wl.num_trajectories_per_prompt,
                        "num_prompts": wl.num_prompts_per_step * (steps + 8), "shuffle": False},
        "trainer": {"mini_batch_size": wl.mini_batch_size, "total_steps": steps, "save_freq": 0,
                    "num_gpus_per_node": s.train_gpus},
        "fully_async": {"enable": not s.colocate, "sliding_window": s.window if not s.colocate else "no-window",
                        "stale_steps": s.stale if not s.colocate else 0.0, "policy_param": s.param},
        "rollout": {"servers": urls, "launch": "none", "partial": s.partial, "pause_mode": s.pause_mode,
                    "mask_offpolicy_in_partial_rollout": s.partial,
                    "sampling": {"max_new_tokens": wl.max_new_tokens // token_scale},
                    "sampler": {"num_oversample": s.oversample},
                    "sglang_args": {"max_running_requests": max_running},
                    "async_max_concurrent_samples": s.max_concurrent,
                    "trajectory_timeout_s": 3600.0, "pause_timeout_s": 300.0},
        "buffer": {"get_timeout_s": 300.0},
        "weight_sync": {"method": "disk"},
    }
    return config.validate(config.from_dict(d))


def make_prompts(n: int, prompt_units: int) -> list[dict]:
    """n distinct prompts of prompt_units tokens (digits of the index in base 90 over ids 10..99)."""
    return [{"prompt_ids": [10 + (i // 90 ** j) % 90 for j in range(prompt_units)], "label": "0", "metadata": {}}
            for i in range(n)]


def start_fleet(s: Setup, args) -> tuple[subprocess.Popen, list[str]]:
    cmd = [sys.executable, os.path.join(HERE, "sim_server.py"), "--replica-gpus", *map(str, s.replicas),
           "--compression", str(args.compression), "--token-scale", str(args.token_scale),
           "--eos-id", str(args.eos_id), "--filler-id", str(args.filler_id)]
    if args.workload_path:
        cmd += ["--workload", args.workload_path]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY ") or proc.poll() is not None:
            break
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"the simulated fleet did not report READY within 30 s (got {line!r})")
    return proc, json.loads(line.split(" ", 1)[1])["urls"]


def run_setup(s: Setup, args, wl: sim_server.Workload) -> dict:
    """Run one configuration: the real buffer, rollout and step loop against a fresh simulated fleet."""
    import buffer
    import rollout
    import sglang_client
    from standins import tiny_model
    import train

    proc, urls = start_fleet(s, args)
    try:
        _, max_running = wl.replica_capacity(s.replicas[0])
        run_dir = tempfile.mkdtemp(prefix=f"pipeline_sim_{s.name.replace(':', '_')}_")
        cfg = make_cfg(s, wl, urls, args.steps, args.token_scale, run_dir, max_running)
        prompt_units = max(1, round(wl.prompt_tokens / args.token_scale))
        prompts = make_prompts(cfg.data_source[0].num_prompts, prompt_units)
        phases: dict = {}
        buf = buffer.PipelineServer(cfg, [prompts])
        fleet = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))  # one event loop: the producer's and the actor's
        ro = rollout.Rollout(cfg, buf, fleet, tiny_model.build_tokenizer())
        actor = SimActor(wl, fleet, s.train_gpus, args.compression, args.token_scale, cfg.flush_on_update)
        logger = StepLogger(actor, phases, urls, args.compression)
        t0 = time.monotonic()
        try:
            train.run_steps(cfg, actor, Timed(buf, {"wait": "wait_data", "get": "wait_data"}, phases),
                            Timed(NoCheckpointPause(ro), {"pause": "pause", "resume": "resume_rollout"}, phases),
                            logger, 0)
            sd = buf.state_dict()  # paused: settled
            pending = [(g["epoch"], g["data_index"]) for g in sd["data"]["lane"] + sd["buffered"]]
            dispatched = buf.data.next_seq
            after_last = buf.step_metrics()  # drops of the last weight update, which no step logged
        finally:
            ro.stop()
            fleet.close()
            buf.close()
        total = (time.monotonic() - t0) * args.compression
        out = summarize(s, wl, logger.rows, actor, total, args.compression)
        out["accounting"] = accounting(logger.rows + [{"trained_ids": [], "metrics": after_last}], pending, dispatched,
                                       cfg.N)
        return out
    finally:
        proc.kill()
        proc.wait(timeout=10)


DROP_GROUPS = ("rollout/filter_drop", "rollout/staleness_drop", "rollout/policy_drop", "rollout/update_dropped_groups",
               "rollout/partial_dropped_incomplete_groups")  # every way a dispatched group can leave untrained


def accounting(rows: list[dict], pending: list, dispatched: int, N: int) -> dict:
    """Every dispatched prompt is trained exactly once, counted as dropped, or still pending (in flight, restored
    or buffered: the checkpoint's replay) when the run ends."""
    trained = [p for r in rows for p in r["trained_ids"]]
    dropped = sum(int(r["metrics"].get(k, 0)) for r in rows for k in DROP_GROUPS)
    return {"dispatched": dispatched, "trained": len(trained), "trained_twice": len(trained) - len(set(trained)),
            "dropped": dropped, "pending": len(pending), "pending_and_trained": len(set(trained) & set(pending)),
            "dropped_samples": dropped * N, "balanced": len(set(trained)) + dropped + len(pending) == dispatched}


def _child(s: Setup, args, wl, conn) -> None:
    import torch
    # As in the buffer process (buffer.py): the in-process buffer and rollout only do small tensor copies, which
    # intra-op threads would make contend for the cores the simulated fleet needs.
    torch.set_num_threads(1)
    # In-process threads share one interpreter: a full collection (~0.1-0.4 s here) would stall the trainer's
    # thread too and be multiplied by the compression. SimActor.train_minibatch collects instead.
    gc.disable()
    try:
        conn.send({"ok": run_setup(s, args, wl)})
    except BaseException as e:  # the parent reports it and goes on with the next configuration
        import traceback
        conn.send({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
    finally:
        conn.close()


def run_isolated(s: Setup, args, wl) -> dict:
    """Each configuration in a forked child: its threads and sockets end with it; imports are already paid."""
    ctx = mp.get_context("fork")
    # The imports (torch, transformers, matplotlib) leave millions of objects that every full collection in the
    # child would walk: 0.3-0.4 s stalls of all threads, x compression on the simulated clock. Freeze them.
    gc.collect()
    gc.freeze()
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(s, args, wl, child), daemon=True)
    p.start()
    child.close()
    limit = 60 + args.steps * 3000 / args.compression
    if not parent.poll(limit):
        p.kill()
        return {"error": f"configuration {s.name} did not finish within {limit:.0f} s of wall time"}
    out = parent.recv()
    p.join(10)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Figures

def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(s: Setup, wl: sim_server.Workload, rows: list[dict], actor: SimActor, total_s: float,
              compression: float) -> dict:
    """One configuration's record. Steady state = every step but step 0; fleet counters are cumulative."""
    steps = [r["step_s"] for r in rows]
    steady = rows[1:] if len(rows) > 1 else rows
    gen = [b["fleet"]["generated_tokens"] - a["fleet"]["generated_tokens"] for a, b in zip(rows, rows[1:])]
    busy = [(b["fleet"]["busy_s"] - a["fleet"]["busy_s"]) / len(s.replicas) for a, b in zip(rows, rows[1:])]
    at_cap = [(b["fleet"]["at_cap_s"] - a["fleet"]["at_cap_s"]) / len(s.replicas) for a, b in zip(rows, rows[1:])]
    trained = (actor.trained_tokens + [0.0] * len(rows))[:len(rows)]
    gen_steady, trained_steady = _mean(gen), _mean(trained[1:] if len(rows) > 1 else trained)
    peak = sum(wl.replica_peak_tokens_per_s(g) for g in s.replicas)
    train_tput = wl.train_tokens_per_s_per_gpu * s.train_gpus
    gen_bound, train_bound = gen_steady / peak, trained_steady / train_tput
    # The workload model's ideal (docs/results/pipeline_sim.md): the larger of generation and training + update.
    ideal = max(gen_bound, train_bound + wl.update_weights_s)
    # But the update stops the fleet too: no server decodes while it takes the new weights in (SGLang receives them
    # on its scheduler thread), so a generation-bound configuration cannot beat generation + update either.
    ideal_update_stops_fleet = max(gen_bound, train_bound) + wl.update_weights_s
    avg_excl0 = _mean(r["step_s"] for r in steady)

    def metric(name):
        vals = [r["metrics"][name] for r in steady if name in r["metrics"]]
        return _mean(vals) if vals else None

    modeled = {p: _mean(r["modeled"].get(p, 0.0) for r in steady) for p in ("train", "update", "release_resume")}
    wait_data = _mean(r["metrics"].get("timing/rollout", 0.0) * compression for r in steady)
    pause = _mean(r["wall"].get("pause", 0.0) for r in steady)
    # The real code's own time on the trainer's critical path (pause, HTTP, metrics, thread hand-offs): wall
    # seconds, so x compression in simulated time. At 1x it would cost overhead / compression.
    overhead = avg_excl0 - sum(modeled.values()) - wait_data
    step_1x = avg_excl0 - overhead * (1 - 1 / compression)
    return {
        "name": s.name, "label": s.label, "section": s.section, "resource": s.resource,
        "steps_s": steps, "step0_s": steps[0], "avg_step_s": _mean(steps), "avg_step_excl0_s": avg_excl0,
        "avg_step_100_equiv_s": (steps[0] + 99 * avg_excl0) / 100,
        "ideal_step_s": ideal, "efficiency": ideal / avg_excl0,
        "efficiency_update_stops_fleet": ideal_update_stops_fleet / avg_excl0,
        "pipeline_buf_size": metric("rollout/pipeline_buf_size"),
        "partial_ratio": metric("rollout/partial_ratio"),
        "partial_restored": metric("rollout/partial_restored_count"),
        "partial_kept": metric("rollout/partial_kept_count"),
        "generated_tokens_per_step": gen_steady, "trained_tokens_per_step": trained_steady,
        "fleet_peak_tokens_per_s": peak, "fleet_utilization": gen_steady / (peak * avg_excl0),
        "fleet_busy_frac": _mean(busy) / avg_excl0, "fleet_at_cap_frac": _mean(at_cap) / avg_excl0,
        "phases_s": {"train": modeled["train"], "update_weights": modeled["update"],
                     "release_resume": modeled["release_resume"], "wait_data": wait_data, "pause": pause,
                     "overhead": overhead},
        "overhead_wall_ms": overhead / compression * 1000, "step_at_1x_s": step_1x, "efficiency_at_1x": ideal / step_1x,
        "staleness": {str(k): v for k, v in sorted(actor.staleness.items())},
        "staleness_mean": sum(k * v for k, v in actor.staleness.items()) / max(1, sum(actor.staleness.values())),
        "staleness_max": max(actor.staleness, default=0),
        "offpolicy_token_share": actor.tokens[1] / max(1, actor.tokens[0]),
        "discarded_tokens_per_step": _mean(r["metrics"].get("rollout/discarded_tokens", 0.0) for r in steady)
        * actor.scale,
        "param": s.param,
        "total_s": total_s, "compression": compression,
        "per_step": [{"step_s": r["step_s"], "wall": r["wall"], "modeled": r["modeled"], "spent": r["spent"],
                      "metrics": {k: v for k, v in r["metrics"].items() if k.startswith(("timing/", "rollout/"))}}
                     for r in rows],
    }


def add_speedups(results: list[dict]) -> None:
    base = next((r for r in results if r["name"] == "colocate" and "error" not in r), None)
    for r in results:
        if "error" in r:
            continue
        r["speedup"] = base["avg_step_s"] / r["avg_step_s"] if base else None
        r["speedup_excl0"] = base["avg_step_excl0_s"] / r["avg_step_excl0_s"] if base else None


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def markdown(results: list[dict]) -> str:
    cols = ["config", "resource", "step 0", "avg step (all)", "speedup", "avg step (excl. step 0)",
            "speedup (excl. step 0)", "spec (excl. step 0)", "ideal", "efficiency", "pipeline_buf_size",
            "partial_ratio", "partial_restored", "partial_kept"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * len(cols)) + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} |" + " - |" * (len(cols) - 2))
            continue
        lines.append("| " + " | ".join([
            r["label"], r["resource"], _f(r["step0_s"]), _f(r["avg_step_s"]), _f(r.get("speedup"), "{:.2f}x"),
            _f(r["avg_step_excl0_s"]), _f(r.get("speedup_excl0"), "{:.2f}x"), _f(SPEC_EXCL0.get(r["name"])),
            _f(r["ideal_step_s"]), _f(r["efficiency"], "{:.2f}"), _f(r["pipeline_buf_size"]),
            _f(r["partial_ratio"], "{:.3f}"), _f(r["partial_restored"], "{:.0f}"),
            _f(r.get("partial_kept"), "{:.0f}")]) + " |")
    return "\n".join(lines)


def phase_table(results: list[dict]) -> str:
    cols = ["config", "step (excl. 0)", "train", "weight update", "release+resume", "waiting for data",
            "overhead (of which pause)", "overhead, wall ms", "step with overhead at 1x", "efficiency at 1x",
            "fleet busy / at cap", "fleet tokens vs peak", "staleness (lag: share)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * len(cols)) + "|"]
    for r in results:
        if "error" in r:
            continue
        p = r["phases_s"]
        total = sum(r["staleness"].values()) or 1
        stale = ", ".join(f"{k}: {v / total:.2f}" for k, v in r["staleness"].items())
        lines.append("| " + " | ".join([
            r["name"], _f(r["avg_step_excl0_s"]), _f(p["train"]), _f(p["update_weights"]), _f(p["release_resume"]),
            _f(p["wait_data"]), f"{_f(p['overhead'])} ({_f(p['pause'])})", _f(r["overhead_wall_ms"], "{:.0f}"),
            _f(r["step_at_1x_s"]), _f(r["efficiency_at_1x"], "{:.2f}"),
            f"{_f(r['fleet_busy_frac'], '{:.2f}')} / {_f(r['fleet_at_cap_frac'], '{:.2f}')}",
            _f(r["fleet_utilization"], "{:.2f}"), stale]) + " |")
    return "\n".join(lines)


def policies_table(results: list[dict]) -> str:
    cols = ["policy (parameter for one step of staleness)", "resource", "step (excl. 0)", "ideal", "efficiency",
            "staleness mean / max", "off-policy tokens", "generated tokens / step", "thrown away / step",
            "samples dropped", "prompts: trained + dropped + pending = dispatched"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * len(cols)) + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} |" + " - |" * (len(cols) - 2))
            continue
        a, thrown = r["accounting"], r["discarded_tokens_per_step"]
        lines.append("| " + " | ".join([
            r["label"], r["resource"], _f(r["avg_step_excl0_s"]), _f(r["ideal_step_s"]), _f(r["efficiency"], "{:.2f}"),
            f"{r['staleness_mean']:.2f} / {r['staleness_max']}", _f(r["offpolicy_token_share"], "{:.1%}"),
            _f(r["generated_tokens_per_step"], "{:.0f}"),
            f"{thrown:.0f} ({thrown / max(1.0, r['generated_tokens_per_step']):.1%})",
            str(a["dropped_samples"]),
            f"{a['trained']} + {a['dropped']} + {a['pending']} = {a['dispatched']}"
            + ("" if a["balanced"] and not a["trained_twice"] else " MISMATCH")]) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if "error" not in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 6))
    colors = plt.get_cmap("tab20").colors
    styles = {"spec": "-", "concurrency": "--", "split": ":", "in_place": "-."}
    for i, r in enumerate(ok):
        a.plot(range(len(r["steps_s"])), r["steps_s"], marker="o", ms=3, label=r["name"], color=colors[i % 20],
               linestyle=styles.get(r["section"], "-"), linewidth=2.5 if r["name"] == "colocate" else 1.3)
    a.set_xlabel("step")
    a.set_ylabel("step time (simulated s)")
    a.set_title("step time per step")
    a.legend(fontsize=7)
    lags = sorted({int(k) for r in ok for k in r["staleness"]})
    left = [0.0] * len(ok)
    for lag in lags:
        shares = []
        for r in ok:
            tot = sum(r["staleness"].values()) or 1
            shares.append(r["staleness"].get(str(lag), 0) / tot)
        b.barh([r["name"] for r in ok], shares, left=left, label=f"lag {lag}")
        left = [x + y for x, y in zip(left, shares)]
    b.set_xlabel("share of trained trajectories")
    b.set_title("staleness: trainer version - start version of the trajectory")
    b.legend(fontsize=7)
    _save_figure(fig, path, "pipeline_sim: simulated fleet and training, the project's own orchestration", dpi=110)


def _save_figure(fig, path: str, title: str, dpi: int = 80) -> None:
    """Every figure of this script: its title, tight layout, written to `path` (its folder made), closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def acceptance(results: list[dict]) -> list[str]:
    """The issue's acceptance checks, as measured; "at 1x" repeats each with the code's overhead at real time."""
    by = {r["name"]: r for r in results if "error" not in r}
    out = []

    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    for name, lo, hi in [("colocate", 578.63, 578.63)] + [(n, 414.58, 451.74) for n in ("nowin-s1", "fifo-s1",
                                                                                          "fifo-s2")]:
        if name in by:
            x, x1 = by[name]["avg_step_excl0_s"], by[name]["step_at_1x_s"]
            out.append(f"calibration {name}: {x:.1f} s (at 1x {x1:.1f} s) vs spec {lo:.1f}-{hi:.1f} s +-15%: "
                       f"{verdict(lo * 0.85 <= x <= hi * 1.15)}")
    fa = [r for r in by.values() if r["section"] == "spec" and not r["name"].startswith("colocate")]
    if {"colocate", "colocate+partial"} <= by.keys() and fa:
        c, cp = by["colocate"]["avg_step_excl0_s"], by["colocate+partial"]["avg_step_excl0_s"]
        slowest = max(fa, key=lambda r: r["avg_step_excl0_s"])
        out.append(f"ordering fully-async < colocate+partial < colocate: slowest fully-async ({slowest['name']}) "
                   f"{slowest['avg_step_excl0_s']:.1f} s, colocate+partial {cp:.1f} s, colocate {c:.1f} s: "
                   f"{verdict(slowest['avg_step_excl0_s'] < cp < c)}")
    for r in by.values():
        if not r["name"].startswith("colocate"):
            target = 0.97 if r["section"] == "in_place" else 0.95
            stops = r["efficiency_update_stops_fleet"]
            out.append(f"efficiency {r['name']}: {r['efficiency']:.3f} (at 1x {r['efficiency_at_1x']:.3f}; "
                       f"{stops:.3f} if the bound stops the fleet during the weight update too), "
                       f"target >= {target}: {verdict(r['efficiency'] >= target)}")
    for r in by.values():
        if r["section"] == "in_place":
            share = r["phases_s"]["pause"] / r["avg_step_excl0_s"]
            out.append(f"pause {r['name']}: {r['phases_s']['pause']:.2f} s = {share:.2%} of the step, target < 1%: "
                       f"{verdict(share < 0.01)}")
    for what, rows in (("split", [r for r in by.values() if r["section"] == "split" or r["name"] == "fifo-s2"]),
                       ("in_place split", [r for r in by.values() if r["section"] == "in_place"])):
        if len(rows) > 1 and "colocate" in by:
            best = min(rows, key=lambda r: r["avg_step_excl0_s"])
            at1x = by["colocate"]["step_at_1x_s"] / best["step_at_1x_s"]
            out.append(f"best {what}: {best['resource']} ({best['name']}) at {best['speedup_excl0']:.2f}x colocate "
                       f"(at 1x {at1x:.2f}x; against the spec's colocate 578.6 s "
                       f"{578.63 / best['avg_step_excl0_s']:.2f}x), target >= 1.6x: "
                       f"{verdict(best['speedup_excl0'] >= 1.6)}")
    return out


def run_grid(setups: list[Setup], args, wl: sim_server.Workload) -> list[dict]:
    results = []
    for s in setups:
        t1 = time.monotonic()
        r = run_isolated(s, args, wl)
        r = r.get("ok", {**r, "name": s.name, "label": s.label, "section": s.section})
        results.append(r)
        status = r.get("error") or f"avg step {r['avg_step_s']:.1f} s (excl. 0: {r['avg_step_excl0_s']:.1f} s)"
        print(f"  {s.name} at {args.compression:g}x: {status} [{time.monotonic() - t1:.0f} s wall]", flush=True)
    add_speedups(results)
    return results


def overhead_check(setups: list[Setup], args, wl: sim_server.Workload) -> None:
    """Each configuration at k and k/2. The part of a step the model does not account for (waiting for data +
    overhead, i.e. everything but the modeled compute) is fitted as u(k) = u0 + w * k: w (wall seconds per step) is
    all of the real code's own time, the fleet side included, and modeled compute + u0 + w is the step with that
    time at real speed. (Fitting the unmodeled part rather than the step removes the run-to-run change of the
    trained tokens, which depends on which groups finished first.)"""
    half = argparse.Namespace(**{**vars(args), "compression": args.compression / 2})
    full, halved = run_grid(setups, args, wl), run_grid(setups, half, wl)

    def unmodeled(r):
        p = r["phases_s"]
        return r["avg_step_excl0_s"] - p["train"] - p["update_weights"] - p["release_resume"]

    print()
    print(f"| config | unmodeled s per step at {args.compression:g}x | at {half.compression:g}x | real code, wall ms "
          f"per step | step at 1x (fit) | ideal | efficiency at 1x (fit) |")
    print("|---|---|---|---|---|---|---|")
    for a, b in zip(full, halved):
        if "error" in a or "error" in b:
            print(f"| {a['name']} | failed: {a.get('error') or b.get('error')} | - | - | - | - | - |")
            continue
        ua, ub = unmodeled(a), unmodeled(b)
        w = 2 * (ua - ub) / args.compression
        step_1x = a["avg_step_excl0_s"] - ua + (2 * ub - ua) + w
        print(f"| {a['name']} | {ua:.1f} | {ub:.1f} | {w * 1000:.0f} | {step_1x:.1f} | {a['ideal_step_s']:.1f} | "
              f"{a['ideal_step_s'] / step_1x:.3f} |")


# ---------------------------------------------------------------------------------------------------------------
# The agentic workload: a discrete-event model (--agentic)
#
# Unlike the rest of this file, nothing here runs the project's orchestration: the fleet, the tools, the sandbox
# pool, the buffer's bounds and the trainer are one event loop on a simulated clock (no threads, no HTTP), so a
# configuration takes seconds and can be repeated over seeds. What it takes from the project: the window rule itself
# (strategies.REGISTRY[fully_async.sliding_window], asked with a strategies.PipelineView exactly as
# buffer.PipelineServer asks it), the capacity C = int(B (1 + stale_steps)), the cap of S // N generating groups for
# S = rollout.async_max_concurrent_samples, the step of (B N) // M training calls on M // N groups each, and the
# two boundaries of docs/design.md: rollout.partial=false waits for every episode in flight before the weight update;
# rollout.partial=true keeps them where they are (pause_mode in_place / retract; abort + restore costs the same in
# this model, where prefill is free) and the fleet stops decoding for the update while tool calls go on.

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 19: 2.093, 29: 2.045}  # Student t, two-sided 95%


@dataclass
class AgenticWorkload:
    """The episodes' shape, on top of sim_server.Workload's lengths, fleet and training (docs/results/pipeline_sim.md,
    "Agentic episodes", says where each figure comes from and which are assumptions)."""
    turns: int = 8  # model turns per episode; a tool call after each but the last
    tool_median_s: float = 24.0  # median latency of one tool call, simulated seconds (log-normal)
    tool_sigma: float = 0.6  # log-normal sigma of a tool call's latency
    env_max_concurrent: int = 384  # rollout.env_max_concurrent: the sandbox pool (tool calls in progress at once)

    def check(self) -> None:
        if self.turns < 1:
            raise ValueError(f"--turns must be >= 1 (model turns per episode), got {self.turns}")
        if self.tool_median_s < 0 or self.tool_sigma < 0:
            raise ValueError(f"--tool-median-s and --tool-sigma must be >= 0, got {self.tool_median_s} and "
                             f"{self.tool_sigma}")
        if self.env_max_concurrent < 1:
            raise ValueError(f"--sandboxes (rollout.env_max_concurrent) must be >= 1, got {self.env_max_concurrent}")


@dataclass
class AgenticSetup:
    """One row: the settings under their config names."""
    name: str
    async_max_concurrent_samples: Optional[int]  # S, trajectories; None: only C bounds the groups in flight
    partial: bool  # rollout.partial
    stale_steps: float = 4.0  # fully_async.stale_steps: C = int(B (1 + stale_steps)), large enough not to bind S
    sliding_window: str = "windowed-fifo"  # fully_async.sliding_window
    train_gpus: int = 8
    infer_gpus: int = 8

    @property
    def replicas(self) -> list[int]:
        size = 4 if self.infer_gpus % 4 == 0 else 2
        return [size] * (self.infer_gpus // size)


class _Req:
    """One model turn of one trajectory on a replica: it needs `need` tokens; tokens are booked per weight version."""
    __slots__ = ("traj", "need", "p_end", "p_seg", "v_seg", "replica")

    def __init__(self, traj, need: float):
        self.traj, self.need = traj, need
        self.p_end = self.p_seg = 0.0
        self.v_seg = 0
        self.replica = None


class _Traj:
    __slots__ = ("group", "index", "turn_tokens", "turn", "segments")

    def __init__(self, group, index: int, turn_tokens: list):
        self.group, self.index, self.turn_tokens = group, index, turn_tokens
        self.turn = 0
        self.segments: dict = {}  # weight version -> tokens generated under it


class _Group:
    __slots__ = ("seq", "trajs", "done", "start_version")

    def __init__(self, seq: int, start_version: int):
        self.seq, self.start_version = seq, start_version
        self.trajs: list = []
        self.done = 0


class _Replica:
    """Processor sharing: each of c running requests decodes at v0 / (1 + c / c_half) tokens/s; at most max_running
    run, the rest wait in FIFO order. One progress counter P (tokens per request since start) and a heap of finishing
    points make each event O(log n)."""

    def __init__(self, v0: float, c_half: float, cap: int):
        self.v0, self.c_half, self.cap = v0, c_half, cap
        self.P = 0.0
        self.heap: list = []  # (p_end, id, req)
        self.running: dict = {}  # id(req) -> req
        self.queue: list = []  # FIFO (index into it with a head pointer would be faster; queues stay short here)

    def rate(self) -> float:
        c = len(self.running)
        return self.v0 / (1 + c / self.c_half) if c else 0.0

    def load(self) -> int:
        return len(self.running) + len(self.queue)


class AgenticSim:
    """The event loop of one configuration and seed. `run(steps)` returns the measured record (steady state: the
    steps after `warmup`)."""

    def __init__(self, wl: sim_server.Workload, aw: AgenticWorkload, s: AgenticSetup, seed: int):
        import heapq
        import random
        import strategies
        aw.check()
        self.hq = heapq
        self.wl, self.aw, self.s, self.seed = dataclasses.replace(wl, seed=seed), aw, s, seed
        self.rng = random.Random(seed * 7919 + 17)
        self.B, self.N, self.M = wl.num_prompts_per_step, wl.num_trajectories_per_prompt, wl.mini_batch_size
        if (self.B * self.N) % self.M or self.M % self.N:
            raise ValueError(f"B x N ({self.B} x {self.N}) must be a multiple of M ({self.M}) and M of N")
        self.C = int(self.B * (1 + s.stale_steps))
        S = s.async_max_concurrent_samples
        if S is not None and S < self.N:
            raise ValueError(f"rollout.async_max_concurrent_samples ({S}) must be >= N ({self.N}) or None (no cap)")
        self.max_generating = None if S is None else S // self.N
        self.strategy = strategies.build(s.sliding_window, self.B, self.C, True, None, self.N)
        self.replicas = []
        for g in s.replicas:
            c_half, cap = wl.replica_capacity(g)
            self.replicas.append(_Replica(wl.v0, c_half, cap))
        self.peak = sum(wl.replica_peak_tokens_per_s(g) for g in s.replicas)
        self.train_rate = wl.train_tokens_per_s_per_gpu * s.train_gpus
        self.t = 0.0
        self.version = 0
        self.frozen = False  # the fleet takes new weights in: nothing decodes
        self.dispatching = True
        self.next_seq = 0
        self.generating: dict = {}  # seq -> group, dispatched and not all N trajectories back
        self.trajqueue: dict = {}  # seq -> group, complete, not yet collected
        self.pbuf: list = []  # collected groups, FIFO for the trainer
        self.tools: list = []  # heap (t_end, n, traj)
        self.tool_wait: list = []  # trajectories waiting for a sandbox, FIFO
        self.tool_head = 0
        self.sandboxes_in_use = 0
        self.n = 0  # tie-breaker of the heaps
        # the trainer
        self.calls_per_step = (self.B * self.N) // self.M
        self.state, self.t_event, self.calls = "need", math.inf, 0
        self.training: list = []  # groups of the current call
        # measurements
        self.steps_end: list = [0.0]
        self.acc = {"gen_tokens": 0.0, "tool_busy": 0.0, "fleet_busy": 0.0}
        self.marks: list = []  # self.acc copied at every step end
        self.trained_tokens: list = [0.0]  # per step
        self.lag_tokens: dict = {}  # per step: {lag: tokens}
        self.max_in_flight_trajs = 0
        self.max_sandboxes = 0
        self.max_groups = 0  # R + Q seen
        self.dirty = True  # the buffer's counters changed since the last _settle
        self.crossed = [0, 0]  # trained trajectories: all, those with tokens of more than one weight version

    # ---- the fleet ----
    def _route(self, req: _Req) -> None:
        r = min(self.replicas, key=_Replica.load)  # least-loaded, as sglang_client.Fleet
        req.replica = r
        if len(r.running) < r.cap:
            self._admit(r, req)
        else:
            r.queue.append(req)

    def _admit(self, r: _Replica, req: _Req) -> None:
        req.p_seg, req.v_seg = r.P, self.version
        req.p_end = r.P + req.need
        self.n += 1
        self.hq.heappush(r.heap, (req.p_end, self.n, req))
        r.running[id(req)] = req

    def _book(self, req: _Req, p: float) -> None:
        """The tokens req generated since its last booking go to the version that generated them."""
        if p > req.p_seg:  # (a request admitted while the fleet took new weights in generated none)
            seg = req.traj.segments
            seg[req.v_seg] = seg.get(req.v_seg, 0.0) + (p - req.p_seg)
        req.p_seg = p

    def _advance(self, dt: float) -> None:
        if dt <= 0:
            return
        if not self.frozen:
            for r in self.replicas:
                c = len(r.running)
                if c:
                    rate = r.rate()
                    r.P += rate * dt
                    self.acc["gen_tokens"] += c * rate * dt
                    self.acc["fleet_busy"] += dt / len(self.replicas)
        self.acc["tool_busy"] += self.sandboxes_in_use * dt
        self.t += dt

    def _next_time(self) -> float:
        t = self.t_event
        if not self.frozen:
            for r in self.replicas:
                if r.heap:
                    t = min(t, self.t + max(0.0, r.heap[0][0] - r.P) / r.rate())
        if self.tools:
            t = min(t, self.tools[0][0])
        return t

    # ---- episodes ----
    def _start_turn(self, traj: _Traj) -> None:
        self._route(_Req(traj, traj.turn_tokens[traj.turn]))

    def _turn_done(self, req: _Req) -> None:
        traj = req.traj
        traj.turn += 1
        if traj.turn < len(traj.turn_tokens):
            if self.sandboxes_in_use < self.aw.env_max_concurrent:
                self._start_tool(traj)
            else:
                self.tool_wait.append(traj)
            return
        g = traj.group
        g.done += 1
        if g.done == self.N:
            del self.generating[g.seq]
            self.trajqueue[g.seq] = g
            self.dirty = True

    def _start_tool(self, traj: _Traj) -> None:
        aw = self.aw
        lat = aw.tool_median_s * math.exp(self.rng.gauss(0.0, aw.tool_sigma)) if aw.tool_median_s > 0 else 0.0
        self.sandboxes_in_use += 1
        self.max_sandboxes = max(self.max_sandboxes, self.sandboxes_in_use)
        self.n += 1
        self.hq.heappush(self.tools, (self.t + lat, self.n, traj))

    def _tool_done(self, traj: _Traj) -> None:
        self.sandboxes_in_use -= 1
        if self.tool_head < len(self.tool_wait):
            nxt = self.tool_wait[self.tool_head]
            self.tool_head += 1
            if self.tool_head > 1024:
                del self.tool_wait[:self.tool_head]
                self.tool_head = 0
            self._start_tool(nxt)
        self._start_turn(traj)

    # ---- the buffer's rules ----
    def _view(self):
        import strategies
        R = len(self.generating) + len(self.trajqueue)
        uncollected = list(self.generating) + list(self.trajqueue)
        return strategies.PipelineView(
            B=self.B, C=self.C, R=R, Q=len(self.pbuf), generating=len(self.generating), consumed=0,
            next_seq=self.next_seq, oldest_uncollected=min(uncollected) if uncollected else None,
            oldest_uncompleted=min(self.generating) if self.generating else None, version=self.version)

    def _collect(self) -> bool:
        """TrajQueue -> PipelineBuffer for every complete group the strategy lets through (asked again after each
        move, with the counters of that moment)."""
        if not self.trajqueue:
            return False
        moved, view = False, self._view()
        for seq in sorted(self.trajqueue):
            if self.strategy.may_collect(seq, view):
                self.pbuf.append(self.trajqueue.pop(seq))
                moved, view = True, self._view()
        return moved

    def _dispatch(self) -> bool:
        moved = False
        while self.dispatching:
            if self.max_generating is not None and len(self.generating) >= self.max_generating:
                break
            view = self._view()
            if not self.strategy.may_dispatch(self.next_seq, view):
                break
            g = _Group(self.next_seq, self.version)
            self.next_seq += 1
            self.generating[g.seq] = g
            T = self.aw.turns
            for i in range(self.N):
                length, _ = self.wl.response_length(f"g{g.seq}", 0, i)
                traj = _Traj(g, i, [length / T] * T)
                g.trajs.append(traj)
                self._start_turn(traj)
            self.max_in_flight_trajs = max(self.max_in_flight_trajs, len(self.generating) * self.N)
            self.max_groups = max(self.max_groups, view.R + 1 + view.Q)
            moved = True
        return moved

    # ---- the trainer ----
    def _trainer(self) -> bool:
        if self.state == "need" and len(self.pbuf) >= self.M // self.N:
            self.training, self.pbuf = self.pbuf[:self.M // self.N], self.pbuf[self.M // self.N:]
            tokens = 0.0
            lags = self.lag_tokens.setdefault(len(self.steps_end) - 1, {})
            for g in self.training:
                for traj in g.trajs:
                    self.crossed[0] += 1
                    self.crossed[1] += len(traj.segments) > 1
                    for v, n in traj.segments.items():
                        tokens += n
                        lags[self.version - v] = lags.get(self.version - v, 0.0) + n
            self.trained_tokens[-1] += tokens
            self.state, self.t_event = "train", self.t + tokens / self.train_rate
            return True
        if self.state == "drain" and not self.generating:
            self._update()
            return True
        return False

    def _update(self) -> None:
        self.state, self.t_event = "update", self.t + self.wl.update_weights_s
        self.frozen = True

    def _trainer_event(self) -> None:
        if self.state == "train":
            self.calls += 1
            self.state, self.t_event = "need", math.inf
            if self.calls == self.calls_per_step:  # the step boundary
                self.calls = 0
                self.dispatching = False
                if self.s.partial:
                    self._update()
                else:
                    self.state = "drain"
        elif self.state == "update":
            self.frozen = False
            self.version += 1
            for r in self.replicas:  # tokens from here on are the new version's
                for req in r.running.values():
                    self._book(req, r.P)
                    req.v_seg = self.version
            self.dispatching = True
            self.state, self.t_event = "need", math.inf
            self.steps_end.append(self.t)
            self.marks.append(dict(self.acc))
            self.trained_tokens.append(0.0)

    def _settle(self) -> None:
        """Collect, dispatch and let the trainer go on until nothing changes; only after an event that can change
        the buffer's counters (a group complete, a call or a step's end)."""
        if not self.dirty:
            return
        self.dirty = False
        while self._collect() | self._dispatch() | self._trainer():
            pass

    def run(self, steps: int, warmup: int) -> dict:
        eps = 1e-9
        while len(self.steps_end) <= steps:
            self._settle()
            t_next = self._next_time()
            if t_next == math.inf:
                raise RuntimeError(f"agentic sim {self.s.name}: nothing left to happen at t={self.t:.0f} s in "
                                   f"step {len(self.steps_end) - 1} (trainer {self.state}, {len(self.pbuf)} groups "
                                   f"buffered, {len(self.generating)} generating)")
            self._advance(t_next - self.t)
            if self.t_event <= self.t + eps:
                self._trainer_event()
                self.dirty = True
            while self.tools and self.tools[0][0] <= self.t + eps:
                self._tool_done(self.hq.heappop(self.tools)[2])
            if not self.frozen:
                for r in self.replicas:
                    while r.heap and r.heap[0][0] <= r.P + eps * max(1.0, r.P):
                        _, _, req = self.hq.heappop(r.heap)
                        del r.running[id(req)]
                        self._book(req, req.p_end)
                        if r.queue:
                            self._admit(r, r.queue.pop(0))
                        self._turn_done(req)
        return self._summary(steps, warmup)

    def _summary(self, steps: int, warmup: int) -> dict:
        a, b = self.marks[warmup - 1] if warmup else {k: 0.0 for k in self.acc}, self.marks[steps - 1]
        t0, t1 = self.steps_end[warmup], self.steps_end[steps]
        span = t1 - t0
        trained = sum(self.trained_tokens[warmup:steps])
        lags: dict = {}
        for k in range(warmup, steps):
            for lag, n in self.lag_tokens.get(k, {}).items():
                lags[lag] = lags.get(lag, 0.0) + n
        total = sum(lags.values()) or 1.0
        mean_lag = sum(k * v for k, v in lags.items()) / total
        run, p99 = 0.0, 0
        for lag in sorted(lags):
            run += lags[lag]
            if run >= 0.99 * total:
                p99 = lag
                break
        ideal = agentic_ideal(self.wl, self.aw, self.s)
        tps = trained / span
        return {"name": self.s.name, "seed": self.seed, "step_s": span / (steps - warmup),
                "trained_tokens_per_s": tps, "of_ideal": tps / ideal["ideal_trained_tokens_per_s"],
                "fleet_utilization": (b["gen_tokens"] - a["gen_tokens"]) / (self.peak * span),
                "sandbox_utilization": (b["tool_busy"] - a["tool_busy"]) / (self.aw.env_max_concurrent * span),
                "staleness_mean": mean_lag, "staleness_p99": p99, "staleness_max": max(lags, default=0),
                "staleness_tokens": {str(k): v / total for k, v in sorted(lags.items())},
                "max_in_flight_trajectories": self.max_in_flight_trajs, "max_sandboxes_in_use": self.max_sandboxes,
                "max_groups": self.max_groups, "partial_ratio": self.crossed[1] / max(1, self.crossed[0]), **ideal}


def agentic_ideal(wl: sim_server.Workload, aw: AgenticWorkload, s: AgenticSetup) -> dict:
    """The step no configuration can beat: the expected tokens of B fresh groups (sim_server's lengths, as
    split_ideal) at the largest of the fleet's peak, training + weight update, and the sandbox pool busy all the time
    with the step's (turns - 1) B N tool calls of mean median x exp(sigma^2 / 2). E[L] in closed form: a length is
    log-normal (median median_tokens, sigma sqrt(group_sigma^2 + traj_sigma^2)) capped at max_new_tokens, so
    E[min(L, H)] = e^(mu + s^2/2) Phi((ln H - mu - s^2) / s) + H (1 - Phi((ln H - mu) / s)) (the floor at
    min_tokens changes it by less than a token); the same for every seed."""
    mu, sd = math.log(wl.median_tokens), math.hypot(wl.group_sigma, wl.traj_sigma)
    H = wl.max_new_tokens

    def phi(x):
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))
    mean_length = (math.exp(mu + sd ** 2 / 2) * phi((math.log(H) - mu - sd ** 2) / sd)
                   + H * (1 - phi((math.log(H) - mu) / sd)))
    tokens = wl.num_prompts_per_step * wl.num_trajectories_per_prompt * mean_length
    peak = sum(wl.replica_peak_tokens_per_s(g) for g in s.replicas)
    tool_s = (wl.num_prompts_per_step * wl.num_trajectories_per_prompt * (aw.turns - 1) * aw.tool_median_s
              * math.exp(aw.tool_sigma ** 2 / 2))
    bounds = {"fleet": tokens / peak, "training": tokens / (wl.train_tokens_per_s_per_gpu * s.train_gpus)
              + wl.update_weights_s, "sandboxes": tool_s / aw.env_max_concurrent}
    step = max(bounds.values())
    return {"ideal_step_s": step, "ideal_trained_tokens_per_s": tokens / step,
            "ideal_bound": max(bounds, key=bounds.get)}


def agentic_grid(B: int, N: int) -> list[tuple[AgenticSetup, dict]]:
    """The rows: S = B N, 2 B N, 4 B N, each with and without rollout.partial, on the spec's 8:8 fleet; then the
    sensitivity rows with partial: tool latency x 1/4 and a pool half as large at B N and 2 B N, tool latency x 4
    (sandbox-bound) and the generation-bound 12:4 split at all three. Each entry: (setup, overrides of
    AgenticWorkload)."""
    rows = []
    for k in (1, 2, 4):
        for partial in (False, True):
            rows.append((AgenticSetup(f"S={k}BN{' partial' if partial else ''}", k * B * N, partial), {}))
    for tag, over, split, ks in (("tool x1/4", {"tool_median_s": 6.0}, (8, 8), (1, 2)),
                                 ("pool 192", {"env_max_concurrent": 192}, (8, 8), (1, 2)),
                                 ("tool x4", {"tool_median_s": 96.0}, (8, 8), (1, 2, 4)),
                                 ("split 12:4", {}, (12, 4), (1, 2, 4))):
        for k in ks:
            rows.append((AgenticSetup(f"S={k}BN partial, {tag}", k * B * N, True, train_gpus=split[0],
                                      infer_gpus=split[1]), over))
    return rows


def _interval(xs: list) -> tuple[float, float]:
    """(mean, half-width of the 95% Student-t interval) over the seeds."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, math.nan
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    t = T_975.get(n - 1) or T_975[max(k for k in T_975 if k <= n - 1)]
    return m, t * sd / math.sqrt(n)


def agentic_rows(results: list[dict]) -> list[dict]:
    by: dict = {}
    for r in results:
        by.setdefault(r["name"], []).append(r)
    rows = []
    for name, rs in by.items():
        row = {k: rs[0][k] for k in ("name", "ideal_step_s", "ideal_trained_tokens_per_s", "ideal_bound",
                                     "async_max_concurrent_samples", "partial", "workload")}
        row["seeds"] = len(rs)
        for key in ("trained_tokens_per_s", "of_ideal", "fleet_utilization", "sandbox_utilization",
                    "staleness_mean", "staleness_p99", "step_s", "partial_ratio"):
            row[key] = _interval([r[key] for r in rs])
        row["staleness_max"] = max(r["staleness_max"] for r in rs)
        row["max_in_flight_trajectories"] = max(r["max_in_flight_trajectories"] for r in rs)
        row["max_sandboxes_in_use"] = max(r["max_sandboxes_in_use"] for r in rs)
        rows.append(row)
    return rows


def agentic_table(rows: list[dict]) -> str:
    cols = ["row", "`async_max_concurrent_samples`", "`partial`", "trained tokens / s", "of the ideal",
            "fleet utilisation", "sandbox utilisation", "token staleness mean", "token staleness p99", "step (s)",
            "partial_ratio", "in flight max", "seeds"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * len(cols)) + "|"]

    def iv(x, fmt):
        return f"{fmt.format(x[0])} ± {fmt.format(x[1])}"
    for r in rows:
        lines.append("| " + " | ".join([
            r["name"], str(r["async_max_concurrent_samples"]), str(r["partial"]).lower(),
            iv(r["trained_tokens_per_s"], "{:.0f}"), iv(r["of_ideal"], "{:.3f}"),
            iv(r["fleet_utilization"], "{:.2f}"), iv(r["sandbox_utilization"], "{:.2f}"),
            iv(r["staleness_mean"], "{:.2f}"), iv(r["staleness_p99"], "{:.1f}"), iv(r["step_s"], "{:.0f}"),
            f"{r['partial_ratio'][0]:.2f}", str(r["max_in_flight_trajectories"]), str(r["seeds"])]) + " |")
    return "\n".join(lines)


def agentic_plot(rows: list[dict], path: str) -> None:
    """Trained tokens/s (share of the ideal) against mean token staleness, one line per `partial` through
    S = B N, 2 B N, 4 B N; bars: the 95% intervals over the seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    main = [r for r in rows if "," not in r["name"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5.5))
    lines = [(f"partial={str(p).lower()}", color, "-o", [r for r in main if r["partial"] == p])
             for p, color in ((False, "tab:red"), (True, "tab:blue"))]
    tags = list(dict.fromkeys(r["name"].split(", ", 1)[1] for r in rows if ", " in r["name"]))
    for tag, color in zip(tags, ("tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:gray")):
        lines.append((f"partial=true, {tag}", color, "--^", [r for r in rows if r["name"].endswith(", " + tag)]))
    for label, color, fmt, sel in lines:
        sel = sorted(sel, key=lambda r: r["async_max_concurrent_samples"])
        if not sel:
            continue
        x = [r["staleness_mean"][0] for r in sel]
        a.errorbar(x, [r["of_ideal"][0] for r in sel], xerr=[r["staleness_mean"][1] for r in sel],
                   yerr=[r["of_ideal"][1] for r in sel], fmt=fmt, color=color, capsize=3, label=label, ms=5)
        for r, xi in zip(sel, x):
            a.annotate(r["name"].split()[0], (xi, r["of_ideal"][0]), fontsize=6, xytext=(4, -9),
                       textcoords="offset points")
    for partial, color in ((False, "tab:red"), (True, "tab:blue")):
        sel = sorted((r for r in main if r["partial"] == partial), key=lambda r: r["async_max_concurrent_samples"])
        if not sel:
            continue
        label = f"partial={str(partial).lower()}"
        S = [r["async_max_concurrent_samples"] for r in sel]
        b.errorbar(S, [r["fleet_utilization"][0] for r in sel], yerr=[r["fleet_utilization"][1] for r in sel],
                   fmt="-o", color=color, capsize=3, label=f"fleet, {label}")
        b.errorbar(S, [r["sandbox_utilization"][0] for r in sel], yerr=[r["sandbox_utilization"][1] for r in sel],
                   fmt="--s", color=color, capsize=3, label=f"sandboxes, {label}")
    a.axhline(1.0, color="k", linestyle=":", linewidth=1)
    a.set_xlabel("token staleness, mean (trainer version - version that generated the token)")
    a.set_ylabel("trained tokens / s, share of the ideal")
    a.set_title("async_max_concurrent_samples = B N, 2 B N, 4 B N (dashed: sensitivity rows)", fontsize=9)
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
    b.set_xscale("log", base=2)
    b.set_xlabel("async_max_concurrent_samples (trajectories)")
    b.set_ylabel("utilisation")
    b.set_title("spec fleet 8:8: fleet (tokens vs peak) and sandbox pool (busy share)", fontsize=9)
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    _save_figure(fig, path, "pipeline_sim --agentic: a discrete-event model (not a measurement); bars: 95% intervals "
                 "over seeds")


def run_agentic(args, wl: sim_server.Workload) -> int:
    B, N = wl.num_prompts_per_step, wl.num_trajectories_per_prompt
    base = AgenticWorkload(turns=args.turns, tool_median_s=args.tool_median_s, tool_sigma=args.tool_sigma,
                           env_max_concurrent=args.sandboxes)
    base.check()
    grid_rows = agentic_grid(B, N)
    if args.only:  # (a sensitivity row's name has a comma: separate those with ";")
        names = [n.strip() for n in args.only.split(";" if ";" in args.only else ",")]
        grid_rows = [g for g in grid_rows if g[0].name in names]
        if not grid_rows:
            raise SystemExit(f"--only: no agentic row named {names}; known: "
                             f"{', '.join(s.name for s, _ in agentic_grid(B, N))}")
    print("Simulated: a discrete-event model of the fleet, the tools, the sandbox pool and the trainer (no project "
          "code runs but the window rule, strategies.py); a model, not a measurement.", flush=True)
    print(f"workload: B={B} N={N} M={wl.mini_batch_size}, {base.turns} model turns per episode, tool latency "
          f"log-normal median {base.tool_median_s:g} s sigma {base.tool_sigma:g}, rollout.env_max_concurrent "
          f"{base.env_max_concurrent}; {args.steps} steps ({args.warmup} excluded), seeds {args.seeds}", flush=True)
    t0 = time.monotonic()
    results = []
    for s, over in grid_rows:
        aw = dataclasses.replace(base, **over)
        for seed in range(args.seeds):
            t1 = time.monotonic()
            r = AgenticSim(wl, aw, s, seed).run(args.steps, args.warmup)
            r.update(async_max_concurrent_samples=s.async_max_concurrent_samples, partial=s.partial,
                     workload=dataclasses.asdict(aw))
            results.append(r)
            print(f"  {s.name} seed {seed}: {r['trained_tokens_per_s']:.0f} tok/s ({r['of_ideal']:.3f} of ideal), "
                  f"staleness {r['staleness_mean']:.2f} / p99 {r['staleness_p99']} [{time.monotonic() - t1:.1f} s]",
                  flush=True)
    rows = agentic_rows(results)
    print()
    print(agentic_table(rows))
    print()
    ideals = {(r["ideal_step_s"], r["ideal_bound"]) for r in rows}
    print("ideal step (bound): " + "; ".join(f"{s:.0f} s ({b})" for s, b in sorted(ideals)))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"runs": results, "rows": rows}, f, indent=1)
    png = args.png or os.path.join("runs", "pipeline_sim_agentic.png")
    agentic_plot(rows, png)
    print(f"figure: {png}")
    print(f"wall time: {time.monotonic() - t0:.0f} s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small, fast grid (B=16, 3 steps): checks that it runs")
    ap.add_argument("--steps", type=int, default=None, help="training steps per configuration (default 9; quick 3)")
    ap.add_argument("--compression", type=float, default=None,
                    help="simulated seconds per wall second (default 120; quick 1000)")
    ap.add_argument("--token-scale", type=int, default=32, help="model tokens per simulated output token")
    ap.add_argument("--workload", dest="workload_path", default=None,
                    help="YAML of sim_server.Workload fields (default: the spec workload)")
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--policies", action="store_true",
                    help="every staleness policy (spec strategies + peers' presets) at 8:8 and 10:6, one table")
    ap.add_argument("--sweep", action="store_true",
                    help="every rule over its knob (--levels) and at the peers' default knobs, at 8:8 and 10:6, "
                         "--repeats times in alternating order: throughput against measured staleness")
    ap.add_argument("--levels", default="1,2,4", help="--sweep: knob levels in steps of staleness")
    ap.add_argument("--repeats", type=int, default=3, help="--sweep: runs of each configuration")
    ap.add_argument("--batch-scale", type=int, default=1,
                    help="divide B, M, the fleet's concurrency and the training throughput by this (same step time "
                         "and split ratio, 1/f of the real code's work per step)")
    ap.add_argument("--overhead-check", action="store_true",
                    help="run the --only configurations (default colocate,fifo-s2) at the compression and at half "
                         "of it, and fit the real code's own time per step")
    ap.add_argument("--agentic", action="store_true",
                    help="the agentic workload (multi-turn episodes, tool latency, a sandbox pool): a discrete-event "
                         "model, async_max_concurrent_samples at B N, 2 B N, 4 B N with and without partial")
    ap.add_argument("--seeds", type=int, default=5, help="--agentic: repeats of each row (workload and tool seeds)")
    ap.add_argument("--warmup", type=int, default=4, help="--agentic: first steps left out of the measurement")
    ap.add_argument("--turns", type=int, default=AgenticWorkload.turns, help="--agentic: model turns per episode")
    ap.add_argument("--tool-median-s", type=float, default=AgenticWorkload.tool_median_s,
                    help="--agentic: median tool-call latency, simulated s")
    ap.add_argument("--tool-sigma", type=float, default=AgenticWorkload.tool_sigma,
                    help="--agentic: log-normal sigma of the tool-call latency")
    ap.add_argument("--sandboxes", type=int, default=AgenticWorkload.env_max_concurrent,
                    help="--agentic: the sandbox pool, rollout.env_max_concurrent")
    ap.add_argument("--json", dest="json_path", default=None, help="write one record per configuration here")
    ap.add_argument("--png", default=None, help="step-time and staleness figure (default: next to --json, or "
                                                "runs/pipeline_sim.png)")
    args = ap.parse_args(argv)
    if args.agentic:  # no project process runs: no tokenizer, no fleet, no fork
        args.steps = args.steps or 16
        if args.seeds < 1 or not 0 <= args.warmup < args.steps:
            raise SystemExit(f"--agentic needs --seeds >= 1 and 0 <= --warmup < --steps, got {args.seeds}, "
                             f"{args.warmup}, {args.steps}")
        wl = sim_server.load_workload(args.workload_path)
        if args.batch_scale > 1:
            wl = scaled_workload(wl, args.batch_scale)
            args.sandboxes = max(1, args.sandboxes // args.batch_scale)
        return run_agentic(args, wl)
    args.steps = args.steps or (3 if args.quick else 9)
    args.compression = args.compression or (1000.0 if args.quick else 120.0)
    wl = sim_server.load_workload(args.workload_path)
    if args.batch_scale > 1:  # the fleet reads its workload from a file: write the scaled one
        wl = scaled_workload(wl, args.batch_scale)
        import strategies  # prime-rl's max_inflight counts rollouts, fixed: scaled with B (2 B in flight at B = 64)
        strategies.PRIME_MAX_INFLIGHT //= args.batch_scale
        fd, args.workload_path = tempfile.mkstemp(prefix="pipeline_sim_workload_", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(wl), f)  # JSON is YAML
    if args.quick:
        wl = dataclasses.replace(wl, num_prompts_per_step=16, mini_batch_size=32)
    from standins import tiny_model
    tok = tiny_model.build_tokenizer()
    args.eos_id = tok.eos_token_id
    args.filler_id = tok.convert_tokens_to_ids("7")
    import buffer, rollout, train  # noqa: E401,F401  (imported before forking: each child starts warm)
    setups = grid(args.quick)
    known = {s.name: s for s in grid(False)}
    if args.policies:
        setups = policy_grid(args.quick, wl.num_prompts_per_step, wl.num_trajectories_per_prompt)
        known = {s.name: s for s in policy_grid(False, wl.num_prompts_per_step, wl.num_trajectories_per_prompt)}
    if args.sweep:
        B, N = wl.num_prompts_per_step, wl.num_trajectories_per_prompt
        levels = [int(x) for x in args.levels.split(",")]
        setups = sweep_grid(B, N, levels, ((8, 8),) if args.quick else ((8, 8), (10, 6)),
                            args.only.split(",") if args.only else None)
        known = {s.name: s for s in setups}
    if (args.only and not args.sweep) or args.overhead_check:
        names = (args.only or "colocate,fifo-s2").split(",")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"--only: unknown configuration(s) {unknown}; known: {', '.join(known)}")
        setups = [known[n] for n in names]
    print(SIMULATION_NOTE, flush=True)
    print(f"workload: B={wl.num_prompts_per_step} N={wl.num_trajectories_per_prompt} M={wl.mini_batch_size}, "
          f"{args.steps} steps per configuration, clock compression {args.compression:g}x, "
          f"1 simulated output token = {args.token_scale} model tokens; machine load average at start "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (the real code's time, x compression, grows with it)",
          flush=True)
    t0 = time.monotonic()
    if args.overhead_check:
        overhead_check(setups, args, wl)
        print(f"wall time: {time.monotonic() - t0:.0f} s")
        return 0
    if args.sweep:
        results = run_sweep(setups, args, wl)
        rows = sweep_rows(results)
        print()
        print(sweep_table(rows))
        print()
        print(SIMULATION_NOTE)
        if args.json_path:  # first: the runs are the expensive part
            with open(args.json_path, "w") as f:
                json.dump({"runs": [{k: v for k, v in r.items() if k != "per_step"} for r in results],
                           "rows": rows}, f, indent=1)
        png = args.png or os.path.join("runs", "pipeline_sim_sweep.png")
        sweep_plot(rows, png)
        print(f"figure: {png}")
        print(f"wall time: {time.monotonic() - t0:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")
        return 1 if any(r["errors"] for r in rows) else 0
    results = run_grid(setups, args, wl)
    print()
    if args.policies:
        print(policies_table(results))
        print()
        print(SIMULATION_NOTE + " Thrown away: tokens of groups aborted and restarted, dropped as too old, or dropped "
              "by a filter (rollout/discarded_tokens); samples dropped: the groups' trajectories.")
        print(f"wall time: {time.monotonic() - t0:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(results, f, indent=1)
        return 1 if any("error" in r or not r["accounting"]["balanced"] or r["accounting"]["trained_twice"]
                        for r in results) else 0
    print(markdown(results))
    print()
    print(SIMULATION_NOTE)
    print()
    print("Per-phase breakdown, simulated seconds per step, steady state. train / weight update / release+resume: "
          "the modeled compute. waiting for data: the trainer blocked in buffer.get. overhead: the rest, i.e. the "
          "project's own code on the trainer's critical path (pause = abort + collect + step_boundary, or with "
          "pause_mode in_place the servers' pause + step_boundary; HTTP, "
          "metrics, thread hand-offs); it runs in wall time, so the compressed clock multiplies it by the "
          "compression. 'at 1x': the same step with that overhead at real time (measured - overhead x (1 - 1/k)); "
          "an estimate for training-bound configurations only (a generation-bound fleet keeps decoding during part "
          "of the pause); --overhead-check measures all of the real code's time by a fit instead.")
    print(phase_table(results))
    print()
    if args.quick:
        print("--quick: a smoke run (B=16, few steps, high compression); its figures are not the benchmark's.")
    else:
        for line in acceptance(results):
            print(line)
    print(f"wall time: {time.monotonic() - t0:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")
    png = args.png or (os.path.splitext(args.json_path)[0] + ".png" if args.json_path else
                       os.path.join("runs", "pipeline_sim.png"))
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    plot(results, png)
    print(f"figure: {png}")
    if args.json_path:
        keys = ("name", "avg_step_s", "avg_step_excl0_s", "speedup", "efficiency", "pipeline_buf_size",
                "partial_ratio", "partial_restored")
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump([{**{k: r.get(k) for k in keys}, **{k: v for k, v in r.items() if k not in keys}}
                       for r in results], f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
