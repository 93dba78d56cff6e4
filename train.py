"""train.py: the RL trainer, one SPMD program: every trainer rank runs the same `main()` and the same step loop.

main: config and start-up checks (checks.py) -> distributed init (gloo on CPU, nccl on GPU; a gloo control group)
-> the policy, FSDP2-sharded, and AdamW (model.py) -> rank 0 starts the inference servers (standins/engine.py on CPU,
SGLang on GPUs, or connects to rollout.servers / rollout.router_url), the buffer process and the rollout process through
services.py -> resume (checkpoint.py) -> run_steps, the step loop (docs/design.md):
  fetch (rank 0, from the buffer: fully-async each call's M // N groups; synchronous the step's B groups, then the
  producer pauses) -> forward/backward and optimizer step ((B x N) // M calls; a scatter gives every rank its
  share) -> pause (fully-async; rollout.pause_mode) -> checkpoint every trainer.save_freq -> weight sync (version
  + 1) -> resume the producer. Rank 0 alone talks to the buffer, the rollout and the servers, and logs, each under
  `if rank == 0`. Colocate (synchronous): release -> train -> leave_for_push -> resume weights -> push -> offload
  -> resume kv cache.
run_mode=rollout-only / train-only and the greedy evaluator: run_modes.py; logging: logger.py; plots: plot.py.
Faults: a launched server that dies is relaunched and gets the weights at the next sync; any other child that dies
stops the run with its report (the process, its exit code or signal, its log's last lines) as the one error line;
bad inputs (config, dataset rows, a checkpoint given to resume) are refused before anything starts (exit code 2),
as is a run that cannot train (buffer.NothingToTrain). While it waits for groups, fetch says what it waits for.

Run (CPU: the tiny pretrained model on the reverse-digits task; greedy eval 0.9 at step ~200, ~3-5 min on 2 cores):
    torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml [fully_async.enable=false]
    python plot.py runs/tiny                           # metrics.jsonl -> runs/tiny/metrics.png
Multi-node (GPU), on each trainer node K (its local rank 0 launches its servers of rollout.server_layout):
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank K --rdzv_backend static --master_addr HEAD \
        --master_port 29400 train.py --config configs/qwen3_30b_a3b_dapo.yaml trainer.num_nodes=2
Simplifications: data parallel only (FSDP2 over the decoder layers); GPU-only paths (nccl, bf16 compute,
flash_attention_2, CUDA IPC weight sync, launching SGLang) are switched on by device=cuda / rollout.launch=sglang
and run by bench/gpu_smoke.sh, not on CPU. Log-prob convention (shared with standins/engine.py and losses.py):
log_softmax(logits / temperature) of the sampled token.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import math
import os
import random
import signal
import sys
import time
from typing import Callable, Optional

# torch's C++ warnings, above all the RPC agent's "eof" the moment a child dies, would print before the root-cause
# error rank 0 reports (Services); C++ errors still print. TORCH_CPP_LOG_LEVEL=WARNING shows them.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402  (after the log level, which torch reads when it loads)
import torch.distributed as dist  # noqa: E402

import batching  # noqa: E402
import buffer as buffer_lib  # noqa: E402
import remote  # noqa: E402
import checkpoint  # noqa: E402
import checks  # noqa: E402
import config as config_lib  # noqa: E402
import losses  # noqa: E402
import model as model_lib  # noqa: E402
import services as services_lib  # noqa: E402
import strategies  # noqa: E402
import weight_sync as weight_sync_lib  # noqa: E402
from logger import SAMPLES_PER_STEP, Logger, aggregate, sample_records, trained_group_metrics  # noqa: E402
from memory import memory_report, optimizer_impl  # noqa: E402
from run_modes import NoRollout, ReplayBuffer, RolloutRecorder, make_evaluator  # noqa: E402
from services import GRACE_S, ChildExited, Services  # noqa: E402

STARTUP_ERROR_WAIT_S = 30.0  # a rank other than 0 that fails with rank 0 waits this long for torchrun to stop it


# ---------------------------------------------------------------------------------------------------------------
# The step loop, on every rank (also driven by bench/pipeline_sim.py with simulated compute)
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
    """Train steps start_step .. trainer.total_steps - 1 on every rank; step i is logged as step i + 1 (the weights
    after it are weight version i + 1; the initial weights are version 0). buffer, rollout, logger, evaluate and
    servers are rank 0's (None on the other ranks): what touches them is under `if rank == 0`; actor's methods are
    called on every rank at the same point, so their collectives pair up.

    actor:    train_minibatch(groups, step) -> dict (groups: rank 0's, None elsewhere; may include
              timing/process_traj, which is not training time), sync_weights(version) -> dict | None,
              save_checkpoint(steps_done, run_state) -> None, release() / resume() (colocate: the servers free /
              retake their memory around training).
    buffer:   get(k, timeout) -> list[Group], wait(k, timeout) -> dict (see fetch), step_metrics() -> dict,
              state_dict(), set_weight_version(v) (buffer.PipelineServer or remote.RemoteBuffer).
    rollout:  start(), pause() -> dict, resume(version), step_metrics() -> dict (rollout.Rollout or RemoteRollout).
    logger:   log(step, metrics: dict); metrics hold numbers plus "data/prompt_ids" ([[epoch, data_index], ...]
              in training order) and "data/samples" (sample_records of a few trained trajectories);
              waiting(step, record) while the trainer waits for groups (Logger.waiting).
    evaluate: optional fn(steps_done) -> dict, run every trainer.eval_freq steps and after the last one.
    servers:  optional fn() -> {URL: answering /health}, for the waiting line.
    run_state given to save_checkpoint on rank 0: {"step": steps done, "weight_version", "buffer":
    buffer.state_dict()} (None on the other ranks).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    sync_mode = not cfg.fully_async.enable
    gpc, total = cfg.groups_per_call, cfg.trainer.total_steps
    if rank == 0:
        rollout.start()  # idempotent; the producer starts filling the buffer with the current weights
    length_warned = False
    for step in range(start_step, total):
        t_step = time.perf_counter()
        m: dict = {}
        records: list[dict] = []  # one per training call, aggregated by the spec's naming rule
        prompt_ids, samples = [], []
        done = step + 1

        # ---- synchronous mode: the whole batch first, then the producer stops (colocate: servers release) ----
        batch = None
        if sync_mode:
            if rank == 0:
                t0 = time.perf_counter()
                batch = fetch(cfg, buffer, cfg.B, done, logger, servers)
                m["timing/rollout"] = time.perf_counter() - t0
                m.update(rollout.pause())
            if cfg.colocate:
                m.update(actor.release() or {})

        # ---- (B x N) // M training calls of M // N groups: fetch, forward/backward, optimizer step ----
        for call in range(cfg.calls_per_step):
            rec, groups = {}, None
            if rank == 0:
                if sync_mode:
                    groups = batch[call * gpc:(call + 1) * gpc]
                else:
                    t0 = time.perf_counter()
                    groups = fetch(cfg, buffer, gpc, done, logger, servers)
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

        # ---- pause: the producer stops at the step boundary (colocate: the servers take their weights back) ----
        if rank == 0 and not sync_mode:
            m.update(rollout.pause())
        if sync_mode and cfg.colocate:
            m.update(actor.resume() or {})
        if rank == 0:
            m.update(buffer.step_metrics())
            m.update({k: v for k, v in rollout.step_metrics().items() if k not in m})

        # ---- checkpoint (buffer state taken while paused: unconsumed, in-flight and restored groups are in it) ----
        if (cfg.trainer.save_freq and done % cfg.trainer.save_freq == 0) or done == total:
            t0 = time.perf_counter()
            run_state = {"step": done, "weight_version": done, "buffer": buffer.state_dict()} if rank == 0 else None
            actor.save_checkpoint(done, run_state)
            m["timing/save_ckpt"] = time.perf_counter() - t0

        # ---- weight sync (servers flush their cache unless in_place, serve version step + 1) ----
        t0 = time.perf_counter()
        out = dict(actor.sync_weights(done) or {})
        m["timing/update_weights"] = out.pop("timing/update_weights", time.perf_counter() - t0)
        m.update(out)

        # ---- resume the producer; log (wait is everything outside the training block, spec section 4) ----
        if rank != 0:
            continue
        buffer.set_weight_version(done)
        if done < total:
            rollout.resume(done)
        m["timing/step"] = time.perf_counter() - t_step
        m["perf/wait_ratio"] = min(1.0, max(0.0, 1.0 - m.get("timing/train", 0.0) / max(m["timing/step"], 1e-9)))
        if evaluate is not None and ((cfg.trainer.eval_freq and done % cfg.trainer.eval_freq == 0) or done == total):
            m.update(evaluate(done))
        m["data/prompt_ids"], m["data/samples"] = prompt_ids, samples
        cut = m.get("rollout/truncation_ratio", 0.0)
        if cut > 0.5 and not length_warned:  # once: most answers cut short score as wrong whatever the model learns
            length_warned = True
            print(f"[train] warning: {cut:.0%} of the responses finished in step {done} ended at "
                  f"rollout.sampling.max_new_tokens={cfg.rollout.sampling.max_new_tokens} tokens without stopping "
                  "(rollout/truncation_ratio); raise it if this task's answers need more", file=sys.stderr,
                  flush=True)
        logger.log(done, m)


