"""train.py: the RL trainer, one SPMD program: every trainer rank runs the same `main()` and the same step loop.

main: config and start-up checks (checks.py) -> distributed init (gloo on CPU, nccl on GPU; a gloo control group)
-> the policy, FSDP2-sharded, and AdamW (model.py) -> rank 0 starts the inference servers (standins/engine.py on CPU,
SGLang on GPUs, or connects to rollout.servers / rollout.router_url), the buffer process and the rollout process
(services.py) -> resume (checkpoint.py) -> run_steps, the step loop (docs/design.md): fetch -> forward/backward and
optimizer step, (B x N) // M times -> pause -> checkpoint every trainer.save_freq -> weight sync (weight_sync.py) ->
resume the producer. Rank 0 alone talks to the buffer, the rollout and the servers, and logs, each under
`if rank == 0`; the other ranks get their share by a collective. Colocate: colocate.py.
run_mode=rollout-only / train-only and the greedy evaluator: run_modes.py; logging: logger.py; plots: plot.py.
Faults (docs/faults.md): a launched server that dies is relaunched and gets the weights at the next sync; any other
child that dies stops the run with its report as the one error line; bad inputs are refused before anything starts
(exit code 2), as is a run that cannot train (buffer.NothingToTrain).

Run (CPU: the tiny pretrained model on the reverse-digits task; greedy eval 0.9 at step ~200, ~3-5 min on 2 cores):
    torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml [fully_async.enable=false]
    python plot.py runs/tiny                           # metrics.jsonl -> runs/tiny/metrics.png
Multi-node (GPU), on each trainer node K (its local rank 0 launches its servers of rollout.server_layout):
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank K --rdzv_backend static --master_addr HEAD \
        --master_port 29400 train.py --config configs/qwen3_30b_a3b_dapo.yaml trainer.num_nodes=2
Simplifications: data parallel only (FSDP2 over the decoder layers); GPU-only paths (nccl, bf16 compute,
flash_attention_2, CUDA IPC weight sync, launching SGLang) are switched on by device=cuda / rollout.launch=sglang
and run by bench/gpu_smoke.sh, not on CPU. Log-prob convention (logprobs.py): log_softmax(logits / temperature) of
the sampled token, renormalised over the tokens the sampler could draw under rollout.sampling.top_k / top_p.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
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
import checkpoint  # noqa: E402
import checks  # noqa: E402
import colocate as colocate_lib  # noqa: E402
import config as config_lib  # noqa: E402
import hf_export  # noqa: E402
import logprobs  # noqa: E402
import losses  # noqa: E402
import model as model_lib  # noqa: E402
import services as services_lib  # noqa: E402
import strategies  # noqa: E402
import weight_sync as weight_sync_lib  # noqa: E402
from logger import (SAMPLES_PER_STEP, Logger, TrainMetrics, aggregate, sample_records,  # noqa: E402
                    trained_group_metrics)
from memory import memory_report, optimizer_impl  # noqa: E402
from run_modes import NoRollout, ReplayBuffer, RolloutRecorder, make_evaluator  # noqa: E402
from services import RANK0_EXIT_WAIT_S, Services  # noqa: E402


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
              save_checkpoint(steps_done, run_state) -> None, memory_to_trainer() / memory_to_servers()
              (colocate: the GPUs' memory goes to the trainer for training and back to the servers after it).
    buffer:   get(k, timeout) -> list[Group], wait(k, timeout) -> dict (see fetch), step_metrics() -> dict,
              state_dict(), set_weight_version(v) (buffer.PipelineServer or its remote.Proxy).
    rollout:  start(), pause() -> dict, resume(version), step_metrics() -> dict (rollout.Rollout or its remote.Proxy).
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
                m.update(actor.memory_to_trainer() or {})

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
            m.update(actor.memory_to_servers() or {})
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

        # ---- resume the producer; log (wait is everything outside the training block: perf/wait_ratio) ----
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
        logger.log(done, m)


def micro_batch_loss(cfg, logp: torch.Tensor, old_lp: torch.Tensor, b: dict, denom: float, entropy, step: int):
    """algorithm.policy_loss on one collated micro-batch (losses.POLICY_LOSSES): the step-start weights are version
    `step`, so the update being computed produces version step + 1 (loglinear's current version)."""
    batch = losses.TokenBatch(logp, old_lp, b["rollout_lp"], b["adv"], b["mask"], b["versions"], step + 1, entropy)
    return losses.POLICY_LOSSES[cfg.algorithm.policy_loss](batch, cfg.algorithm, denom)


# ---------------------------------------------------------------------------------------------------------------
# The actor: the model side of run_steps, on every rank
# ---------------------------------------------------------------------------------------------------------------

class Actor:
    """FSDP2 policy on every rank. Every rank calls each public method at the same point of the step loop; what
    rank 0 alone does in them (plan the mini-batch, talk to the servers) is under `if self.rank == 0`, and what
    the other ranks need of it reaches them by a collective on `ctrl`, the gloo control group (a timeout that
    covers rank 0's longest wait between two collectives: data, pause, server start-up)."""

    def __init__(self, cfg, model, optimizer, scheduler, device, ctrl, fleet=None):
        self.cfg, self.model, self.opt, self.sched, self.device = cfg, model, optimizer, scheduler, device
        self.ctrl = ctrl
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.old = model_lib.OldPolicy(model, device, host=cfg.trainer.snapshot == "cpu")
        self.weights = weight_sync_lib.WeightSync(cfg, model, device, ctrl)
        self.fleet = fleet  # sglang_client.SyncFleet on rank 0 when there are servers, else None
        self.pushes = cfg.run_mode == "default"  # every rank: whether there are servers to sync (train-only: none)
        self.services: Optional["Services"] = None  # rank 0: the launched servers (relaunched when they die)
        self.colocate = colocate_lib.Colocate(model, optimizer, device, ctrl)
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
        out.update(self.reduce_metrics(local))
        out.update(model_lib.memory_metrics(self.device))
        return out

    def forward_backward(self, batches: list[dict], step: int, denom: float) -> TrainMetrics:
        """Gradients of this rank's share of the mini-batch loss; returns its metrics, for reduce_metrics."""
        t = self.cfg.trainer
        old = self._old_log_probs(batches, step)
        self.model.train()
        acc = TrainMetrics()
        for b, old_out in zip(batches, old):
            # entropy only for train/entropy: no loss term here uses it, and it costs a float32 [chunk, vocab]
            # buffer and the softmax's work again, in the forward and in the backward
            logp, ent, mass = self._token_logprobs(b, with_entropy=t.entropy_metric)
            # pi_old and the log of the mass its support holds (None: no top_k / top_p); None from _old_log_probs:
            # these weights are the old policy (the step's first call), or there is no old forward
            old_lp, _, old_mass = old_out or (logp.detach(), None, mass)
            if old_mass is not None:
                # The engine reports mu over the whole vocabulary; the token was drawn from mu renormalised over the
                # support, whose mass the engine's logits hold and the trainer's step-start forward estimates
                # (docs/algorithms.md, "Top-k and top-p sampling"): pi_old / mu is then the whole vocabulary's ratio
                b = dict(b, rollout_lp=b["rollout_lp"] - old_mass)
            if t.use_rollout_log_probs:
                old_lp = b["rollout_lp"]
            loss, met = micro_batch_loss(self.cfg, logp, old_lp, b, denom, ent, step)
            pi_lp = logp.detach() if t.use_rollout_log_probs else old_lp  # pi_old (old_lp would be mu there)
            acc.add_sums({"offpolicy/" + k: v for k, v in losses.offpolicy_diagnostic_sums(
                pi_lp, b["rollout_lp"], b["adv"], b["mask"], self.cfg.algorithm.clip_high).items()})
            if not t.use_rollout_log_probs:  # trainer vs engine on the same tokens: the weight sync's fidelity
                gap = (old_lp - b["rollout_lp"]).abs() * b["mask"]
                met = {**met, "train/rollout_logprob_diff_max": gap.max(),
                       "train/rollout_logprob_diff_mean": gap.sum() / b["mask"].sum().clamp(min=1)}
            if old_mass is not None:
                met["train/sampling_mass_outside"] = (((1 - old_mass.exp()) * b["mask"]).sum()
                                                      / b["mask"].sum().clamp(min=1))
            # FSDP averages gradients over ranks; the losses already sum to the mini-batch loss, so undo the mean.
            (loss * self.world).backward()
            acc.add(met, float(b["mask"].sum()))
        return acc

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

    def reduce_metrics(self, acc: TrainMetrics) -> dict:
        """Every rank's forward_backward metrics -> the call's (TrainMetrics.reduce); train/loss = train/pg_loss
        (GRPO: no KL or entropy term); the off-policy diagnostics from their sums (losses.offpolicy_diagnostics)."""
        parts: list = [None] * self.world
        dist.all_gather_object(parts, acc.state(), group=self.ctrl)
        out = TrainMetrics.reduce(parts)
        out.update(losses.offpolicy_diagnostics({k[10:]: out.pop(k) for k in list(out) if k[:10] == "offpolicy/"}))
        out["train/loss"] = out.get("train/pg_loss", 0.0)
        return out

    def _old_log_probs(self, batches: list[dict], step: int) -> list:
        """(log pi_old, None, log-mass) per micro-batch: the step-start weights (model.OldPolicy), or None where the
        training forward stands in: at the step's first call, and under trainer.use_rollout_log_probs, whose pi_old
        is the engine's log-probs (no forward, no snapshot; the training forward's log-mass renormalises them)."""
        if self.cfg.trainer.use_rollout_log_probs:
            return [None] * len(batches)
        return self.old.log_probs(batches, step, self.cfg.calls_per_step > 1, self._token_logprobs)

    def _token_logprobs(self, b: dict, with_entropy: bool = False) -> tuple:
        """(log-probs, entropy, log-mass): over the tokens the engine's sampler can draw (rollout.sampling.top_k /
        top_p), renormalised (docs/algorithms.md, "Top-k and top-p sampling")."""
        s = self.cfg.rollout.sampling
        return model_lib.token_logprobs(self.model, b, s.temperature, self.cfg.trainer.logprob_chunk_tokens,
                                        with_entropy, logprobs.Support(top_k=s.top_k, top_p=s.top_p))

    # ---- weights: weight_sync.py gathers bucket by bucket, pushes, retries ----
    def sync_weights(self, version: int) -> dict:
        """Every rank: the servers get the weights as `version` (weight_sync.WeightSync.sync); colocate: then the
        trainer leaves the GPU and the servers take back their KV cache (colocate.Colocate.after_push)."""
        if not self.pushes:
            return {}
        out = self.weights.sync(version, self.services)
        if self.cfg.colocate:
            self.old.drop()  # last step's old policy: not needed again
            out.update(self.colocate.after_push(self.fleet))
        return out

    def export_hf(self, path: str) -> None:
        """Every rank: the float32 master weights as an HF checkpoint directory in trainer.export_dtype
        (hf_export.export_hf; not weight_sync's bf16 unshard)."""
        if self.cfg.colocate:  # the last sync offloaded the trainer
            self.colocate.offload(self.device)
        if self.world > 1:  # rank 0 may still be asking the servers (their weight versions)
            dist.barrier(group=self.ctrl)
        hf_export.export_hf(self.model, self.cfg.model.path, path,
                            hf_export.export_dtype(self.cfg.trainer.export_dtype, self.cfg.model.path))

    # ---- checkpoints (checkpoint.py): sharded model + optimizer (DCP) + run state ----
    def save_checkpoint(self, steps_done: int, run_state: Optional[dict]) -> None:
        checkpoint.save(self.model, self.opt, self.sched, self.ckpt_root, steps_done, run_state, self.ctrl)

    def load_checkpoint(self, path: str) -> dict:
        """Model, optimizer, scheduler and RNG from `path` on every rank; returns the run state."""
        return checkpoint.load(self.model, self.opt, self.sched, path)

    # ---- colocate (colocate.py): the servers and the trainer take turns on the GPUs ----
    def memory_to_trainer(self) -> dict:
        return self.colocate.memory_to_trainer(self.fleet)

    def memory_to_servers(self) -> dict:
        self.old.drop()  # the step is trained: its old policy is not needed again
        return self.colocate.memory_to_servers(self.fleet)

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
            time.sleep(RANK0_EXIT_WAIT_S)  # torchrun stops this rank once rank 0 has exited
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
                fleet = services.start_fleet(first_version, launched)
                fleet.release_memory()
            else:
                services = services_lib.for_node(cfg, local_rank, launched)
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
            opt, sched = model_lib.build_optimizer(model, cfg.trainer, optimizer_impl(cfg, device.type),
                                                      cfg.trainer.total_steps * cfg.calls_per_step)
            actor = Actor(cfg, model, opt, sched, device, ctrl)
            actor.colocate.released = colocated
        if rank != 0 and services is None:  # (colocate started them before the model loaded)
            services = services_lib.for_node(cfg, local_rank, launched)

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

            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            logger = Logger(cfg, keep_until=start_step if run_state else -1, tokenizer=tokenizer)
            if cfg.run_mode == "train-only":
                buf = ReplayBuffer(cfg.trainer.rollout_dir or os.path.join(cfg.run_dir, "rollouts"))
                ro = NoRollout()
            else:
                waiting = fleet is None
                if waiting:  # the URLs now; /health while the RPC workers start (start_workers)
                    services = services or Services(cfg)
                    fleet = services.start_fleet(start_step, launched, wait=False)
                buf, ro = services.start_workers(start_step, launched, wait_servers=waiting)
                if actor is None:
                    actor = RolloutRecorder(cfg, fleet)
                else:
                    actor.fleet, actor.services = fleet, services
                evaluate = make_evaluator(cfg, fleet, tokenizer) if cfg.trainer.eval_freq else None
            if run_state:
                buf.load_state_dict(run_state["buffer"])

        # ---- the servers serve the trainer's weights (a resumed run's, or model.path's) as version start_step ----
        t0 = time.perf_counter()
        if isinstance(actor, Actor) and actor.colocate.released:
            actor.memory_to_servers()
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
    except Exception as e:
        failed = services_lib.failure_exit_code(e, services, rank)  # prints the root cause; raises what it cannot
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
