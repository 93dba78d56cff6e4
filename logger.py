"""logger.py: the metrics and logging of a run: a training call's metrics over micro-batches and ranks (TrainMetrics,
every rank), the spec's per-step aggregation of the training calls' metrics (aggregate), and rank 0's Logger: the
stdout line per step, metrics.jsonl, samples/*.jsonl, the waiting line (waiting.jsonl) and wandb when
logging.wandb.enable. train.py's step loop calls Logger.log once per step."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import torch

import config as config_lib


def aggregate(records: list[dict]) -> dict:
    """Per-call metrics -> one value per step, by the specification's naming rule (docs/metrics.md): timing/*
    summed, *_max max, *_min min, everything else averaged over the calls that reported it."""
    out: dict = {}
    for key in dict.fromkeys(k for r in records for k in r):
        vals = [float(r[key]) for r in records if key in r and isinstance(r[key], (int, float, torch.Tensor))]
        if not vals:
            continue
        if key.startswith("timing/"):
            out[key] = sum(vals)
        elif key.endswith("_max"):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out


def trained_group_metrics(groups: list) -> dict:
    """What one training call consumed (partial_ratio and staleness of it come from buffer.step_metrics)."""
    trajs = [t for g in groups for t in g.trajectories]
    return {"train/reward_mean": sum(t.reward for t in trajs) / max(1, len(trajs)),
            "train/response_length_mean": sum(len(t.response_ids) for t in trajs) / max(1, len(trajs))}


def sample_records(groups: list, per_group: Optional[int] = None) -> list[dict]:
    """Plain records of the trajectories (the first per_group of each group) for samples/*.jsonl: token ids,
    reward, label, per-token weight versions and loss mask, status, and the id [epoch, seq, index]."""
    return [{"prompt_ids": t.prompt_ids.tolist(), "response_ids": t.response_ids.tolist(), "reward": t.reward,
             "label": g.prompt.label, "versions": t.versions.tolist(), "loss_mask": t.loss_mask.tolist(),
             "status": t.status, "id": [t.epoch, t.seq, t.index]} for g in groups for t in g.trajectories[:per_group]]


def train_samples(groups: list, limit: int, taken: int) -> list[dict]:
    """The records of a training call's groups for samples/train.jsonl (logging.train_samples = limit): the first
    trajectory of each group until `limit` a step (`taken` so far), or with -1 every trajectory of every group."""
    return sample_records(groups) if limit < 0 else sample_records(groups[:max(0, limit - taken)], per_group=1)


class TrainMetrics:
    """One training call's metrics on one rank, over its micro-batches, and their reduction over the ranks:
    train/pg_loss summed (each micro-batch's share of the mini-batch loss), other means token-weighted, *_max / *_min
    over every micro-batch with loss tokens, and sums (add_sums: offpolicy/*) summed."""

    def __init__(self):
        self.sums, self.weights, self.extremes = {}, {}, {}

    def add_sums(self, sums: dict) -> None:
        for k, v in sums.items():
            self.sums[k], self.weights[k] = self.sums.get(k, 0.0) + float(v), 1.0

    def add(self, metrics: dict, n_tokens: float) -> None:
        """One micro-batch's metrics, of n_tokens loss tokens."""
        for k, v in metrics.items():
            v = float(v)
            if k.endswith("_max") or k.endswith("_min"):
                if n_tokens > 0:
                    self.extremes.setdefault(k, []).append(v)
            elif k == "train/pg_loss":
                self.add_sums({k: v})
            elif n_tokens > 0:
                self.sums[k] = self.sums.get(k, 0.0) + v * n_tokens
                self.weights[k] = self.weights.get(k, 0.0) + n_tokens

    def state(self) -> tuple:
        return self.sums, self.weights, self.extremes

    @staticmethod
    def reduce(parts: list) -> dict:
        """Every rank's state() -> one value per metric."""
        out = {}
        for k in dict.fromkeys(k for s, _, _ in parts for k in s):
            tot = sum(s.get(k, 0.0) for s, _, _ in parts)
            w = sum(wt.get(k, 0.0) for _, wt, _ in parts)
            out[k] = tot if k == "train/pg_loss" or k.startswith("offpolicy/") else tot / max(w, 1e-9)
        for k in dict.fromkeys(k for _, _, e in parts for k in e):
            vals = [v for _, _, e in parts for v in e.get(k, [])]
            out[k] = max(vals) if k.endswith("_max") else min(vals)
        return out


class Logger:
    """Rank 0's logging: a stdout line per step with progress, metrics.jsonl (one object per step, `step` key),
    the resolved config beside it, and wandb when logging.wandb.enable. What the model writes goes to
    run_dir/samples/: `step_NNNNNN.jsonl` (every greedy eval response after NNNNNN steps) and `train.jsonl` (a few
    trained trajectories per step, with per-token weight versions); with wandb, the same as tables.

    A fresh run (keep_until None) appends to them and never truncates: a file already holding lines is another
    run's, and is refused (rundir.claim refuses such a run_dir before anything starts, or moves those files aside).
    A resumed run keeps its own lines up to step keep_until and drops those after it, so metrics.jsonl is the history
    of the weights being trained (a step whose checkpoint was lost is trained again and logged again; -1: the run
    starts again from step 0 and keeps none).
    """

    def __init__(self, cfg, keep_until: Optional[int] = None, tokenizer=None):
        self.cfg, self.total, self.tokenizer = cfg, cfg.trainer.total_steps, tokenizer
        self.samples_dir = os.path.join(cfg.run_dir, "samples")
        os.makedirs(self.samples_dir, exist_ok=True)
        self.path = os.path.join(cfg.run_dir, "metrics.jsonl")
        self.train_samples = os.path.join(self.samples_dir, "train.jsonl")
        self.waiting_path = os.path.join(cfg.run_dir, "waiting.jsonl")
        for path in (self.path, self.train_samples, self.waiting_path):
            if keep_until is None:
                if os.path.exists(path) and os.path.getsize(path):
                    raise RuntimeError(f"{path} holds another run's lines and this run starts fresh; it is not "
                                       "truncated: resume that run (trainer.resume=auto) or start over "
                                       "(trainer.overwrite=true moves its files aside)")
                continue
            kept = []
            if os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line)["step"] <= keep_until]
            with open(path + ".tmp", "w") as f:  # (a crash while trimming leaves the file whole)
                f.writelines(kept)
            os.replace(path + ".tmp", path)
        self.t0, self.first_step = time.time(), None
        self.start = time.time()
        self.length_warned = False
        self.wandb = None
        if cfg.logging.wandb.enable:
            import wandb

            w = cfg.logging.wandb
            self.wandb = wandb.init(project=w.project, name=w.name or os.path.basename(os.path.abspath(cfg.run_dir)),
                                    mode=w.mode, dir=cfg.run_dir, config=config_lib.to_dict(cfg), resume="allow",
                                    id=w.name or os.path.basename(os.path.abspath(cfg.run_dir)))

    def samples(self, step: int, records: list[dict], eval_: bool) -> None:
        """Decoded records -> samples/step_NNNNNN.jsonl (eval_) or one line each in samples/train.jsonl."""
        if not records or self.tokenizer is None:
            return
        # a trained trajectory's per-token fields come with its tokens: a BPE tokenizer's text does not say where
        # one token ends, and re-encoding it need not give back the sampled ones
        rows = [{"step": step, "prompt": self.tokenizer.decode(r["prompt_ids"]),
                 "response": self.tokenizer.decode(r["response_ids"]), "reward": r["reward"], "label": r["label"],
                 **({} if eval_ else {"response_ids": r["response_ids"], "versions": r["versions"],
                                      "loss_mask": r["loss_mask"], "status": r["status"], "id": r["id"]})}
                for r in records]
        path = os.path.join(self.samples_dir, f"step_{step:06d}.jsonl") if eval_ else self.train_samples
        with open(path, "w" if eval_ else "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if self.wandb is not None:
            import wandb

            cols = list(rows[0])
            self.wandb.log({"samples/eval" if eval_ else "samples/train": wandb.Table(
                columns=cols, data=[[json.dumps(r[c]) if isinstance(r[c], list) else r[c] for c in cols]
                                    for r in rows])}, step=step)

    def log(self, step: int, metrics: dict) -> None:
        self.samples(step, metrics.pop("data/samples", None), eval_=False)
        self.samples(step, metrics.pop("data/eval_samples", None), eval_=True)
        metrics = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        cut = metrics.get("rollout/truncation_ratio", 0.0)
        if cut > 0.5 and not self.length_warned:  # once: most answers cut short score as wrong whatever is learned
            self.length_warned = True
            print(f"[train] warning: {cut:.0%} of the responses finished in step {step} ended at "
                  f"rollout.sampling.max_new_tokens={self.cfg.rollout.sampling.max_new_tokens} tokens without "
                  "stopping (rollout/truncation_ratio); raise it if this task's answers need more", file=sys.stderr,
                  flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self.first_step is None or step <= self.first_step:  # the ETA counts from the first training step
            self.first_step, self.t0 = step, time.time()
        done = max(1, step - self.first_step)
        eta = (time.time() - self.t0) / done * (self.total - step)
        parts = [f"step {step}/{self.total} ({100 * step // max(1, self.total)}%)"]
        for key, label, fmt in (("rollout/reward_mean", "reward", ".3f"), ("eval/reward_mean", "eval", ".3f"),
                                ("rollout/pipeline_buf_size", "buf", ".0f"), ("rollout/partial_ratio", "partial",
                                                                              ".2f"),
                                ("train/grad_norm", "gnorm", ".3f"), ("timing/step", "step_s", ".2f"),
                                ("perf/wait_ratio", "wait", ".2f")):
            if isinstance(metrics.get(key), (int, float)):
                parts.append(f"{label} {metrics[key]:{fmt}}")
                if key == "eval/reward_mean" and metrics.get("eval/failed_count"):  # over the prompts that did not fail
                    parts[-1] += f" ({metrics['eval/failed_count']} failed)"
        el = time.time() - self.start
        parts.append(f"elapsed {int(el // 60)}m{int(el % 60):02d}s eta {int(eta // 60)}m{int(eta % 60):02d}s")
        print(" | ".join(parts), flush=True)

    def waiting(self, step: int, rec: dict) -> None:
        """One line while the trainer waits for the groups of `step` (run_steps' fetch), also in waiting.jsonl and
        wandb (`waiting/*`): what it waits for, what the rollout made meanwhile, what the filter dropped and why."""
        reasons = ", ".join(f"{r}: {c}" for r, c in sorted(rec["drop_reasons"].items(), key=lambda x: -x[1])[:3])
        parts = [f"[train] step {step}: waiting {rec['waited_s']:.0f} s for groups, {rec['ready']}/{rec['needed']} "
                 f"ready", f"{rec['generated']} trajectories generated in the last {rec['seconds']:.0f} s, "
                 f"{rec['in_flight']} in flight", f"rollout.filter dropped {rec['filter_drop']} groups"
                 + (f" ({reasons})" if reasons else "")]
        if "servers_total" in rec:
            parts.append(f"servers answering {rec['servers_up']}/{rec['servers_total']}")
        print(" | ".join(parts), flush=True)
        with open(self.waiting_path, "a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **rec}) + "\n")
        if self.wandb is not None:
            self.wandb.log({f"waiting/{k}": v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