def micro_batch_loss(cfg, logp: torch.Tensor, old_lp: torch.Tensor, b: dict, denom: float, entropy, step: int):
    """algorithm.policy_loss on one collated micro-batch (losses.POLICY_LOSSES): the step-start weights are version
    `step`, so the update being computed produces version step + 1 (loglinear's current version)."""
    batch = losses.TokenBatch(logp, old_lp, b["rollout_lp"], b["adv"], b["mask"], b["versions"], step + 1, entropy)
    return losses.POLICY_LOSSES[cfg.algorithm.policy_loss](batch, cfg.algorithm, denom)


# ---------------------------------------------------------------------------------------------------------------
# The actor: the model side of run_steps, on every rank
# ---------------------------------------------------------------------------------------------------------------

class RankZeroFailed(RuntimeError):  # on the other ranks: a step failed on rank 0, which stops the run with it
    pass


class Actor:
    """FSDP2 policy on every rank. Every rank calls each public method at the same point of the step loop; what
    rank 0 alone does in them (plan the mini-batch, talk to the servers) is under `if self.rank == 0`, and what
    the other ranks need of it reaches them by a collective on `ctrl`, the gloo control group (a timeout that
    covers rank 0's longest wait between two collectives: data, pause, server start-up)."""

    def __init__(self, cfg, model, optimizer, scheduler, device, ctrl, fleet=None):
        self.cfg, self.model, self.opt, self.sched, self.device = cfg, model, optimizer, scheduler, device
        self.ctrl = ctrl
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.snapshot: Optional[list] = None  # step-start local shards (old policy), see _old_log_probs
        self.snapshot_step = -1
        # Nothing random in the training forward (no dropout): at a step's first call it is the old policy's forward
        # too, so its log-probs, detached, are the old log-probs and the separate no-grad forward is skipped.
        self.train_forward_is_old = not (getattr(model.config, "attention_dropout", 0.0) or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()))
        self.weights = weight_sync_lib.WeightSync(cfg, model, device, ctrl)
        self.fleet = fleet  # sglang_client.SyncFleet on rank 0 when there are servers, else None
        self.pushes = cfg.run_mode == "default"  # every rank: whether there are servers to sync (train-only: none)
        self.group_members: Optional[list] = None  # rank 0: the server URLs the last sync went to
        self.services: Optional["Services"] = None  # rank 0: the launched servers (relaunched when they die)
        self.released = False  # colocate: the servers' memory is released (every rank: set by release / main)
        self.push_s = 0.0  # seconds of the last push (perf/weight_sync_gbps)
        self.ckpt_root = os.path.join(cfg.run_dir, "checkpoints")

    @property
    def fleet(self):
        return self.weights.fleet

    @fleet.setter
    def fleet(self, fleet) -> None:
        self.weights.fleet = fleet

    # ---- training ----
    def train_minibatch(self, groups: Optional[list], step: int) -> dict:
        """One training call on every rank: rank 0 splits its groups (None on the other ranks) into each rank's
        micro-batches and scatters them, then every rank runs forward/backward on its share and the optimizer
        step (train_plan)."""
        t0 = time.perf_counter()
        plans, denom = None, 0.0
        if self.rank == 0:
            plans, denom = self.plan(groups)
        box = [(plans[0], denom)] if self.world == 1 else [None]
        if self.world > 1:
            dist.scatter_object_list(box, [(p, denom) for p in plans] if self.rank == 0 else None, src=0,
                                     group=self.ctrl)
        plan, denom = box[0]
        process_s = time.perf_counter() - t0
        metrics = self.train_plan(plan, step, denom)
        metrics["timing/process_traj"] = process_s
        if self.rank == 0:
            metrics["train/loss_tokens"] = float(sum(mb["mask"].sum() for p in plans for mb in p))
        return metrics

    def plan(self, groups: list) -> tuple:
        """Rank 0: the groups -> each rank's collated micro-batches (balanced by tokens, padded with DUMMY rows to
        the same count: FSDP collectives need the same number of forwards on every rank), and the denominator of
        the loss aggregation over the WHOLE mini-batch (all ranks, all micro-batches), so the micro-batch losses
        sum to the mini-batch loss (losses.py, "Loss aggregation")."""
        cfg = self.cfg
        pack = cfg.trainer.packing
        seqs = batching.make_sequences(groups, cfg)
        plans = [[batching.collate(mb, cfg.rollout.mask_offpolicy_in_partial_rollout, pack)
                  for mb in batching.plan_micro_batches(share, cfg.trainer.micro_batch_tokens, pack)]
                 for share in batching.split_balanced(seqs, self.world)]
        n_micro = max(len(p) for p in plans)
        plans = [p + [batching.collate([batching.DUMMY], packing=pack)] * (n_micro - len(p)) for p in plans]
        mode, norm = cfg.algorithm.loss_agg_mode, cfg.rollout.sampling.max_new_tokens
        return plans, sum(losses.loss_denominator(mb["mask"], mode, norm) for p in plans for mb in p)

    def train_plan(self, plan: list, step: int, denom: float) -> dict:
        """This rank's micro-batches of one training call: forward/backward of each, the optimizer step, and the
        call's metrics over every rank."""
        batches = [{k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()} for mb in plan]
        local = self.forward_backward(batches, step, denom)
        out = self.optimizer_step()
        out.update(self.reduce_metrics(*local))
        out.update(model_lib.memory_metrics(self.device))
        return out

    def forward_backward(self, batches: list[dict], step: int, denom: float) -> tuple:
        """Gradients of this rank's share of the mini-batch loss; returns its metrics as (sums, weights, extremes)
        for reduce_metrics."""
        t = self.cfg.trainer
        old = self._old_log_probs(batches, step)
        self.model.train()
        sums, weights, extremes = {}, {}, {}
        for b, old_lp in zip(batches, old):
            # entropy only for train/entropy: no loss term here uses it, and it costs a float32 [chunk, vocab]
            # buffer and the softmax's work again, in the forward and in the backward
            logp, ent = self._token_logprobs(b, with_entropy=t.entropy_metric)
            if old_lp is None:  # the step's first call: these weights are the old policy
                old_lp = logp.detach()
            loss, met = micro_batch_loss(self.cfg, logp, old_lp, b, denom, ent, step)
            pi_lp = logp.detach() if t.use_rollout_log_probs else old_lp  # pi_old (old_lp would be mu there)
            for k, v in losses.offpolicy_diagnostic_sums(pi_lp, b["rollout_lp"], b["adv"], b["mask"],
                                                         self.cfg.algorithm.clip_high).items():
                sums["offpolicy/" + k], weights["offpolicy/" + k] = sums.get("offpolicy/" + k, 0.0) + v, 1.0
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
        return sums, weights, extremes

    def optimizer_step(self) -> dict:
        """Clip, step (skipped when the gradient is not finite: it would poison the weights), zero, schedule."""
        t = self.cfg.trainer
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if math.isfinite(grad_norm):
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return {"train/grad_norm": grad_norm, "train/lr": self.sched.get_last_lr()[0],
                "train/skipped_update": float(not math.isfinite(grad_norm))}

    def reduce_metrics(self, sums: dict, weights: dict, extremes: dict) -> dict:
        """Every rank's forward_backward metrics -> the call's: train/pg_loss summed, means token-weighted,
        *_max / *_min over every micro-batch with loss tokens; train/loss = train/pg_loss (GRPO: no KL or
        entropy term); the off-policy diagnostics from their sums (losses.offpolicy_diagnostics)."""
        parts: list = [None] * self.world
        dist.all_gather_object(parts, (sums, weights, extremes), group=self.ctrl)
        out = {}
        for k in dict.fromkeys(k for s, _, _ in parts for k in s):
            tot = sum(s.get(k, 0.0) for s, _, _ in parts)
            w = sum(wt.get(k, 0.0) for _, wt, _ in parts)
            out[k] = tot if k == "train/pg_loss" or k.startswith("offpolicy/") else tot / max(w, 1e-9)
        out.update(losses.offpolicy_diagnostics({k[10:]: out.pop(k) for k in list(out) if k[:10] == "offpolicy/"}))
        for k in dict.fromkeys(k for _, _, e in parts for k in e):
            vals = [v for _, _, e in parts for v in e.get(k, [])]
            out[k] = max(vals) if k.endswith("_max") else min(vals)
        out["train/loss"] = out.get("train/pg_loss", 0.0)
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
        # first: the unsharded parameters of the last layer and root would be listed instead
        model_lib.reshard(self.model)
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
        model_lib.reshard(self.model)
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
        return model_lib.token_logprobs(self.model, b, self.cfg.rollout.sampling.temperature,
                                        self.cfg.trainer.logprob_chunk_tokens, with_entropy)

    # ---- weights: weight_sync.py gathers bucket by bucket and pushes ----
    def sync_weights(self, version: int) -> dict:
        """Every rank: push the weights to every server as `version` (weight_sync.method: distributed, tensor or
        disk; see weight_sync.py). Every call has weight_sync.timeout_s. The sync goes to the servers that answer
        /health (rank 0 waits up to rollout.startup_timeout_s for one); the weight-update group is formed again
        when they change or one rank 0 launched was relaunched (Services.watch), and a failed sync is retried once
        by every rank with a new group (after the relaunch of a server that died): the push's status collective
        tells every rank that it failed. A second failure stops the run with the server's message. Colocate: the
        trainer then offloads its parameters and optimizer state, and the servers take back their KV cache (their
        weights came back in `resume`, before the push)."""
        if not self.pushes:
            return {}
        t0 = time.perf_counter()
        retry = False
        for attempt in (1, 2):
            if self.rank == 0:
                replaced = self.services is not None and self.services.take_replaced()
                live = self.fleet.live_workers(self.cfg.rollout.startup_timeout_s)
                if retry or replaced or live != self.group_members:
                    if self.group_members is not None and live != self.group_members:
                        print(f"[train] warning: the servers answering are now {live} (were {self.group_members}): "
                              "the weight-update group is formed again with them", file=sys.stderr, flush=True)
                    self.weights.drop_group()
                self.group_members = live
            if self.world > 1:  # the other ranks wait out rank 0's checks here, under the control group's timeout
                dist.barrier(group=self.ctrl)
            error = self.push_weights(version)  # on every rank or on none (rank 0's: the exception)
            if error is None:
                break
            if attempt == 2:  # rank 0 stops the run with the error
                raise error
            # A server died (ours is relaunched: take_replaced waits for it) or restarted on its URL (no longer in
            # the group): once more with a new group of the servers that answer.
            retry = True
            if self.rank == 0:
                if self.services is not None:
                    self.services.server_died(GRACE_S)
                print(f"[train] warning: weight sync of version {version} failed ({str(error).splitlines()[0]}); "
                      "retrying once with a new weight-update group of the servers that answer", file=sys.stderr,
                      flush=True)
        out = {"timing/update_weights": time.perf_counter() - t0}
        out["perf/weight_sync_gbps"] = self.weights.last_bytes / 1e9 / max(self.push_s, 1e-9)
        if self.cfg.colocate:
            out["perf/memory_after_offload"] = self.push_memory
        if self.released:  # stage 2 of colocate's resume: the KV cache, once the trainer has left the GPU
            t1 = time.perf_counter()
            if self.rank == 0:
                self.fleet.resume_memory(["kv_cache", "cuda_graph"])
            self.released = False
            out["timing/resume_kv_cache"] = time.perf_counter() - t1
        if self.services is not None:
            out["rollout/server_restarts"] = self.services.server_restarts
        return out

    def push_weights(self, version: int) -> Optional[Exception]:
        """Every rank: the push (weight_sync.WeightSync.push), then colocate's offload. Returns None, or on every
        rank the push's failure (rank 0's exception; on the others a RuntimeError saying so): the push's own
        status collective and rank 0's outcome, broadcast, make every rank agree (also for the disk method, whose
        failure only rank 0 sees), so the retry pairs up bucket for bucket."""
        t0 = time.perf_counter()
        error = None
        try:
            self.weights.push(version)
        except Exception as e:
            if self.rank != 0:
                raise
            error = e
        if self.world > 1:
            box = [None if error is None else f"{type(error).__name__}: {error}"]
            dist.broadcast_object_list(box, src=0, group=self.ctrl)
            if self.rank != 0 and box[0] is not None:
                error = RankZeroFailed(f"weight sync of version {version} failed on trainer rank 0: {box[0]}")
        self.push_s = time.perf_counter() - t0
        if error is None and self.cfg.colocate:
            self.snapshot = None  # last step's old policy: not needed again
            self.offload("cpu")
            self.push_memory = model_lib.memory_now(self.device)
        return error

    def export_hf(self, path: str) -> None:
        """Every rank: the float32 master weights as an HF checkpoint directory in trainer.export_dtype
        (checkpoint.export_hf; not weight_sync's bf16 unshard)."""
        if self.cfg.colocate:  # the last sync offloaded the trainer
            self.offload(self.device)
        if self.world > 1:  # rank 0 may still be asking the servers (their weight versions)
            dist.barrier(group=self.ctrl)
        checkpoint.export_hf(self.model, self.cfg.model.path, path,
                             checkpoint.export_dtype(self.cfg.trainer.export_dtype, self.cfg.model.path))

    # ---- checkpoints (checkpoint.py): sharded model + optimizer (DCP) + run state ----
    def save_checkpoint(self, steps_done: int, run_state: Optional[dict]) -> None:
        checkpoint.save(self.model, self.opt, self.sched, self.ckpt_root, steps_done, run_state, self.ctrl)

    def load_checkpoint(self, path: str) -> dict:
        """Model, optimizer, scheduler and RNG from `path` on every rank; returns the run state."""
        return checkpoint.load(self.model, self.opt, self.sched, path)

    # ---- colocate: trainer state off the GPU while the servers generate; the servers' memory in two stages ----
    def offload(self, where, params: bool = True) -> None:
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
            # cuBLAS's per-stream workspaces (32 MiB each on Hopper) live in the caching allocator and pin the
            # segments they were cut from: on an H200 they kept 1.16 GiB reserved after offloading (gpu_smoke)
            getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
            torch.cuda.empty_cache()

    def release(self) -> dict:
        """After generation: the servers release weights, KV cache and CUDA graphs (rank 0 asks them), then every
        rank onloads."""
        t0 = time.perf_counter()
        if self.rank == 0:
            self.fleet.release_memory()
        self.released = True
        dist.barrier(group=self.ctrl)  # no rank onloads before the servers have let go
        t1 = time.perf_counter()
        self.offload(self.device)
        return {"timing/release_rollout": t1 - t0, "timing/onload_train": time.perf_counter() - t1}

    def resume(self) -> dict:
        """After training, stage 1: the servers' weights only (the push needs them and the trainer's parameters).
        Before they come back every rank leaves what the push does not need (leave_for_push), so SGLang's
        weights land in memory the trainer has given up, not beside its optimizer state and cached blocks (verl
        offloads the optimizer and empties the cache before resume(tags=["weights"]), fsdp_workers.py). Stage 2,
        the KV cache, follows the push and the parameters' offload (sync_weights)."""
        t0 = time.perf_counter()
        out = self.leave_for_push()
        dist.barrier(group=self.ctrl)  # the servers' weights come back once every rank has left
        if self.rank == 0:
            self.fleet.resume_memory(["weights"])
        return out | {"timing/resume_rollout": time.perf_counter() - t0}

    def leave_for_push(self) -> dict:
        """The old-policy snapshot dropped (the step is trained), the optimizer state to the host and the CUDA
        cache emptied; perf/memory_* of this rank before and after (GiB)."""
        before = model_lib.memory_now(self.device)
        self.snapshot = None
        self.offload("cpu", params=False)
        gc.collect()
        return {"perf/memory_train_end": before, "perf/memory_before_push": model_lib.memory_now(self.device)}


