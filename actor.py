"""actor.py: the model side of the step loop, on every trainer rank: the FSDP2 policy, its optimizer and what each
step asks of them (train.run_steps calls each method at the same point on every rank, so their collectives pair up).

Actor.train_minibatch: rank 0 plans the mini-batch (batching.py) and scatters each rank's micro-batches; every rank
runs forward/backward (logprobs.py through model.py, the loss of losses.py through micro_batch_loss) and the optimizer
step. Around it: the weight sync (weight_sync.py), checkpoints (checkpoint.py), the HF export (hf_export.py),
colocate's memory hand-overs (colocate.py) and KLProbe's train/kl_to_start after a step's last update.
"""
from __future__ import annotations

import itertools
import math
import os
import sys
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


class KLProbe:
    """train/kl_to_start: KL(pi_t || pi_0) on a fixed probe set, exact over the vocabulary (logprobs.kl_rows), at
    the sampling temperature (rollout.sampling.temperature, as the losses' log-probs; the whole vocabulary's
    distribution, not top_k / top_p's: two policies' truncated supports differ, where the KL is infinite).

    The set (`select`): at the run's first training call, the first trainer.kl_probe_tokens loss positions of its
    trajectories, taken one trajectory per group in turn (every group's first, then every group's second, ...: as
    many prompts as the positions reach), each cut after its last probe position. pi_0 (`ref`): the logits at those
    positions of the weights the run started from (a forward before the first update), on rank 0 in host memory as
    the forward returned them (positions x vocabulary: bf16 on cuda, float32 on CPU, so no rounding is added). Every
    rank holds the sequences and runs the same probe forward (FSDP: a collective); rank 0 compares. Both are in the
    checkpoints' run state, so a resumed run measures from the run's start."""

    def __init__(self, seqs: list[dict], ref: Optional[torch.Tensor] = None):
        self.seqs, self.ref = seqs, ref

    @staticmethod
    def select(groups: list, tokens: int) -> list[dict]:
        """The probe sequences (batching.collate's fields) of a training call's groups: up to `tokens` loss
        positions in all."""
        seqs, left = [], tokens
        columns = itertools.zip_longest(*(g.trajectories for g in groups))
        for t in (t for column in columns for t in column if t is not None):
            at = t.loss_mask.nonzero().flatten()[:left].tolist()
            if not at:
                continue
            cut = at[-1] + 1
            seqs.append({"prompt": t.prompt_ids.tolist(), "response": t.response_ids[:cut].tolist(),
                         "mask": [int(m > 0) for m in t.loss_mask[:cut].tolist()], "rollout_lp": [0.0] * cut,
                         "versions": [0] * cut, "adv": 0.0})
            left -= len(at)
            if not left:
                break
        return seqs

    def logits(self, model, t, device) -> torch.Tensor:
        """Every rank: the live model's logits at the probe positions [n, V], in the sequences' order, micro-batched
        as training is (trainer.micro_batch_tokens, trainer.packing)."""
        counts = [sum(s["mask"]) for s in self.seqs]
        where = {id(s): i for i, s in enumerate(self.seqs)}
        parts: list = [None] * len(self.seqs)
        model.eval()
        for mb in batching.plan_micro_batches(self.seqs, t.micro_batch_tokens, t.packing):
            b = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                 for k, v in batching.collate(mb, packing=t.packing).items()}
            rows = model_lib.position_logits(model, b)  # row-major: mb's sequences in turn
            for s, part in zip(mb, rows.split([counts[where[id(s)]] for s in mb])):
                parts[where[id(s)]] = part
        model_lib.reshard(model)
        return torch.cat(parts)

    def state(self) -> dict:
        return {"seqs": self.seqs, "ref": self.ref}


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
        self.run_id: Optional[str] = None  # the run's id (rundir.claim): in every checkpoint's run_state
        self.probe: Optional[KLProbe] = None  # train/kl_to_start's probe set (every rank; pi_0 on rank 0)
        self.calls = (-1, 0)  # (step, training calls of it so far): the probe runs after a step's last one

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
        step (train_plan). train/kl_to_start: pi_0 taken before the run's first update, measured after a step's last
        (KLProbe)."""
        call = self.calls[1] + 1 if self.calls[0] == step else 1
        self.calls = (step, call)
        t = self.cfg.trainer
        first = step == 0 and call == 1 and self.probe is None
        probe_s = self.take_probe(groups) if first and t.kl_probe_tokens else 0.0
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
        if self.probe is not None and call == self.cfg.calls_per_step and (step + 1) % t.kl_probe_every == 0:
            t1 = time.perf_counter()
            metrics.update(self.kl_to_start())
            probe_s += time.perf_counter() - t1
        if probe_s:
            metrics["timing/kl_probe"] = probe_s
        return metrics

    def take_probe(self, groups: Optional[list]) -> float:
        """Every rank, at the run's first training call, before its update: KLProbe's sequences from rank 0's groups
        to every rank, and their logits under these (the run's starting) weights kept on rank 0. Returns seconds."""
        t0 = time.perf_counter()
        box = [KLProbe.select(groups, self.cfg.trainer.kl_probe_tokens) if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0, group=self.ctrl)
        if box[0]:
            probe = KLProbe(box[0])
            ref = probe.logits(self.model, self.cfg.trainer, self.device)
            probe.ref = ref.cpu() if self.rank == 0 else None
            self.probe = probe
        elif self.rank == 0:
            print("[train] warning: the run's first training call has no loss positions to probe: train/kl_to_start "
                  "is not logged", file=sys.stderr, flush=True)
        return time.perf_counter() - t0

    def kl_to_start(self) -> dict:
        """Every rank: the probe forward of the live weights; rank 0: {train/kl_to_start: the mean over the probe
        positions of KL(pi_t || pi_0) (logprobs.kl_rows)}, the other ranks {}."""
        live = self.probe.logits(self.model, self.cfg.trainer, self.device)
        if self.rank != 0:
            return {}
        kl = logprobs.kl_rows(live, self.probe.ref, self.cfg.rollout.sampling.temperature,
                              self.cfg.trainer.logprob_chunk_tokens)
        return {"train/kl_to_start": float(kl.mean())}

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
        top_p / min_p, by the rule of rollout.sampling.backend), renormalised (docs/algorithms.md, "Top-k and top-p
        sampling")."""
        s = self.cfg.rollout.sampling
        support = logprobs.Support(s.top_k, s.top_p, s.min_p,
                                   logprobs.sampling_backend(s.backend, self.cfg.rollout.sglang_args.extra))
        return model_lib.token_logprobs(self.model, b, s.temperature, self.cfg.trainer.logprob_chunk_tokens,
                                        with_entropy, support)

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
        """run_state (rank 0's) with the run id and the KL probe set and its pi_0 logits, when there is one."""
        if run_state is not None:
            run_state = {**run_state, "run_id": self.run_id}
        if run_state is not None and self.probe is not None:
            run_state = {**run_state, "kl_probe": self.probe.state()}
        checkpoint.save(self.model, self.opt, self.sched, self.ckpt_root, steps_done, run_state, self.ctrl,
                        self.cfg.trainer.keep_checkpoints)

    def load_checkpoint(self, path: str) -> dict:
        """Model, optimizer, scheduler and RNG from `path` on every rank, and the KL probe set (pi_0 on rank 0
        only); returns the run state without the probe."""
        run_state = checkpoint.load(self.model, self.opt, self.sched, path)
        saved = run_state.pop("kl_probe", None)
        if saved is not None and self.cfg.trainer.kl_probe_tokens:
            self.probe = KLProbe(saved["seqs"], saved["ref"] if self.rank == 0 else None)
        elif self.cfg.trainer.kl_probe_tokens and self.rank == 0:
            print(f"[train] warning: {path} holds no KL probe set (a run from before train/kl_to_start): the run's "
                  "starting weights are unknown, so train/kl_to_start is not logged", file=sys.stderr, flush=True)
        return run_state

    # ---- colocate (colocate.py): the servers and the trainer take turns on the GPUs ----
    def memory_to_trainer(self) -> dict:
        return self.colocate.memory_to_trainer(self.fleet)

    def memory_to_servers(self) -> dict:
        self.old.drop()  # the step is trained: its old policy is not needed again
        return self.colocate.memory_to_servers(self.fleet)
