"""train.py: the RL trainer. FSDP2 policy training, driving the rollout producer, synchronous or fully-async.

One `main()` reads top to bottom: config -> distributed init -> model -> FSDP2 -> optimizer -> inference servers,
buffer and rollout processes -> `run_steps`, the step loop of ../shared/spec/fully_async_mode.md section 2:
  fully-async (fully_async.enable=true): (B x N) // M training calls of M // N groups from the PipelineBuffer, then
    pause the producer (rollout.pause_mode: abort and restore, or keep the requests on the paused servers; or
    wait), metrics, checkpoint every trainer.save_freq, weight sync (cache flushed unless in_place, version + 1),
    resume;
  synchronous (false): wait for the step's B groups, pause, (colocate: the servers release their memory), train,
    (resume memory), weight sync, resume.
Rank 0 starts the inference servers (engine.py on CPU, SGLang on GPUs, or connects to rollout.servers /
rollout.router_url), the buffer process (`python buffer.py`) and the rollout process (`python rollout.py --serve`)
through services.py (launching, supervision, RPC), joins RPC as "trainer" and runs the loop; every other rank follows rank 0's commands (train its share of each
mini-batch, gather weights for the sync, save checkpoints). Children log to run_dir/logs/ and are stopped on exit.
Faults: a launched server that dies is relaunched and gets the weights at the next sync; any other child that dies
stops the run with its report (the process, its exit code or signal, its log's last lines) as the one error line;
bad inputs (config, dataset rows, a checkpoint given to resume) are refused before anything starts (exit code 2),
as is a run that cannot train (rollout.filter drops every group: buffer.NothingToTrain names the rewards it saw).
While the trainer waits for groups it says every logging.wait_line_s what it waits for (fetch).

Run (CPU: the tiny pretrained model on the reverse-digits task; greedy eval 0.30 -> >= 0.9 by step 300, ~8 min):
    torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml
    torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml fully_async.enable=false
    python train.py plot runs/tiny                     # metrics.jsonl -> runs/tiny/metrics.png
Multi-node (GPU), on each trainer node K; each node's local rank 0 launches its servers of rollout.server_layout
(or give rollout.servers already running):
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank K --rdzv_backend static --master_addr HEAD \
        --master_port 29400 train.py --config configs/qwen3_30b_a3b_dapo.yaml trainer.num_nodes=2

Simplifications: the model is a HF causal LM sharded by FSDP2 over its decoder layers (data parallel only, no
tensor/pipeline/expert parallelism); micro-batches are packed rows (trainer.packing) unpacked to one sequence per
row for losses.py; GPU-only paths (nccl, bf16 compute, flash_attention_2, CUDA IPC weight sync, launching SGLang)
are switched on by device=cuda / rollout.launch=sglang and run by bench/gpu_smoke.sh, not on CPU.
Log-prob convention (shared with engine.py and losses.py): log_softmax(logits / temperature) of the sampled token.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import faulthandler
import gc
import glob
import itertools
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from typing import Callable, Optional

# torch's C++ warnings, above all the RPC agent's "eof" the moment a child dies, would print before the root-cause
# error rank 0 reports (Services); C++ errors still print. TORCH_CPP_LOG_LEVEL=WARNING shows them.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402  (after the log level, which torch reads when it loads)
import torch.distributed as dist  # noqa: E402

import buffer as buffer_lib  # noqa: E402
import config as config_lib  # noqa: E402
import services as services_lib  # noqa: E402
import strategies  # noqa: E402
import weight_sync as weight_sync_lib  # noqa: E402
# memory.py: the start-up memory estimate (its names also reachable as train.X, as scripts use them)
from memory import (CUDA_RUNTIME_GIB, GIB, memory_estimate, memory_report,  # noqa: E402,F401
                    optimizer_impl, param_counts)
from services import GRACE_S, ChildExited, Services  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
STARTUP_ERROR_WAIT_S = 30.0  # a rank other than 0 that refused the config waits this long for torchrun to stop it


# ---------------------------------------------------------------------------------------------------------------
# Metrics: the spec's aggregation rule, and the one logging function of rank 0
# ---------------------------------------------------------------------------------------------------------------

def aggregate(records: list[dict]) -> dict:
    """Per-call metrics -> one value per step, by name (spec section 4): timing/* summed, *_max max, *_min min,
    everything else averaged over the calls that reported it."""
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


SAMPLES_PER_STEP = 4  # trained trajectories written to samples/train.jsonl per step (one per group)


def sample_records(groups: list, per_group: Optional[int] = None) -> list[dict]:
    """Plain records of the trajectories (the first per_group of each group) for samples/*.jsonl: token ids,
    reward, label, per-token weight versions and loss mask, status."""
    return [{"prompt_ids": t.prompt_ids.tolist(), "response_ids": t.response_ids.tolist(), "reward": t.reward,
             "label": g.prompt.label, "versions": t.versions.tolist(), "loss_mask": t.loss_mask.tolist(),
             "status": t.status} for g in groups for t in g.trajectories[:per_group]]


class Logger:
    """Rank 0's logging: a stdout line per step with progress, metrics.jsonl (one object per step, `step` key),
    the resolved config beside it, and wandb when logging.wandb.enable. What the model writes goes to
    run_dir/samples/: `step_NNNNNN.jsonl` (every greedy eval response after NNNNNN steps) and `train.jsonl` (a few
    trained trajectories per step, with per-token weight versions); with wandb, the same as tables.

    On resume, lines of steps after the checkpoint are dropped, so metrics.jsonl is the history of the weights
    being trained (a step whose checkpoint was lost is trained again and logged again).
    """

    def __init__(self, cfg, keep_until: int = -1, tokenizer=None):
        self.cfg, self.total, self.tokenizer = cfg, cfg.trainer.total_steps, tokenizer
        self.samples_dir = os.path.join(cfg.run_dir, "samples")
        os.makedirs(self.samples_dir, exist_ok=True)
        self.path = os.path.join(cfg.run_dir, "metrics.jsonl")
        self.train_samples = os.path.join(self.samples_dir, "train.jsonl")
        self.waiting_path = os.path.join(cfg.run_dir, "waiting.jsonl")
        for path in (self.path, self.train_samples, self.waiting_path):  # a resumed run keeps its history
            kept = []
            if keep_until >= 0 and os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line)["step"] <= keep_until]
            with open(path, "w") as f:
                f.writelines(kept)
        self.t0, self.first_step = time.time(), None
        self.start = time.time()
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
        rows = [{"step": step, "prompt": self.tokenizer.decode(r["prompt_ids"]),
                 "response": self.tokenizer.decode(r["response_ids"]), "reward": r["reward"], "label": r["label"],
                 **({} if eval_ else {"versions": r["versions"], "loss_mask": r["loss_mask"],
                                      "status": r["status"]})} for r in records]
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


# ---------------------------------------------------------------------------------------------------------------
# The step loop (also driven by bench/pipeline_sim.py with simulated compute)
# ---------------------------------------------------------------------------------------------------------------

def fetch(cfg, buffer, k: int, step: int, logger, servers: Optional[Callable[[], dict]] = None) -> list:
    """buffer.get(k) within buffer.get_timeout_s. While it waits, a logger.waiting line every logging.wait_line_s
    (buffer.wait: groups ready, trajectories generated and in flight, groups the filter dropped and why; `servers`:
    URL -> answering /health); buffer.NothingToTrain as soon as the buffer says the filter drops everything."""
    limit, every = cfg.buffer.get_timeout_s, cfg.logging.wait_line_s
    t0 = time.monotonic()
    mark = every or limit
    while True:
        w = buffer.wait(k, max(0.0, t0 + min(mark, limit) - time.monotonic()))
        if w.get("stop"):
            raise buffer_lib.NothingToTrain(w["stop"])
        if w["ready"] >= k:
            return buffer.get(k, timeout=max(1.0, t0 + limit - time.monotonic()))
        waited = time.monotonic() - t0
        if waited >= limit:
            raise TimeoutError(f"the trainer waited buffer.get_timeout_s={limit} s for {k} groups and {w['ready']} "
                               f"are buffered ({w['in_flight']} trajectories in flight, {w['generated']} generated "
                               f"and {w['filter_drop']} groups dropped by rollout.filter in the last "
                               f"{w['seconds']:.0f} s); is the rollout running?")
        if every and waited >= mark:
            rec = {**{key: v for key, v in w.items() if key != "stop"}, "waited_s": waited}
            if servers is not None:
                try:
                    up = servers()
                    rec.update(servers_up=sum(up.values()), servers_total=len(up))
                except Exception as e:  # a router that does not answer: say so, keep waiting
                    rec.update(servers_up=0, servers_total=0, servers_error=str(e)[:200])
            logger.waiting(step, rec)
            mark += every


def run_steps(cfg, actor, buffer, rollout, logger, start_step: int,
              evaluate: Optional[Callable[[int], dict]] = None,
              servers: Optional[Callable[[], dict]] = None) -> None:
    """Train steps start_step .. trainer.total_steps - 1; step i is logged as step i + 1 (the weights after it are
    weight version i + 1; the initial weights are version 0).

    actor:    train_minibatch(groups, step) -> dict (may include timing/process_traj, which is not training time),
              sync_weights(version) -> dict | None, save_checkpoint(steps_done, run_state) -> None,
              release() / resume() (colocate: the servers free / retake their memory around training).
    buffer:   get(k, timeout) -> list[Group], wait(k, timeout) -> dict (see fetch), step_metrics() -> dict,
              state_dict(), set_weight_version(v) (buffer.PipelineServer or buffer.RemoteBuffer).
    rollout:  start(), pause() -> dict, resume(version), step_metrics() -> dict (rollout.Rollout or RemoteRollout).
    logger:   log(step, metrics: dict); metrics hold numbers plus "data/prompt_ids" ([[epoch, data_index], ...]
              in training order) and "data/samples" (sample_records of a few trained trajectories);
              waiting(step, record) while the trainer waits for groups (Logger.waiting).
    evaluate: optional fn(steps_done) -> dict, run every trainer.eval_freq steps and after the last one.
    servers:  optional fn() -> {URL: answering /health}, for the waiting line.
    run_state given to save_checkpoint: {"step": steps done, "weight_version", "buffer": buffer.state_dict()}.
    """
    sync_mode = not cfg.fully_async.enable
    gpc, total = cfg.groups_per_call, cfg.trainer.total_steps
    rollout.start()  # idempotent; the producer starts filling the buffer with the current weights
    for step in range(start_step, total):
        t_step = time.perf_counter()
        m: dict = {}
        records: list[dict] = []  # one per training call, aggregated by the spec's naming rule

        # ---- synchronous mode: the whole batch first, then the producer stops before training ----
        if sync_mode:
            t0 = time.perf_counter()
            batch = fetch(cfg, buffer, cfg.B, step + 1, logger, servers)
            m["timing/rollout"] = time.perf_counter() - t0
            m.update(rollout.pause())
            if cfg.colocate:
                m.update(actor.release() or {})

        # ---- train: (B x N) // M calls of M // N groups; fully-async fetches each from the PipelineBuffer ----
        prompt_ids, samples = [], []
        for call in range(cfg.calls_per_step):
            rec = {}
            if sync_mode:
                groups = batch[call * gpc:(call + 1) * gpc]
            else:
                t0 = time.perf_counter()
                groups = fetch(cfg, buffer, gpc, step + 1, logger, servers)
                rec["timing/rollout"] = time.perf_counter() - t0
            rec.update(trained_group_metrics(groups))
            prompt_ids += [[g.prompt.epoch, g.prompt.data_index] for g in groups]
            if len(samples) < SAMPLES_PER_STEP:
                samples += sample_records(groups[:SAMPLES_PER_STEP - len(samples)], per_group=1)
            t0 = time.perf_counter()
            out = actor.train_minibatch(groups, step) or {}
            rec["timing/train"] = time.perf_counter() - t0 - out.get("timing/process_traj", 0.0)
            records.append({**out, **rec})
        m.update(aggregate(records))

        # ---- step boundary: stop the producer, clean up in-flight work, collect the step's rollout metrics ----
        if not sync_mode:
            m.update(rollout.pause())
        elif cfg.colocate:
            m.update(actor.resume() or {})
        m.update(buffer.step_metrics())
        m.update({k: v for k, v in rollout.step_metrics().items() if k not in m})

        # ---- checkpoint (buffer state taken while paused: unconsumed, in-flight and restored groups are in it) ----
        if (cfg.trainer.save_freq and (step + 1) % cfg.trainer.save_freq == 0) or step + 1 == total:
            t0 = time.perf_counter()
            actor.save_checkpoint(step + 1, {"step": step + 1, "weight_version": step + 1,
                                             "buffer": buffer.state_dict()})
            m["timing/save_ckpt"] = time.perf_counter() - t0

        # ---- weight sync (servers flush their cache unless in_place, serve step + 1), then the producer resumes ----
        t0 = time.perf_counter()
        out = dict(actor.sync_weights(step + 1) or {})
        m["timing/update_weights"] = out.pop("timing/update_weights", time.perf_counter() - t0)
        m.update(out)
        buffer.set_weight_version(step + 1)
        if step + 1 < total:
            rollout.resume(step + 1)

        # ---- step metrics; wait is everything outside the training block (inverse timer, spec section 4) ----
        m["timing/step"] = time.perf_counter() - t_step
        m["perf/wait_ratio"] = min(1.0, max(0.0, 1.0 - m.get("timing/train", 0.0) / max(m["timing/step"], 1e-9)))
        if evaluate is not None and ((cfg.trainer.eval_freq and (step + 1) % cfg.trainer.eval_freq == 0)
                                     or step + 1 == total):
            m.update(evaluate(step + 1))
        m["data/prompt_ids"], m["data/samples"] = prompt_ids, samples
        logger.log(step + 1, m)


# ---------------------------------------------------------------------------------------------------------------
# Model, FSDP2, optimizer
# ---------------------------------------------------------------------------------------------------------------

def apply_fsdp(model, mesh, param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
               cpu_offload: bool = False) -> None:
    """FSDP2: fully_shard each decoder layer, then the root. The last layer is not resharded after forward (its
    backward comes right away). A MoE decoder layer (attention, router and all its experts) is one unit: transformers
    5 keeps a layer's experts as two fused parameters [E, ...], each sharded over the ranks along E like any other
    parameter, and a batch's tokens are routed to most experts, so they are all-gathered together (units per
    expert would add collectives and gather the same bytes; expert parallelism is not implemented).
    param_dtype/reduce_dtype None = no mixed precision (CPU, float32). cpu_offload: the shards, their gradients and
    so the optimizer state stay in host memory (pinned on cuda; pinning needs an accelerator), copied to the device
    per layer for forward and backward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    off = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    layers = model.model.layers
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off)


def reshard(model) -> None:
    """Free all-gathered parameters. Needed after a no-grad forward: the unresharded last layer and root would
    otherwise keep stale full copies (and hide the sharded parameters) until the next backward."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def load_model(cfg, mesh, device: torch.device, rank: int):
    """The HF causal LM at model.path, sharded: built on the meta device, FSDP2-wrapped, then rank 0's weights are
    broadcast into the shards (one full copy in CPU memory, on rank 0 only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.float32 if device.type == "cpu" else getattr(torch, cfg.model.dtype)
    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    impl = attn_implementation(cfg, device)
    if rank == 0:
        print(f"[train] attention: {impl} (model.attn_implementation={cfg.model.attn_implementation})", flush=True)
    with torch.device("meta"):
        # experts_implementation: as engine.py's scheduler.load_model (eager on CPU: grouped_mm is ~10x slower there)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=impl,
                                                 experts_implementation="eager" if device.type == "cpu" else None)
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gpu = device.type == "cuda"
    apply_fsdp(model, mesh, torch.bfloat16 if gpu else None, torch.float32 if gpu else None, cfg.trainer.cpu_offload)
    model.to_empty(device="cpu" if cfg.trainer.cpu_offload else device)
    full, buffers = {}, [None]
    if rank == 0:
        ref = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype)
        full, buffers = ref.state_dict(), [{k: v.cpu() for k, v in ref.named_buffers()}]
    # The other ranks wait for rank 0's load (minutes for a 30B from disk) here, under the control group's long
    # timeout, not inside the broadcast below, whose group times out (NCCL: kills) after weight_sync.timeout_s.
    dist.barrier(group=_ctrl_group())
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Non-persistent buffers (rotary inv_freq) are not in a state dict: rank 0's, on the device (also when the
    # parameters are offloaded: FSDP2 moves only those).
    dist.broadcast_object_list(buffers, src=0, group=_ctrl_group())
    for prefix, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            mod._buffers[name] = buffers[0][f"{prefix}.{name}" if prefix else name].to(device)
    return model, hf_config


def attn_implementation(cfg, device: torch.device) -> str:
    """model.attn_implementation with auto resolved to the best kernel installed: on cuda flash_attention_2 (varlen
    over packed rows) when flash_attn is installed, else flex_attention (ships with torch: a block-sparse mask of
    the packed sequences, with GQA), not sdpa's dense [n, n] mask; sdpa on CPU."""
    import importlib.util

    name = cfg.model.attn_implementation
    if name != "auto":
        return name
    if device.type != "cuda":
        return "sdpa"
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flex_attention"


def build_optimizer(model, t, impl: str = "foreach"):
    """AdamW (impl: fused / foreach / for_loop, see optimizer_impl) with linear warmup over trainer.warmup_steps
    optimizer updates, constant after."""
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                            fused=impl == "fused", foreach=impl == "foreach")
    warm = t.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min(1.0, (u + 1) / warm) if warm else 1.0)
    return opt, sched


# ---------------------------------------------------------------------------------------------------------------
# Mini-batches: sequences, balanced split over ranks, packed (or padded) micro-batches
# ---------------------------------------------------------------------------------------------------------------

def make_sequences(groups: list, cfg) -> list[dict]:
    """Groups -> one dict per trajectory (plain lists: cheap to sort, split and collate) with its GRPO advantage."""
    import losses

    out = []
    for g in groups:
        rewards = torch.tensor([[t.reward for t in g.trajectories]], dtype=torch.float32)
        adv = losses.compute_advantages(rewards, cfg.algorithm.adv.std_normalize, cfg.algorithm.adv.eps)[0]
        for t, a in zip(g.trajectories, adv.tolist()):
            out.append({"prompt": t.prompt_ids.tolist(), "response": t.response_ids.tolist(),
                        "mask": t.loss_mask.tolist(), "rollout_lp": t.rollout_log_probs.tolist(),
                        "versions": t.versions.tolist(), "adv": a,
                        **({"routes": t.routed_experts} if t.routed_experts.numel() else {})})
    return out


def _length(s: dict) -> int:
    return len(s["prompt"]) + len(s["response"])


def split_balanced(seqs: list[dict], parts: int) -> list[list[dict]]:
    """Longest-first greedy: each sequence to the part with the fewest tokens so far."""
    shares, load = [[] for _ in range(parts)], [0] * parts
    for s in sorted(seqs, key=_length, reverse=True):
        i = load.index(min(load))
        shares[i].append(s)
        load[i] += _length(s)
    return shares


def plan_micro_batches(share: list[dict], max_tokens: int, packing: bool = False) -> list[list[dict]]:
    """packing: first-fit decreasing, each micro-batch at most max_tokens real tokens (a longer sequence alone);
    padded: consecutive length-sorted sequences while rows x longest row <= max_tokens (at least one row each)."""
    out: list = []
    if packing:
        load: list = []
        for s in sorted(share, key=_length, reverse=True):
            i = next((i for i, n in enumerate(load) if n + _length(s) <= max_tokens), len(out))
            if i == len(out):
                out.append([])
                load.append(0)
            out[i].append(s)
            load[i] += _length(s)
        return out
    cur: list = []
    for s in sorted(share, key=_length, reverse=True):
        if cur and (len(cur) + 1) * _length(cur[0]) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    return out + ([cur] if cur else [])


# A placeholder row for a rank with fewer micro-batches than another: a real forward/backward, loss exactly 0.
DUMMY = {"prompt": [0], "response": [0], "mask": [0], "rollout_lp": [0.0], "versions": [0], "adv": 0.0}


def collate(seqs: list[dict], mask_offpolicy: bool = False, packing: bool = False) -> dict:
    """The loss tensors are [b, L - 1] on the target positions (position j predicts token j + 1), so a response
    token at index P + t sits at position P + t - 1; mask_offpolicy: loss mask 0 on tokens older than their
    trajectory's newest version (rollout.mask_offpolicy_in_partial_rollout). The model's input:
      padded: right-padded ids [b, L] and attn [b, L];
      packing: ids [1, n] of the sequences back to back with pos [1, n] restarting at 0 for each (the attention
        keeps each sequence to itself: tests/test_packing.py), no padding; index [b, L - 1] maps each loss
        position to its position in the packed row (-1 off the sequence), see unpack."""
    import losses

    L = max(_length(s) for s in seqs)
    b = len(seqs)
    # Rows as Python lists, one tensor per field: per-row tensor writes cost more than the forward on small models.
    ids, attn, mask, rlp, ver = [], [], [], [], []
    for s in seqs:
        P, T = len(s["prompt"]), len(s["response"])
        pad, lead = [0] * (L - P - T), [0] * (P - 1)
        ids.append(s["prompt"] + s["response"] + pad)
        attn.append([1] * (P + T) + pad)
        mask.append(lead + s["mask"] + pad)
        rlp.append(lead + s["rollout_lp"] + pad)
        ver.append(lead + s["versions"] + pad)
    ids, attn, ver = (torch.tensor(x, dtype=torch.long) for x in (ids, attn, ver))
    mask, rlp = torch.tensor(mask, dtype=torch.float32), torch.tensor(rlp, dtype=torch.float32)
    if mask_offpolicy:
        mask = losses.offpolicy_token_mask(ver, mask)
    out = {"mask": mask, "rollout_lp": rlp, "versions": ver,
           "adv": torch.tensor([s["adv"] for s in seqs], dtype=torch.float32)}
    shape = next((s["routes"].shape[1:] for s in seqs if "routes" in s), None)
    if shape is not None:  # routing replay: the server's experts per input position, -1 (own choice) elsewhere
        routes = torch.full((b, L, *shape), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            if "routes" in s:
                routes[i, :s["routes"].shape[0]] = s["routes"]
        out["routes"] = routes
    if not packing:
        return {"ids": ids, "attn": attn, **out}
    lengths = [_length(s) for s in seqs]
    index = torch.full((b, L - 1), -1, dtype=torch.long)
    off = 0
    for i, n in enumerate(lengths):
        index[i, :n - 1] = torch.arange(off, off + n - 1)
        off += n
    # sequence boundaries for flash-attention's varlen kernel, made here once per micro-batch: without them
    # transformers recomputes them from position_ids in every layer, with a host sync each time
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    if shape is not None:  # the packed row's positions, as ids
        out["routes"] = out["routes"][attn > 0][None]
    return {"ids": ids[attn > 0][None], "pos": torch.cat([torch.arange(n) for n in lengths])[None],
            "index": index, "cu": cu, "max_len": max(lengths), **out}


def micro_batch_loss(cfg, logp: torch.Tensor, old_lp: torch.Tensor, b: dict, denom: float, entropy, step: int):
    """algorithm.policy_loss on one collated micro-batch (losses.POLICY_LOSSES): the step-start weights are version
    `step`, so the update being computed produces version step + 1 (loglinear's current version)."""
    import losses

    fn = losses.chosen_policy_loss(cfg.algorithm.policy_loss)
    return fn(logp, old_lp, b["rollout_lp"], b["adv"], b["mask"], b["versions"], step + 1, cfg.algorithm, denom,
              entropy)


def unpack(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-token values of the packed row [1, n - 1] -> the padded loss layout [b, L - 1] (0 off the sequences);
    differentiable, so the loss (losses.py, one sequence per row) and its gradient are the padded path's."""
    flat = packed[0][index.clamp(min=0)]
    return torch.where(index >= 0, flat, torch.zeros((), dtype=flat.dtype, device=flat.device))


def token_logprobs(model, b: dict, temperature: float, chunk_tokens: int, with_entropy: bool = False) -> tuple:
    """log-probs (and entropy, or None) of a collated micro-batch in the loss layout [b, L - 1]. A packed one runs
    as one row with restarting position_ids and no attention mask (use_cache=False: transformers derives the
    per-sequence mask from position_ids only when there is no cache; flash_attention_2 runs varlen from them).

    The [tokens, vocab] logits are never built: for the run of model(...) its output layer's forward is swapped
    for losses.linear_token_logprobs on the last hidden states (lm_head fused into the chunked log-softmax), so
    .logits comes back as the log-probs. The swap sits inside model(...) because FSDP2 gathers the root unit's
    parameters (lm_head, embeddings, final norm) in the root's forward and again for its backward. A head that is
    not a bias-free Linear, or logits that the model post-processes (final_logit_softcapping), take the unfused
    path (losses.token_logprobs on the logits)."""
    import losses
    import moe

    moe.set_routes(model, b.get("routes"))  # routing replay (none recorded: the routers' own top-k)
    kwargs = ({"position_ids": b["pos"]} if "pos" in b else {"attention_mask": b["attn"]}) | {"use_cache": False}
    if "pos" in b and model.config._attn_implementation == "flash_attention_2":  # FlashAttentionKwargs
        kwargs |= {"cu_seq_lens_q": b["cu"], "cu_seq_lens_k": b["cu"], "max_length_q": b["max_len"],
                   "max_length_k": b["max_len"]}
    head, targets = model.get_output_embeddings(), b["ids"][:, 1:]
    fused = (isinstance(head, torch.nn.Linear) and head.bias is None
             and not getattr(model.config, "final_logit_softcapping", None))
    if fused:
        def head_forward(hidden):  # the model's output: FSDP2's pre-backward hook is registered on it
            logp, ent = losses.linear_token_logprobs(hidden[:, :-1], head.weight, targets, temperature, chunk_tokens,
                                                     with_entropy)
            return torch.stack([logp, ent], -1) if with_entropy else logp

        head.forward = head_forward
        try:
            out = model(input_ids=b["ids"], **kwargs).logits
        finally:
            del head.forward
        logp, ent = (out[..., 0], out[..., 1]) if with_entropy else (out, None)
    else:
        logits = model(input_ids=b["ids"], **kwargs).logits[:, :-1]
        logp, ent = losses.token_logprobs(logits, targets, temperature, chunk_tokens, with_entropy=with_entropy)
    if "pos" in b:
        logp, ent = unpack(logp, b["index"]), None if ent is None else unpack(ent, b["index"])
    return logp, ent


# ---------------------------------------------------------------------------------------------------------------
# The actor: the model side of run_steps. Rank 0 drives; the other ranks run the same methods from follow()
# ---------------------------------------------------------------------------------------------------------------

_CTRL = None


def _ctrl_group():
    """A gloo group for commands and Python objects (works next to nccl). Its timeout covers rank 0's longest
    wait between two commands (data, pause, server start-up), since the other ranks wait in it meanwhile."""
    return _CTRL


class Actor:
    """FSDP2 policy on every rank. Rank 0 calls the public methods; each first announces itself on the control
    group, so the other ranks (in `follow`) run the same method with the same collectives."""

    def __init__(self, cfg, model, optimizer, scheduler, device, fleet=None):
        self.cfg, self.model, self.opt, self.sched, self.device = cfg, model, optimizer, scheduler, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.snapshot: Optional[list] = None  # step-start local shards (old policy), see _old_log_probs
        self.snapshot_step = -1
        # Nothing random in the training forward (no dropout): at a step's first call it is the old policy's forward
        # too, so its log-probs, detached, are the old log-probs and the separate no-grad forward is skipped.
        self.train_forward_is_old = not (getattr(model.config, "attention_dropout", 0.0) or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()))
        self.weights = weight_sync_lib.WeightSync(cfg, model, device, _ctrl_group())
        self.fleet = fleet  # rollout.SyncFleet on rank 0 when there are servers, else None
        self.group_members: Optional[list] = None  # the server URLs the last sync went to
        self.services: Optional["Services"] = None  # rank 0: the launched servers (relaunched when they die)
        self.released = False  # colocate: the servers' memory is released (set by release / main's launch)
        self.push_s = 0.0  # seconds of the last push (perf/weight_sync_gbps)
        self.ckpt_root = os.path.join(cfg.run_dir, "checkpoints")

    @property
    def fleet(self):
        return self.weights.fleet

    @fleet.setter
    def fleet(self, fleet) -> None:
        self.weights.fleet = fleet

    # ---- command channel ----
    def _announce(self, cmd: str, arg=None) -> None:
        if self.rank == 0 and self.world > 1:
            dist.broadcast_object_list([cmd, arg], src=0, group=_ctrl_group())

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it says stop."""
        while True:
            msg = [None, None]
            try:
                dist.broadcast_object_list(msg, src=0, group=_ctrl_group())
            except RuntimeError as e:  # rank 0 failed (its own error says why) or hung; one line, no traceback
                print(f"[train] rank {self.rank}: lost trainer rank 0 (no command within the control group's "
                      f"timeout, or it exited): {str(e).splitlines()[0][:300]}", file=sys.stderr, flush=True)
                sys.exit(1)
            cmd, arg = msg
            if cmd == "stop":
                return
            {"train": lambda a: self._train(None, *a), "sync": self._sync, "save": self._save,
             "load": self._load, "export": self._export, "onload": self._onload,
             "leave_for_push": self._leave_for_push}[cmd](arg)

    def stop(self) -> None:
        self._announce("stop")

    # ---- training ----
    def train_minibatch(self, groups: list, step: int) -> dict:
        t0 = time.perf_counter()
        import losses

        cfg = self.cfg
        seqs = make_sequences(groups, cfg)
        pack = cfg.trainer.packing
        plans = [[collate(mb, cfg.rollout.mask_offpolicy_in_partial_rollout, pack)
                  for mb in plan_micro_batches(share, cfg.trainer.micro_batch_tokens, pack)]
                 for share in split_balanced(seqs, self.world)]
        n_micro = max(len(p) for p in plans)  # FSDP collectives need the same number of forwards on every rank
        plans = [p + [collate([DUMMY], packing=pack)] * (n_micro - len(p)) for p in plans]
        # The denominator of the loss aggregation over the WHOLE mini-batch (all ranks, all micro-batches), so
        # the micro-batch losses sum to the mini-batch loss (losses.py, "Loss aggregation").
        mode, norm = cfg.algorithm.loss_agg_mode, cfg.rollout.sampling.max_new_tokens
        denom = sum(losses.loss_denominator(mb["mask"], mode, norm) for p in plans for mb in p)
        self._announce("train", (step, denom))
        out: list = [None]
        if self.world > 1:
            dist.scatter_object_list(out, plans, src=0, group=_ctrl_group())
        else:
            out = plans
        process_s = time.perf_counter() - t0
        metrics = self._train(out[0], step, denom)
        metrics["timing/process_traj"] = process_s
        metrics["train/loss_tokens"] = float(sum(mb["mask"].sum() for p in plans for mb in p))
        return metrics

    def _train(self, plan, step: int, denom: float) -> dict:
        if plan is None:  # a follower: receive this rank's micro-batches
            out = [None]
            dist.scatter_object_list(out, None, src=0, group=_ctrl_group())
            plan = out[0]
        cfg, t = self.cfg, self.cfg.trainer
        batches = [{k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()} for mb in plan]
        old = self._old_log_probs(batches, step)
        self.model.train()
        sums, weights, extremes = {}, {}, {}
        for b, old_lp in zip(batches, old):
            logp, ent = self._token_logprobs(b, with_entropy=True)
            if old_lp is None:  # the step's first call: these weights are the old policy
                old_lp = logp.detach()
            loss, met = micro_batch_loss(cfg, logp, old_lp, b, denom, ent, step)
            if not t.use_rollout_log_probs:  # trainer vs engine on the same tokens: the weight sync's fidelity
                gap = (old_lp - b["rollout_lp"]).abs() * b["mask"]
                met = {**met, "train/rollout_logprob_diff_max": gap.max(),
                       "train/rollout_logprob_diff_mean": gap.sum() / b["mask"].sum().clamp(min=1)}
            # FSDP averages gradients over ranks; the losses already sum to the mini-batch loss, so undo the mean.
            (loss * self.world).backward()
            n = float(b["mask"].sum())
            for k, v in met.items():
                v = float(v)
                if k.endswith("_max") or k.endswith("_min"):
                    if n > 0:
                        extremes.setdefault(k, []).append(v)
                elif k == "train/pg_loss":  # this micro-batch's share of the mini-batch loss: summed
                    sums[k], weights[k] = sums.get(k, 0.0) + v, 1.0
                elif n > 0:  # means over this micro-batch's tokens: token-weighted mean
                    sums[k], weights[k] = sums.get(k, 0.0) + v * n, weights.get(k, 0.0) + n
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if math.isfinite(grad_norm):  # a NaN/inf gradient would poison the weights: skip the update
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        parts: list = [None] * self.world
        dist.all_gather_object(parts, (sums, weights, extremes), group=_ctrl_group())
        out = {"train/grad_norm": grad_norm, "train/lr": self.sched.get_last_lr()[0],
               "train/skipped_update": float(not math.isfinite(grad_norm))}
        for k in dict.fromkeys(k for s, _, _ in parts for k in s):
            tot = sum(s.get(k, 0.0) for s, _, _ in parts)
            w = sum(wt.get(k, 0.0) for _, wt, _ in parts)
            out[k] = tot if k == "train/pg_loss" else tot / max(w, 1e-9)
        for k in dict.fromkeys(k for _, _, e in parts for k in e):
            vals = [v for _, _, e in parts for v in e.get(k, [])]
            out[k] = max(vals) if k.endswith("_max") else min(vals)
        out["train/loss"] = out.get("train/pg_loss", 0.0)  # GRPO: no KL or entropy term
        out.update(_memory_metrics(self.device))
        return out

    @torch.no_grad()
    def _old_log_probs(self, batches: list[dict], step: int) -> list[torch.Tensor]:
        """log pi_old per micro-batch: the step-start weights (spec section 2). At the step's first call they are
        the live weights, and a copy of this rank's shards is kept (_take_snapshot); later calls copy it into the
        shards, compute, and put the live shards back. Those wait in a clone meanwhile, in the memory this call's
        gradients take later (the last update's zero_grad freed it), so the peak is not raised by a full copy.
        trainer.use_rollout_log_probs: the engine's log-probs instead (no forward, no snapshot). None for each
        micro-batch of the first call when the training forward is the old policy's (train_forward_is_old)."""
        if self.cfg.trainer.use_rollout_log_probs:
            return [b["rollout_lp"] for b in batches]
        first = step != self.snapshot_step
        reshard(self.model)  # first: the unsharded parameters of the last layer and root would be listed instead
        params = [p.to_local() for p in self.model.parameters()]
        live = None
        if first and self.cfg.calls_per_step > 1:
            self._take_snapshot(params, step)
        elif not first:
            live = [p.clone() for p in params]
            for p, s in zip(params, self.snapshot):
                p.copy_(s)
        if first and self.train_forward_is_old:
            return [None] * len(batches)
        self.model.eval()
        out = [self._token_logprobs(b)[0] for b in batches]
        reshard(self.model)
        for p, x in zip(params, live or []):
            p.copy_(x)
        return out

    def _take_snapshot(self, params: list, step: int) -> None:
        """Keep this rank's shards in the compute dtype: bfloat16 on cuda, which is what FSDP2's mixed precision
        casts them to before the all-gather, so a forward from the copy is the step-start forward exactly, at half
        the size of float32 master weights. On the device, or in host memory with trainer.snapshot=cpu (pinned)."""
        if self.snapshot is None:
            host = self.cfg.trainer.snapshot == "cpu"
            dtype = torch.bfloat16 if self.device.type == "cuda" else None
            self.snapshot = [torch.empty_like(p, dtype=dtype, device="cpu" if host else None,
                                              pin_memory=host and self.device.type == "cuda") for p in params]
        for p, s in zip(params, self.snapshot):
            s.copy_(p)
        self.snapshot_step = step

    def _token_logprobs(self, b: dict, with_entropy: bool = False) -> tuple:
        t = self.cfg.trainer
        return token_logprobs(self.model, b, self.cfg.rollout.sampling.temperature, t.logprob_chunk_tokens,
                              with_entropy)

    # ---- weights: weight_sync.py gathers bucket by bucket and pushes ----
    def sync_weights(self, version: int) -> dict:
        """Push the weights to every server as `version` (weight_sync.method: distributed, tensor or disk; see
        weight_sync.py). Every call has weight_sync.timeout_s. The sync goes to the servers that answer /health
        (waiting up to rollout.startup_timeout_s for one); the weight-update group is formed again when they change
        or one rank 0 launched was relaunched (Services.watch), and a failed sync is retried once with a new group
        (after the relaunch of a server that died). A second failure stops the run with the server's message.
        Colocate: the trainer then offloads its parameters and optimizer state, and the servers take back their
        KV cache (their weights came back in `resume`, before the push)."""
        if self.fleet is None:
            return {}
        t0 = time.perf_counter()
        retry = False
        for attempt in (1, 2):
            replaced = self.services is not None and self.services.take_replaced()
            live = self.fleet.live_workers(self.cfg.rollout.startup_timeout_s)
            if retry or replaced or live != self.group_members:
                if self.group_members is not None and live != self.group_members:
                    print(f"[train] warning: the servers answering are now {live} (were {self.group_members}): "
                          "the weight-update group is formed again with them", file=sys.stderr, flush=True)
                self.weights.drop_group()
            self.group_members = live
            self._announce("sync", version)
            try:
                self._sync(version)
                break
            except Exception as e:
                if attempt == 2:
                    raise
                # A server died (ours is relaunched: take_replaced waits for it) or restarted on its URL (no
                # longer in the group): once more with a new group of the servers that answer.
                retry = True
                if self.services is not None:
                    self.services.server_died(GRACE_S)
                print(f"[train] warning: weight sync of version {version} failed ({str(e).splitlines()[0]}); "
                      "retrying once with a new weight-update group of the servers that answer", file=sys.stderr,
                      flush=True)
        out = {"timing/update_weights": time.perf_counter() - t0}
        out["perf/weight_sync_gbps"] = self.weights.last_bytes / 1e9 / max(self.push_s, 1e-9)
        if self.cfg.colocate:
            out["perf/memory_after_offload"] = self.push_memory
        if self.released:  # stage 2 of colocate's resume: the KV cache, once the trainer has left the GPU
            t1 = time.perf_counter()
            self.fleet.resume_memory(["kv_cache", "cuda_graph"])
            self.released = False
            out["timing/resume_kv_cache"] = time.perf_counter() - t1
        if self.services is not None:
            out["rollout/server_restarts"] = self.services.server_restarts
        return out

    def _sync(self, version: int) -> None:
        """Every rank: the push (weight_sync.WeightSync.push), then colocate's offload."""
        t0 = time.perf_counter()
        self.weights.push(version)
        self.push_s = time.perf_counter() - t0
        if self.cfg.colocate:
            self.snapshot = None  # last step's old policy: not needed again
            self._offload("cpu")
            self.push_memory = _memory_now(self.device)

    # ---- colocate: trainer state off the GPU while the servers generate ----
    def _offload(self, where, params: bool = True) -> None:
        """Parameters (FSDP2 shards; unless params=False) and optimizer state to `where` ("cpu" after a sync, the
        device before training), then the CUDA cache emptied, so the servers get the memory (slime's sleep(),
        verl's offload_fsdp_model_to_cpu). No gradients exist between steps (zero_grad(set_to_none))."""
        if params:
            self.model.to(where)
        for state in self.opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(where, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _onload(self, _=None) -> None:
        self._offload(self.device)

    def _export(self, path: str) -> None:
        """The weights as an HF checkpoint directory in model.dtype (weight_sync.WeightSync.export)."""
        if self.cfg.colocate:  # the last sync offloaded the trainer
            self._onload()
        self.weights.export(path, getattr(torch, self.cfg.model.dtype))

    def export_hf(self, path: str) -> None:
        self._announce("export", path)
        self._export(path)

    # ---- checkpoints: torch.distributed.checkpoint (sharded model + optimizer) + run state ----
    def save_checkpoint(self, steps_done: int, run_state: dict) -> None:
        self._announce("save", (steps_done, run_state))
        self._save((steps_done, run_state))

    def _save(self, arg) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        steps_done, run_state = arg
        path = os.path.join(self.ckpt_root, f"step_{steps_done:06d}")
        tmp = path + ".tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier(group=_ctrl_group())
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        rng: list = [None] * self.world
        dist.all_gather_object(rng, _rng_state(), group=_ctrl_group())
        if self.rank == 0:
            _commit_checkpoint(tmp, path, {**run_state, "scheduler": self.sched.state_dict(), "rng": rng})
        dist.barrier(group=_ctrl_group())

    def load_checkpoint(self, path: str) -> dict:
        """Model, optimizer, scheduler and RNG from `path` on every rank; returns the run state."""
        self._announce("load", path)
        return self._load(path)

    def _load(self, path: str) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        run_state = load_run_state(path)
        self.sched.load_state_dict(run_state["scheduler"])
        _set_rng_state(run_state["rng"][self.rank] if self.rank < len(run_state["rng"]) else run_state["rng"][0])
        return run_state

    # ---- colocate: the servers give their memory to training and take it back, in two stages ----
    def release(self) -> dict:
        """After generation: the servers release weights, KV cache and CUDA graphs; the trainer onloads."""
        t0 = time.perf_counter()
        self.fleet.release_memory()
        self.released = True
        t1 = time.perf_counter()
        self._announce("onload")
        self._onload()
        return {"timing/release_rollout": t1 - t0, "timing/onload_train": time.perf_counter() - t1}

    def resume(self) -> dict:
        """After training, stage 1: the servers' weights only (the push needs them and the trainer's parameters).
        Before they come back every rank leaves what the push does not need (_leave_for_push), so SGLang's
        weights land in memory the trainer has given up, not beside its optimizer state and cached blocks (verl
        offloads the optimizer and empties the cache before resume(tags=["weights"]), fsdp_workers.py). Stage 2,
        the KV cache, follows the push and the parameters' offload (sync_weights)."""
        t0 = time.perf_counter()
        self._announce("leave_for_push")
        out = self._leave_for_push()
        self.fleet.resume_memory(["weights"])
        return out | {"timing/resume_rollout": time.perf_counter() - t0}

    def _leave_for_push(self, _=None) -> dict:
        """Every rank: the old-policy snapshot dropped (the step is trained), the optimizer state to the host and
        the CUDA cache emptied; perf/memory_* of this rank before and after (GiB)."""
        before = _memory_now(self.device)
        self.snapshot = None
        self._offload("cpu", params=False)
        gc.collect()
        return {"perf/memory_train_end": before, "perf/memory_before_push": _memory_now(self.device)}


def _memory_now(device: torch.device) -> float:
    """GiB this process holds now: the CUDA caching allocator's reserved bytes on GPU (what another process on
    the GPU cannot have), the resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) / 2 ** 30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30


def _memory_metrics(device: torch.device) -> dict:
    """perf/train_memory_*_max in GiB: CUDA allocator peaks on GPU; on CPU the process's peak RSS for both."""
    if device.type == "cuda":
        return {"perf/train_memory_allocated_max": torch.cuda.max_memory_allocated(device) / 2 ** 30,
                "perf/train_memory_reserved_max": torch.cuda.max_memory_reserved(device) / 2 ** 30}
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB
    return {"perf/train_memory_allocated_max": rss, "perf/train_memory_reserved_max": rss}


def _rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _commit_checkpoint(tmp: str, path: str, run_state: dict) -> None:
    """Write run_state.pt into the finished directory `tmp` and rename it to `path`, each step on disk before the
    next (DCP fsyncs its own files): after a crash at any point, a directory without ".tmp" is complete."""
    with open(os.path.join(tmp, "run_state.pt"), "wb") as f:
        torch.save(run_state, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def load_run_state(path: str) -> dict:
    """run_state.pt of a checkpoint directory: plain data only (weights_only=True: loading runs no code)."""
    return torch.load(os.path.join(path, "run_state.pt"), weights_only=True)


def checkpoint_problem(path: str) -> Optional[str]:
    """Why the checkpoint directory `path` would not load, or None: run_state.pt unreadable, or the DCP shards
    (when there are any; rollout-only checkpoints have none) without their metadata or shorter than it says."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        load_run_state(path)
    except Exception as e:
        return f"run_state.pt does not load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not glob.glob(os.path.join(path, "*.distcp")) and not os.path.exists(os.path.join(path, ".metadata")):
        return None
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:
        return f"its DCP .metadata does not load: {type(e).__name__}: {e}"
    need: dict = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        have = os.path.getsize(os.path.join(path, name)) if os.path.exists(os.path.join(path, name)) else None
        if have is None or have < size:
            return f"shard {name} has {have or 0} bytes, its metadata expects {size}"
    return None


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest run_dir/checkpoints/step_* that loads (being written ones end in .tmp), or None. Newer ones
    that do not load are skipped with a warning naming each and why."""
    done = sorted((p for p in glob.glob(os.path.join(run_dir, "checkpoints", "step_*")) if not p.endswith(".tmp")),
                  reverse=True)
    for path in done:
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print(f"[train] warning: skipping checkpoint {path}: {problem}; trying the previous one", file=sys.stderr,
              flush=True)
    return None


# ---------------------------------------------------------------------------------------------------------------
# run_mode rollout-only / train-only: the same loop with a recording actor, or a replaying buffer
# ---------------------------------------------------------------------------------------------------------------

class RolloutRecorder:
    """run_mode=rollout-only: no training; each call's groups are saved to run_dir/rollouts/ (for train-only) and
    the servers' version label still advances every step, so staleness reads as it would when training."""

    def __init__(self, cfg, fleet):
        self.cfg, self.fleet = cfg, fleet
        self.dir = os.path.join(cfg.run_dir, "rollouts")
        os.makedirs(self.dir, exist_ok=True)
        self.calls: dict = {}

    def train_minibatch(self, groups, step):
        call = self.calls[step] = self.calls.get(step, -1) + 1
        torch.save([buffer_lib.group_to_dict(g) for g in groups],
                   os.path.join(self.dir, f"step_{step:06d}_{call:03d}.pt"))
        return {}

    def sync_weights(self, version):
        self.fleet.update_weight_version(version)
        return {}

    def save_checkpoint(self, steps_done, run_state):
        path = os.path.join(self.cfg.run_dir, "checkpoints", f"step_{steps_done:06d}")
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        os.makedirs(path + ".tmp")
        _commit_checkpoint(path + ".tmp", path, {**run_state, "scheduler": {}, "rng": [_rng_state()]})

    def release(self):
        return {}

    def resume(self):
        return {}


class ReplayBuffer:
    """run_mode=train-only: the groups a rollout-only run saved, in order (trainer.rollout_dir)."""

    def __init__(self, directory: str):
        self.files = sorted(glob.glob(os.path.join(directory, "step_*.pt")))
        if not self.files:
            raise ValueError(f"trainer.rollout_dir '{directory}' holds no step_*.pt files; run run_mode=rollout-only "
                             "first (it saves them in its run_dir/rollouts)")
        self.pending: list = []
        self.pos = 0

    def wait(self, k: int, timeout: float) -> dict:
        return {"ready": k, "needed": k}  # saved groups are there or not: get() never waits

    def get(self, k: int, timeout: float) -> list:
        while len(self.pending) < k:
            if self.pos >= len(self.files):
                steps = len({os.path.basename(f).split("_")[1] for f in self.files})
                raise buffer_lib.NothingToTrain(
                    f"the data ran out before trainer.total_steps: the groups saved in "
                    f"{os.path.dirname(self.files[0])} ({len(self.files)} files from {steps} steps of a rollout-only "
                    f"run) are trained but {len(self.pending)} and {k} are wanted; train at most that many steps "
                    f"(trainer.total_steps, with the recording's batch size) or record more with "
                    f"run_mode=rollout-only")
            try:
                saved = torch.load(self.files[self.pos], weights_only=True)
            except Exception as e:
                raise ValueError(f"saved rollouts {self.files[self.pos]} do not load ({type(e).__name__}: {e}); "
                                 "they are written by run_mode=rollout-only") from None
            self.pending += [buffer_lib.group_from_dict(d) for d in saved]
            self.pos += 1
        out, self.pending = self.pending[:k], self.pending[k:]
        return out

    def step_metrics(self):
        return {}

    def set_weight_version(self, v):
        pass

    def state_dict(self):
        return {"pos": self.pos, "pending": [buffer_lib.group_to_dict(g) for g in self.pending]}

    def load_state_dict(self, sd):
        self.pos, self.pending = sd["pos"], [buffer_lib.group_from_dict(d) for d in sd["pending"]]


class NoRollout:
    """run_mode=train-only: nothing generates."""

    def start(self):
        pass

    def pause(self):
        return {}

    def resume(self, version):
        pass

    def step_metrics(self):
        return {}

    def stop(self):
        pass


# ---------------------------------------------------------------------------------------------------------------
# Evaluation: greedy, on the held-out split, through the servers (the rollout function, so multi-turn works too)
# ---------------------------------------------------------------------------------------------------------------

def make_evaluator(cfg, fleet, tokenizer) -> Callable[[int], dict]:
    """evaluate(steps_done) -> eval/reward_mean, eval/exact_ratio (reward >= 1), timing/eval and data/eval_samples
    (every response, for samples/step_NNNNNN.jsonl): greedy, one response per held-out prompt."""
    import rollout as rollout_lib
    import tasks
    from buffer import Group

    ecfg = copy.deepcopy(cfg)
    ecfg.data_sources = [copy.deepcopy(cfg.data_sources[0])]
    ecfg.data_sources[0].num_trajectories_per_prompt = 1
    ecfg.rollout.sampling.temperature = 0.0  # greedy (below losses.GREEDY_TEMPERATURE)
    ecfg.rollout.partial = False
    ecfg.rollout.async_max_concurrent_samples = None
    prompts = tasks.load_prompts(ecfg.data_sources[0], tokenizer, "eval", cfg.rollout.max_prompt_tokens)

    def evaluate(steps_done: int) -> dict:
        t0 = time.perf_counter()
        fleet.continue_()  # the last step's pause (rollout.partial) leaves the servers paused: eval would wait
        buf, summary = rollout_lib.generate_dataset(ecfg, prompts, fleet, tokenizer,
                                                    cfg.rollout.trajectory_timeout_s + 60.0)
        groups = [Group(buf.prompts[seq], trajs) for seq, trajs in sorted(buf.results.items())]
        rewards = [t.reward for g in groups for t in g.trajectories]
        return {"eval/reward_mean": sum(rewards) / max(1, len(rewards)),
                "eval/exact_ratio": sum(r >= 1.0 for r in rewards) / max(1, len(rewards)),
                "timing/eval": time.perf_counter() - t0, "data/eval_samples": sample_records(groups)}
    return evaluate


# ---------------------------------------------------------------------------------------------------------------
# Start-up checks of train.py itself (config.validate covers the config's own rules)
# ---------------------------------------------------------------------------------------------------------------

def check_launch(cfg, world: int) -> None:
    t, r = cfg.trainer, cfg.rollout
    if cfg.run_mode != "rollout-only" and world != t.num_nodes * t.num_gpus_per_node:
        raise ValueError(f"trainer.num_nodes x trainer.num_gpus_per_node ({t.num_nodes} x {t.num_gpus_per_node}) "
                         f"must equal the number of trainer processes started ({world}); e.g. torchrun "
                         f"--nproc_per_node {t.num_gpus_per_node}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use device=cpu or auto")
    if cfg.model.make_tiny and cfg.model.tiny_pretrain_steps > 0 and not os.path.isdir(cfg.model.path):
        import tasks

        if cfg.data_sources[0].task not in tasks.PRETRAIN_TASK_OF:
            raise ValueError(f"model.tiny_pretrain_steps={cfg.model.tiny_pretrain_steps} needs a toy task with a "
                             f"pretraining task ({', '.join(tasks.PRETRAIN_TASK_OF)}), not data_source.task "
                             f"'{cfg.data_sources[0].task}'; set model.tiny_pretrain_steps=0")
    if not os.path.isdir(cfg.model.path) and not cfg.model.make_tiny:
        raise ValueError(f"model.path '{cfg.model.path}' is not a directory; point it at an HF checkpoint or set "
                         "model.make_tiny=true to create the tiny model there")
    if cfg.algorithm.routing_replay:  # the model's config says whether it is a MoE (config.validate cannot see it)
        import moe

        path, sparse = os.path.join(cfg.model.path, "config.json"), cfg.model.tiny_num_experts > 0  # (tiny: made later)
        if os.path.isfile(path):
            with open(path) as f:
                sparse = moe.is_moe(json.load(f))
        if not sparse:
            raise ValueError(f"algorithm.routing_replay=true replays a MoE's expert choices, but model.path "
                             f"'{cfg.model.path}' is a dense model (no num_experts_per_tok in its config.json); set "
                             "algorithm.routing_replay=false")
    needs_servers = cfg.run_mode != "train-only"
    if needs_servers and not r.servers and not r.router_url:
        if r.launch == "none":
            raise ValueError("rollout.launch=none needs rollout.servers or rollout.router_url (servers to connect to)")
        services_lib.check_gpu_overlap(cfg, int(os.environ.get("GROUP_RANK", "0")), cfg.device == "cuda" or (
            cfg.device == "auto" and torch.cuda.is_available()), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if r.servers and r.router_url:
        raise ValueError("give rollout.servers or rollout.router_url, not both")
    if cfg.run_mode == "train-only":
        d = t.rollout_dir or os.path.join(cfg.run_dir, "rollouts")
        if not glob.glob(os.path.join(d, "step_*.pt")):
            raise ValueError(f"run_mode=train-only needs trainer.rollout_dir with the step_*.pt files of a "
                             f"rollout-only run; '{d}' has none")


def start_fleet(cfg, services, version: int, launched: bool):
    """Rank 0: the servers of rollout.server_layout (this node's launched here, the other nodes' published by their
    local rank 0, see node_services; or rollout.servers / rollout.router_url already running), where they reach the
    broadcast group, and the SyncFleet once every server answers /health."""
    import rollout as rollout_lib

    if launched:
        cfg.rollout.servers = services.launch_fleet(version)
    cfg.weight_sync.master_address = services_lib.master_address(cfg, launched)
    fleet = services.fleet = rollout_lib.SyncFleet(rollout_lib.Fleet.from_config(cfg))
    fleet.wait_healthy(cfg.rollout.startup_timeout_s)
    return fleet


def node_services(cfg, local_rank: int, launched: bool):
    """Ranks other than 0: local rank 0 of a node with servers in rollout.server_layout launches them, publishes
    their URLs for rank 0 and supervises them (Services.serve_node); None elsewhere."""
    node = int(os.environ.get("GROUP_RANK", "0"))
    if local_rank != 0 or not launched or not any(s.node == node for s in cfg.rollout.server_layout):
        return None
    services = Services(cfg)
    services.serve_node(node)
    return services


def check_inputs(cfg) -> None:
    """Rank 0, before anything starts: every dataset file parses row by row (the buffer process would find a bad
    row only after the servers started), its prompts fit rollout.max_prompt_tokens (with the tokenizer of
    model.path; a tiny model not made yet is checked when the buffer loads them), and a checkpoint given as
    trainer.resume loads."""
    import tasks

    if cfg.run_mode != "train-only":
        for ds in cfg.data_sources:
            tasks.check_data_source(ds)
            tasks.get_reward_fn(ds.reward or tasks.default_reward(ds.task))
            if cfg.rollout.max_prompt_tokens is not None and os.path.isdir(cfg.model.path):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
                for split in ("train", "eval"):
                    tasks.load_prompts(ds, tokenizer, split, cfg.rollout.max_prompt_tokens)
    if cfg.trainer.resume not in ("none", "auto"):
        problem = checkpoint_problem(cfg.trainer.resume)
        if problem is not None:
            raise ValueError(f"trainer.resume checkpoint '{cfg.trainer.resume}' does not load: {problem}; give "
                             "another checkpoint directory, auto or none")


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny.yaml")
    args, overrides = parser.parse_known_args(argv)

    # ---- config: every start-up check before anything starts; errors are one sentence ----
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = config_lib.load_config(args.config, overrides)
        check_launch(cfg, world)
        if rank == 0:
            check_inputs(cfg)
    except (ValueError, FileNotFoundError) as e:
        # Every rank reads the config; one line for the run, not one per rank. Rank 0 prints it and exits 2 first:
        # a rank that exited first would have torchrun stop rank 0 before its line was out (seen under load).
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(STARTUP_ERROR_WAIT_S)  # torchrun stops this rank once rank 0 has exited
        sys.exit(2)
    import losses

    warning = losses.offpolicy_warning(cfg)
    if warning and rank == 0:
        print(warning, file=sys.stderr, flush=True)
    pairing = strategies.pairing_note(cfg.fully_async.sliding_window, cfg.algorithm.policy_loss,
                                      cfg.rollout.mask_offpolicy_in_partial_rollout)
    if pairing and cfg.fully_async.enable and rank == 0:
        print(f"[train] {pairing}", flush=True)

    # ---- distributed init: gloo on CPU, nccl on GPU; a gloo control group for commands ----
    global _CTRL
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "MASTER_ADDR" not in os.environ:  # plain `python train.py`: a one-process group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(services_lib.free_port()), RANK="0", WORLD_SIZE="1")
    r, b = cfg.rollout, cfg.buffer
    # trainer.cpu_offload on cuda: the offloaded shards' collectives (loading, gradient-norm reduction) are on CPU
    # tensors, which take gloo next to nccl (as torchtitan does)
    backend = ("cuda:nccl,cpu:gloo" if cfg.trainer.cpu_offload else "nccl") if use_cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.weight_sync.timeout_s))
    ctrl_s = b.get_timeout_s + r.pause_timeout_s + r.startup_timeout_s + cfg.weight_sync.timeout_s + 600
    _CTRL = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ctrl_s))
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    os.makedirs(cfg.run_dir, exist_ok=True)
    if rank == 0 and cfg.model.make_tiny and not os.path.isdir(cfg.model.path):
        import tasks

        print(f"[train] making the tiny model at {cfg.model.path} ({cfg.model.tiny_pretrain_steps} pretraining "
              "steps)", flush=True)
        tasks.make_tiny_for(cfg)
    dist.barrier(group=_CTRL)

    services, ok, failed, actor, logger, fleet = None, False, 0, None, None, None
    launched = cfg.run_mode != "train-only" and not r.servers and not r.router_url and r.launch != "none"
    try:
        resume_path = None
        if rank == 0 and cfg.trainer.resume == "auto":
            resume_path = latest_checkpoint(cfg.run_dir)
        elif rank == 0 and cfg.trainer.resume != "none":
            resume_path = cfg.trainer.resume

        # ---- colocate: the servers start first and release their memory before the model loads ----
        if cfg.colocate and cfg.run_mode == "default":
            if rank == 0:
                services = Services(cfg)
                fleet = start_fleet(cfg, services, load_run_state(resume_path)["step"] if resume_path else 0,
                                    launched)
                fleet.release_memory()
            else:
                services = node_services(cfg, local_rank, launched)
            dist.barrier(group=_CTRL)  # the other ranks load the model once the servers have let go of the GPUs

        # ---- model + FSDP2 + optimizer (rollout-only trains nothing) ----
        if cfg.run_mode != "rollout-only":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (world,))
            model, _ = load_model(cfg, mesh, device, rank)
            if rank == 0:
                print(memory_report(cfg, model, world, device), flush=True)
            opt, sched = build_optimizer(model, cfg.trainer, optimizer_impl(cfg, device.type))
            actor = Actor(cfg, model, opt, sched, device)
            actor.released = fleet is not None
        elif rank != 0:
            return

        # ---- resume: model, optimizer, RNG on every rank; run state (step, buffer) for rank 0 ----
        if rank != 0:
            if services is None:  # colocate started them before the model loaded
                services = node_services(cfg, local_rank, launched)
            actor.follow()  # also loads the checkpoint rank 0 chose when it says so
            ok = True
            return
        run_state = None
        if resume_path:
            run_state = actor.load_checkpoint(resume_path) if actor else load_run_state(resume_path)
            print(f"[train] resumed from {resume_path} at step {run_state['step']}", flush=True)
        start_step = run_state["step"] if run_state else 0

        # ---- services: servers, buffer + rollout processes, RPC (train-only needs none) ----
        from transformers import AutoTokenizer

        import rollout as rollout_lib

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        logger = Logger(cfg, keep_until=start_step if run_state else -1, tokenizer=tokenizer)
        evaluate = None
        if cfg.run_mode == "train-only":
            buf = ReplayBuffer(cfg.trainer.rollout_dir or os.path.join(cfg.run_dir, "rollouts"))
            ro = NoRollout()
        else:
            if fleet is None:
                services = Services(cfg)
                fleet = start_fleet(cfg, services, start_step, launched)
            resolved = os.path.join(cfg.run_dir, "config.yaml")
            with open(resolved, "w") as f:
                import yaml

                yaml.safe_dump(config_lib.to_dict(cfg), f, sort_keys=False)
            services.start_rpc(resolved)
            services.watch()
            buf = buffer_lib.RemoteBuffer("buffer", b.rpc_timeout_s)
            ro = rollout_lib.RemoteRollout("rollout", b.rpc_timeout_s)
            if actor is None:
                actor = RolloutRecorder(cfg, fleet)
            else:
                actor.fleet, actor.services = fleet, services
            evaluate = make_evaluator(cfg, fleet, tokenizer) if cfg.trainer.eval_freq else None
        if run_state:
            buf.load_state_dict(run_state["buffer"])
        # The servers serve the trainer's weights (a resumed run's, or model.path's) as version start_step.
        t0 = time.perf_counter()
        if getattr(actor, "released", False):
            actor.resume()
        actor.sync_weights(start_step)
        buf.set_weight_version(start_step)
        print(f"[train] weights version {start_step} on the servers ({time.perf_counter() - t0:.1f} s)", flush=True)
        if evaluate is not None and start_step == 0:
            logger.log(0, evaluate(0))

        # ---- the loop ----
        run_steps(cfg, actor, buf, ro, logger, start_step, evaluate,
                  servers=services.fleet.health if services and services.fleet else None)
        if services is not None and services.fleet is not None:
            infos = services.fleet.server_infos()
            print(f"[train] weight versions on the servers at the end: "
                  f"{dict(zip(services.fleet.workers(), (i.get('weight_version') for i in infos)))}", flush=True)

        # ---- final HF export ----
        if cfg.trainer.export_hf and isinstance(actor, Actor):
            actor.export_hf(os.path.join(cfg.run_dir, "hf"))
            print(f"[train] exported {os.path.join(cfg.run_dir, 'hf')}", flush=True)
        ok = True
    except buffer_lib.NothingToTrain as e:  # the run is fine but cannot train: say why, as a bad input would
        if services is not None:
            services.print_error_once(str(e))
        else:
            print(f"error: {e}", file=sys.stderr, flush=True)
        failed = 2
    except Exception as e:
        # Root cause first: a dead child's report, not the RPC / socket error its death caused here.
        cause = str(e) if isinstance(e, ChildExited) else services.root_cause(GRACE_S) if services else None
        if cause is None:
            raise
        services.print_error_once(cause if isinstance(e, ChildExited) else
                                  f"{cause}\n(what it made fail here: {type(e).__name__}: {str(e).splitlines()[0][:300]})")
        failed = 1
    finally:
        if rank == 0:
            if isinstance(actor, Actor):
                with contextlib.suppress(Exception):
                    if ok:
                        actor.stop()
            if logger is not None:
                logger.close()
        if services is not None:
            services.close(ok)
        if ok:
            with contextlib.suppress(Exception):
                # Every rank tears its gloo groups down together: a rank that destroys them while a peer still
                # has them open can abort at exit ("terminate called without an active exception").
                dist.barrier(group=_CTRL)
                dist.destroy_process_group()
    if failed:
        sys.exit(failed)


# ---------------------------------------------------------------------------------------------------------------
# python train.py plot RUN_DIR [--out PNG]: reward, eval, step-time breakdown, buffer, recycling, staleness
# ---------------------------------------------------------------------------------------------------------------

def plot_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="train.py plot", description="metrics.jsonl of a run -> a PNG")
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
    panels = [(t, [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]) for t, keys in PLOT_PANELS]
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
    faulthandler.enable(all_threads=True)  # a crash in native code (SIGSEGV, SIGABRT) prints every thread's stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    main()