def start_fleet(cfg, services, version: int, launched: bool, wait: bool = True):
    """Rank 0: the servers of rollout.server_layout (this node's launched here, the other nodes' published by their
    local rank 0, see node_services; or rollout.servers / rollout.router_url already running), where they reach the
    broadcast group, and the SyncFleet once every server answers /health. wait=False: the SyncFleet of the URLs, the
    servers maybe still starting (wait_fleet waits)."""
    import sglang_client

    if launched:  # started (or already starting), waited for in wait_fleet
        cfg.rollout.servers = services.launch_fleet(version, wait=False)
    cfg.weight_sync.master_address = services_lib.master_address(cfg, launched)
    fleet = services.fleet = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    if wait:
        wait_fleet(cfg, services, version, launched)
    return fleet


def wait_fleet(cfg, services, version: int, launched: bool) -> None:
    """Until this node's launched servers answer /health (their log and exit named if one dies), then every
    server of the fleet, and their sglang versions."""
    if launched:
        services.launch_servers(version, 0)
    services.fleet.wait_healthy(cfg.rollout.startup_timeout_s)


def node_services(cfg, local_rank: int, launched: bool):
    """Ranks other than 0: local rank 0 of a node with servers in rollout.server_layout launches them, publishes
    their URLs for rank 0 and supervises them (Services.serve_node); None elsewhere."""
    node = int(os.environ.get("GROUP_RANK", "0"))
    if local_rank != 0 or not launched or not any(s.node == node for s in cfg.rollout.server_layout):
        return None
    services = Services(cfg)
    services.serve_node(node)
    return services


