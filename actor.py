"""actor.py: the model side of the step loop, on every trainer rank: the FSDP2 policy, its optimizer and what each
step asks of them (train.run_steps calls each method at the same point on every rank, so their collectives pair up).

Actor.train_minibatch: rank 0 plans the mini-batch (batching.py) and scatters each rank's micro-batches; every rank
runs forward/backward (logprobs.py through model.py, the loss of losses.py through micro_batch_loss) and the optimizer
step. Around it: the weight sync (weight_sync.py), checkpoints (checkpoint.py), the HF export (hf_export.py) and
colocate's memory hand-overs (colocate.py).
"""
from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

import batching
import checkpoint
import colocate as colocate_lib
import hf_export
import logprobs
import losses
import model as model_lib
import weight_sync as weight_sync_lib
from logger import TrainMetrics

if TYPE_CHECKING:
    from services import Services


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
        checkpoint.save(self.model, self.opt, self.sched, self.ckpt_root, steps_done, run_state, self.ctrl,
                        self.cfg.trainer.keep_checkpoints)

    def load_checkpoint(self, path: str) -> dict:
        """Model, optimizer, scheduler and RNG from `path` on every rank; returns the run state."""
        return checkpoint.load(self.model, self.opt, self.sched, path)

    # ---- colocate (colocate.py): the servers and the trainer take turns on the GPUs ----
    def memory_to_trainer(self) -> dict:
        return self.colocate.memory_to_trainer(self.fleet)

    def memory_to_servers(self) -> dict:
        self.old.drop()  # the step is trained: its old policy is not needed again
        return self.colocate.memory_to_servers(self.fleet)