# ---------------------------------------------------------------------------------------------------------------
# main: every rank
# ---------------------------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plot":  # `python train.py plot RUN_DIR`: the same as `python plot.py RUN_DIR`
        import plot

        return plot.plot_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny.yaml")
    args, overrides = parser.parse_known_args(argv)

    # ---- config: every start-up check before anything starts; errors are one sentence ----
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = config_lib.load_config(args.config, overrides)
        checks.check_launch(cfg, world)
        if rank == 0:
            checks.check_inputs(cfg)
    except (ValueError, FileNotFoundError) as e:
        # Every rank reads the config; one line for the run, not one per rank. Rank 0 prints it and exits 2 first:
        # a rank that exited first would have torchrun stop rank 0 before its line was out (seen under load).
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(STARTUP_ERROR_WAIT_S)  # torchrun stops this rank once rank 0 has exited
        sys.exit(2)
    warning = losses.offpolicy_warning(cfg)
    if warning and rank == 0:
        print(warning, file=sys.stderr, flush=True)
    pairing = strategies.pairing_note(cfg.fully_async.sliding_window, cfg.algorithm.policy_loss,
                                      cfg.rollout.mask_offpolicy_in_partial_rollout)
    if pairing and cfg.fully_async.enable and rank == 0:
        print(f"[train] {pairing}", flush=True)

    # ---- distributed init: gloo on CPU, nccl on GPU; a gloo control group for Python objects and long waits ----
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
    # The control group's timeout covers rank 0's longest wait between two collectives (data, pause, server
    # start-up), which the other ranks spend in it.
    ctrl_s = b.get_timeout_s + r.pause_timeout_s + r.startup_timeout_s + cfg.weight_sync.timeout_s + 600
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ctrl_s))
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    os.makedirs(cfg.run_dir, exist_ok=True)
    if rank == 0 and cfg.model.make_tiny and not os.path.isdir(cfg.model.path):
        from standins import tiny_model

        print(f"[train] making the tiny model at {cfg.model.path} ({cfg.model.tiny_pretrain_steps} pretraining "
              "steps)", flush=True)
        tiny_model.make_tiny_for(cfg)
    dist.barrier(group=ctrl)

    services, ok, failed, actor, logger, fleet = None, False, 0, None, None, None
    buf = ro = evaluate = None
    launched = cfg.run_mode != "train-only" and not r.servers and not r.router_url and r.launch != "none"
    try:
        # ---- the checkpoint to resume: rank 0 picks it (warning once about those that do not load) ----
        box = [None]
        if rank == 0 and cfg.trainer.resume == "auto":
            box = [checkpoint.latest_checkpoint(cfg.run_dir)]
        elif rank == 0 and cfg.trainer.resume != "none":
            box = [cfg.trainer.resume]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        resume_path = box[0]

        # ---- colocate: the servers start first and release their memory before the model loads; otherwise they
        # start now and the model loads during their start-up (minutes for SGLang at scale), waited for below ----
        colocated = cfg.colocate and cfg.run_mode == "default"
        starts_servers = rank == 0 and (launched or colocated)  # labelled with the version they first serve
        first_version = checkpoint.load_run_state(resume_path)["step"] if starts_servers and resume_path else 0
        if rank == 0 and launched and not colocated:
            services = Services(cfg)
            services.launch_servers(first_version, 0, wait=False)
        if colocated:
            if rank == 0:
                services = Services(cfg)
                fleet = start_fleet(cfg, services, first_version, launched)
                fleet.release_memory()
            else:
                services = node_services(cfg, local_rank, launched)
            dist.barrier(group=ctrl)  # the other ranks load the model once the servers have let go of the GPUs

        # ---- model + FSDP2 + optimizer (rollout-only trains nothing: rank 0 alone records) ----
        if cfg.run_mode == "rollout-only" and rank != 0:
            return
        if cfg.run_mode != "rollout-only":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (world,))
            model, _ = model_lib.load_model(cfg, mesh, device, rank, ctrl)
            if rank == 0:
                print(memory_report(cfg, model, world, device, cfg.trainer.entropy_metric), flush=True)
            opt, sched = model_lib.build_optimizer(model, cfg.trainer, optimizer_impl(cfg, device.type))
            actor = Actor(cfg, model, opt, sched, device, ctrl)
            actor.released = colocated
        if rank != 0 and services is None:  # (colocate started them before the model loaded)
            services = node_services(cfg, local_rank, launched)

        # ---- resume: model, optimizer, RNG on every rank; run state (step, buffer) ----
        run_state = None
        if resume_path:
            run_state = actor.load_checkpoint(resume_path) if actor else checkpoint.load_run_state(resume_path)
            if rank == 0:
                print(f"[train] resumed from {resume_path} at step {run_state['step']}", flush=True)
        start_step = run_state["step"] if run_state else 0

        # ---- rank 0: servers, buffer + rollout processes, RPC (train-only needs none), logger, evaluator ----
        if rank == 0:
            from transformers import AutoTokenizer

            import rollout as rollout_lib

            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            logger = Logger(cfg, keep_until=start_step if run_state else -1, tokenizer=tokenizer)
            if cfg.run_mode == "train-only":
                buf = ReplayBuffer(cfg.trainer.rollout_dir or os.path.join(cfg.run_dir, "rollouts"))
                ro = NoRollout()
            else:
                waiting = fleet is None
                if waiting:  # the URLs now; /health below, once the RPC workers are starting too
                    services = services or Services(cfg)
                    fleet = start_fleet(cfg, services, start_step, launched, wait=False)
                resolved = os.path.join(cfg.run_dir, "config.yaml")
                with open(resolved, "w") as f:
                    import yaml

                    yaml.safe_dump(config_lib.to_dict(cfg), f, sort_keys=False)
                services.spawn_rpc_workers(resolved)
                if waiting:
                    wait_fleet(cfg, services, start_step, launched)
                services.join_rpc()
                services.watch()
                buf = remote.RemoteBuffer("buffer", b.rpc_timeout_s)
                ro = rollout_lib.RemoteRollout("rollout", b.rpc_timeout_s)
                if actor is None:
                    actor = RolloutRecorder(cfg, fleet)
                else:
                    actor.fleet, actor.services = fleet, services
                evaluate = make_evaluator(cfg, fleet, tokenizer) if cfg.trainer.eval_freq else None
            if run_state:
                buf.load_state_dict(run_state["buffer"])

        # ---- the servers serve the trainer's weights (a resumed run's, or model.path's) as version start_step ----
        t0 = time.perf_counter()
        if getattr(actor, "released", False):
            actor.resume()
        actor.sync_weights(start_step)
        if rank == 0:
            buf.set_weight_version(start_step)
            print(f"[train] weights version {start_step} on the servers ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
            if evaluate is not None and start_step == 0:
                logger.log(0, evaluate(0))

        # ---- the loop, on every rank ----
        health = services.fleet.health if rank == 0 and services and services.fleet else None
        run_steps(cfg, actor, buf, ro, logger, start_step, evaluate, servers=health)
        if rank == 0 and services is not None and services.fleet is not None:
            infos = services.fleet.server_infos()
            print(f"[train] weight versions on the servers at the end: "
                  f"{dict(zip(services.fleet.workers(), (i.get('weight_version') for i in infos)))}", flush=True)

        # ---- final HF export ----
        if cfg.trainer.export_hf and isinstance(actor, Actor):
            actor.export_hf(os.path.join(cfg.run_dir, "hf"))
            if rank == 0:
                print(f"[train] exported {os.path.join(cfg.run_dir, 'hf')}", flush=True)
        # every rank leaves together: another node's servers (its local rank 0 supervises them) stay up until now
        dist.barrier(group=ctrl)
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
        if cause is None and rank != 0 and isinstance(e, RuntimeError):
            # rank 0 failed (its own error says why: let it print first) or a collective with it broke; one line.
            # Then wait for torchrun to stop this rank once rank 0 has exited: rank 0's teardown (its children, RPC)
            # takes seconds after its sockets may already be closed, and a rank that exited first would be torchrun's
            # "first observed failure" in place of rank 0's (its exit code 2 for a run that cannot train, say).
            print(f"[train] rank {rank}: lost trainer rank 0 (it failed, exited, or did not answer within the "
                  f"control group's timeout): {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}",
                  file=sys.stderr, flush=True)
            time.sleep(STARTUP_ERROR_WAIT_S)
            failed = 1
        elif cause is None:
            raise
        else:
            services.print_error_once(cause if isinstance(e, ChildExited) else f"{cause}\n(what it made fail here: "
                                      f"{type(e).__name__}: {str(e).splitlines()[0][:300]})")
            failed = 1
    finally:
        if logger is not None:
            logger.close()
        if services is not None:
            services.close(ok)
        if ok:
            with contextlib.suppress(Exception):
                # Every rank tears its gloo groups down together: a rank that destroys them while a peer still
                # has them open can abort at exit ("terminate called without an active exception").
                dist.barrier(group=ctrl)
                dist.destroy_process_group()
    if failed:
        sys.exit(failed)


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a crash in native code (SIGSEGV, SIGABRT) prints every thread's stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    try:
        main()
        code = 0
    except SystemExit as e:  # main's own exits: 2 for bad input or a run that cannot train, 1 for a failed run
        if not isinstance(e.code, (int, type(None))):
            raise
        code = e.code or 0
    services_lib.exit_process(code)
