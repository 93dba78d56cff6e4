"""train.py: the RL trainer, one SPMD program: every trainer rank runs the same `main()` and the same step loop.

main, one call per start-up step (Run's methods from the process group on): config and start-up checks (checks.py)
-> rank 0 claims run_dir (rundir.py: its lock for the process's life; a fresh run, or the checkpoint of this run to
resume) -> distributed init (gloo on CPU, nccl on GPU; a gloo control group) -> rank 0 launches the inference servers
(standins/engine.py on CPU, SGLang on GPUs) -> the policy, FSDP2-sharded, and AdamW (model.py; actor.py drives them)
-> resume (checkpoint.py) -> rank 0 starts the buffer and rollout processes (services.py), waits for the servers (or
connects to rollout.servers / rollout.router_url) -> the servers get the weights -> run_steps, the step loop
(docs/design.md): fetch -> forward/backward and optimizer step, (B x N) // M times -> pause -> checkpoint every
trainer.save_freq -> weight sync (weight_sync.py) -> resume the producer. Rank 0 alone talks to the buffer, the
rollout and the servers, and logs (its part of a step: Rank0; the other ranks hold an OtherRank); every rank's part
is Step's, the other ranks get their groups by a collective. The model side: actor.py. Colocate: colocate.py.
run_mode=rollout-only / train-only and the greedy evaluator: run_modes.py; logging: logger.py; plots: plot.py.
Faults (docs/faults.md): a launched server that dies is relaunched and gets the weights at the next sync; any other
child that dies stops the run with its report as the one error line; bad inputs are refused before anything starts
(exit code 2), as is a run that cannot train (buffer.NothingToTrain), their sentence also torchrun's root cause; SIGTERM
(a preemption) or Ctrl-C checkpoints the next step boundary and exits 0, a second Ctrl-C stops at once (preemption.py).
Under torchrun --max-restarts with trainer.resume=auto a restarted attempt resumes from the checkpoint and reuses the
servers the crashed one left.

Run (CPU: the tiny pretrained model on the reverse-digits task; greedy eval 0.9 at step ~200, ~3-5 min on 2 cores):
    torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml [trainer.resume=auto]
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

import buffer as buffer_lib  # noqa: E402
import checkpoint  # noqa: E402
import checks  # noqa: E402
import config as config_lib  # noqa: E402
import lease  # noqa: E402
import losses  # noqa: E402
import model as model_lib  # noqa: E402
import preemption  # noqa: E402
import rundir  # noqa: E402
import services as services_lib  # noqa: E402
import strategies  # noqa: E402
from actor import Actor  # noqa: E402
from logger import Logger, aggregate, train_samples, trained_group_metrics  # noqa: E402
from memory import memory_report, optimizer_impl  # noqa: E402
from run_modes import NoRollout, ReplayBuffer, RolloutRecorder, make_evaluator  # noqa: E402
from services import RANK0_EXIT_WAIT_S, Services  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402


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
        lease.beat()  # waiting within buffer.get_timeout_s is progress (the servers' lease: lease.beat)
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


class Step:
    """A step's every-rank part (each call at the same point on every rank: the actor's collectives pair up) and its
    record: the metrics rank 0 logs (m), one record per training call, rank 0's batch and trained prompts."""

    def __init__(self, cfg, actor, step: int):
        lease.beat()  # each phase of the step beats as it starts: the servers' lease is renewed while the loop goes on
        self.t0 = time.perf_counter()
        self.cfg, self.actor, self.step, self.done = cfg, actor, step, step + 1
        self.sync_mode = not cfg.fully_async.enable
        self.m: dict = {}
        self.records: list[dict] = []  # one per training call, aggregated by the spec's naming rule
        self.batch, self.prompt_ids, self.samples = None, [], []  # rank 0's
        every, total = cfg.trainer.save_freq, cfg.trainer.total_steps
        self.save = bool(every and self.done % every == 0) or self.done == total  # a checkpoint is due
        self.stop = False

    def memory_to_trainer(self) -> None:
        """Synchronous mode with colocate: the servers let go of the GPUs and every rank onloads."""
        if self.sync_mode and self.cfg.colocate:
            self.m.update(self.actor.memory_to_trainer() or {})

    def train(self, groups: Optional[list], rec: dict) -> None:
        """One training call: forward/backward, optimizer step (actor.train_minibatch); rec: Rank0.fetch's record."""
        lease.beat()
        t0 = time.perf_counter()
        out = self.actor.train_minibatch(groups, self.step) or {}
        rec["timing/train"] = time.perf_counter() - t0 - out.get("timing/process_traj", 0.0)
        self.records.append({**out, **rec})

    def stop_here(self) -> None:
        """The calls' records as the step's metrics; then whether any rank got SIGTERM or SIGINT
        (preemption.stop_here): if one did, this step is checkpointed and the loop ends after it."""
        self.m.update(aggregate(self.records))
        self.stop = preemption.stop_here(getattr(self.actor, "ctrl", None), self.done, self.cfg.trainer.total_steps)
        self.save = self.save or self.stop

    def memory_to_servers(self) -> None:
        """The step boundary starts (its beat); synchronous mode with colocate: the trainer leaves the GPUs and the
        servers take their weights back."""
        lease.beat()
        if self.sync_mode and self.cfg.colocate:
            self.m.update(self.actor.memory_to_servers() or {})

    def checkpoint(self, rank0) -> None:
        """The step's checkpoint: every rank's shards, and rank 0's run state (Rank0.run_state)."""
        lease.beat()
        t0 = time.perf_counter()
        self.actor.save_checkpoint(self.done, rank0.run_state(self.done))
        self.m["timing/save_ckpt"] = time.perf_counter() - t0

    def sync_weights(self) -> None:
        """The servers serve version step + 1 (they flush their cache unless in_place); none after a stop signal."""
        lease.beat()
        t0 = time.perf_counter()
        out = {} if self.stop else dict(self.actor.sync_weights(self.done) or {})
        self.m["timing/update_weights"] = out.pop("timing/update_weights", time.perf_counter() - t0)
        self.m.update(out)


class Rank0:
    """What rank 0 alone does in a step: it takes the groups from the buffer, pauses and resumes the rollout, reads
    the buffer's and the rollout's step metrics, gives a checkpoint the run state, sets the buffer's weight version,
    evaluates and logs. The other ranks hold an OtherRank in its place."""

    def __init__(self, cfg, buffer, rollout, logger, evaluate, servers):
        self.cfg, self.buffer, self.rollout, self.logger = cfg, buffer, rollout, logger
        self.evaluate, self.servers = evaluate, servers

    def start_rollout(self) -> None:
        self.rollout.start()  # idempotent; the producer starts filling the buffer with the current weights

    def fetch_batch(self, s: Step) -> None:
        """Synchronous mode: the whole batch first (timing/rollout), then the producer stops."""
        if s.sync_mode:
            t0 = time.perf_counter()
            s.batch = fetch(self.cfg, self.buffer, self.cfg.B, s.done, self.logger, self.servers)
            s.m["timing/rollout"] = time.perf_counter() - t0
            s.m.update(self.rollout.pause(s.save))

    def fetch(self, s: Step, call: int) -> tuple[list, dict]:
        """The M // N groups of training call `call` (synchronous mode: the batch's; fully async: fetched now,
        timing/rollout) and the call's record of them; their prompts and samples go into the step's log."""
        gpc = self.cfg.groups_per_call
        rec: dict = {}
        if s.sync_mode:
            groups = s.batch[call * gpc:(call + 1) * gpc]
        else:
            t0 = time.perf_counter()
            groups = fetch(self.cfg, self.buffer, gpc, s.done, self.logger, self.servers)
            rec["timing/rollout"] = time.perf_counter() - t0
        rec.update(trained_group_metrics(groups))
        s.prompt_ids += [[g.prompt.epoch, g.prompt.data_index] for g in groups]
        s.samples += train_samples(groups, self.cfg.logging.train_samples, len(s.samples))
        return groups, rec

    def pause(self, s: Step) -> None:
        """Fully async: the producer stops at the step boundary (before a checkpoint every request comes back, to be
        in it); then the buffer's and the rollout's step metrics."""
        if not s.sync_mode:
            s.m.update(self.rollout.pause(s.save))
        s.m.update(self.buffer.step_metrics())
        s.m.update({k: v for k, v in self.rollout.step_metrics().items() if k not in s.m})

    def run_state(self, done: int) -> dict:
        """A checkpoint's run state: steps done, weight version, and the buffer's state, taken while paused:
        unconsumed, in-flight and restored groups are in it."""
        return {"step": done, "weight_version": done, "buffer": self.buffer.state_dict()}

    def resume(self, s: Step) -> None:
        """The buffer's weight version (what is now too stale goes); the producer resumes unless the run ends."""
        self.buffer.set_weight_version(s.done)
        if s.done < self.cfg.trainer.total_steps and not s.stop:
            self.rollout.resume(s.done)

    def log(self, s: Step) -> None:
        """The step's time (wait is everything outside the training block: perf/wait_ratio), the evaluator every
        trainer.eval_freq steps and after the last one, then the step's line (logger.log)."""
        m, t = s.m, self.cfg.trainer
        m["timing/step"] = time.perf_counter() - s.t0
        m["perf/wait_ratio"] = min(1.0, max(0.0, 1.0 - m.get("timing/train", 0.0) / max(m["timing/step"], 1e-9)))
        if self.evaluate is not None and ((t.eval_freq and s.done % t.eval_freq == 0) or s.done == t.total_steps):
            lease.beat()  # the evaluator beats as its trajectories finish (run_modes.generate_dataset)
            m.update(self.evaluate(s.done) if not s.stop else {})
        m["data/prompt_ids"], m["data/samples"] = s.prompt_ids, s.samples
        self.logger.log(s.done, m)


class OtherRank:
    """Rank 0's part of a step on any other rank: nothing to do (its groups reach it in actor.train_minibatch)."""

    def start_rollout(self) -> None:
        pass

    def fetch_batch(self, s: Step) -> None:
        pass

    def fetch(self, s: Step, call: int) -> tuple[None, dict]:
        return None, {}

    def pause(self, s: Step) -> None:
        pass

    def run_state(self, done: int) -> None:
        return None

    def resume(self, s: Step) -> None:
        pass

    def log(self, s: Step) -> None:
        pass


def rank0_part(cfg, buffer, rollout, logger, evaluate, servers):
    """Rank0 on rank 0 (0 without a process group), OtherRank on the other ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Rank0(cfg, buffer, rollout, logger, evaluate, servers) if rank == 0 else OtherRank()


def run_steps(cfg, actor, buffer, rollout, logger, start_step: int,
              evaluate: Optional[Callable[[int], dict]] = None,
              servers: Optional[Callable[[], dict]] = None) -> None:
    """Train steps start_step .. trainer.total_steps - 1 on every rank; step i is logged as step i + 1 (the weights
    after it are weight version i + 1; the initial weights are version 0). buffer, rollout, logger, evaluate and
    servers are rank 0's (None on the other ranks): Rank0 alone touches them, the other ranks hold an OtherRank;
    actor's methods are called on every rank at the same point (Step's methods), so their collectives pair up.
    README.md's "One step" lists these calls in this order (tests/test_docs_outline.py checks).

    actor:    train_minibatch(groups, step) -> dict (groups: rank 0's, None elsewhere; may include
              timing/process_traj, which is not training time), sync_weights(version) -> dict | None,
              save_checkpoint(steps_done, run_state) -> None (run_state: Rank0.run_state on rank 0, None on
              the other ranks), memory_to_trainer() / memory_to_servers()
              (colocate: the GPUs' memory goes to the trainer for training and back to the servers after it).
    buffer:   get(k, timeout) -> list[Group], wait(k, timeout) -> dict (see fetch), step_metrics() -> dict,
              state_dict(), set_weight_version(v) (buffer.PipelineServer or its remote.Proxy).
    rollout:  start(), pause(checkpoint) -> dict, resume(version), step_metrics() -> dict (rollout.Rollout or its
              remote.Proxy).
    logger:   log(step, metrics: dict); metrics hold numbers plus "data/prompt_ids" ([[epoch, data_index], ...]
              in training order) and "data/samples" (logger.train_samples: records of trained trajectories);
              waiting(step, record) while the trainer waits for groups (Logger.waiting).
    evaluate: optional fn(steps_done) -> dict, run every trainer.eval_freq steps and after the last one.
    servers:  optional fn() -> {URL: answering /health}, for the waiting line.
    """
    rank0 = rank0_part(cfg, buffer, rollout, logger, evaluate, servers)
    rank0.start_rollout()
    for step in range(start_step, cfg.trainer.total_steps):
        s = Step(cfg, actor, step)
        rank0.fetch_batch(s)  # synchronous mode: the whole batch, then the pause
        s.memory_to_trainer()
        for call in range(cfg.calls_per_step):  # (B x N) // M calls of M // N groups
            groups, rec = rank0.fetch(s, call)
            s.train(groups, rec)  # forward/backward, optimizer step
        s.stop_here()  # SIGTERM or SIGINT on any rank: this step is checkpointed, then the loop ends
        s.memory_to_servers()
        rank0.pause(s)  # fully async: the pause; the step's buffer and rollout metrics
        if s.save:
            s.checkpoint(rank0)
        s.sync_weights()
        rank0.resume(s)
        rank0.log(s)
        if s.stop:
            break


# ---------------------------------------------------------------------------------------------------------------
# main: every rank
# ---------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def bad_input_exits(rank: int):
    """A bad input in the block (ValueError, FileNotFoundError): its one line, also torchrun's root cause, and exit
    code 2."""
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        # Every rank reads the config; one line for the run, not one per rank. Rank 0 prints it and exits 2 first:
        # a rank that exited first would have torchrun stop rank 0 before its line was out (seen under load).
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
            preemption.report_to_torchrun(str(e))
        else:
            time.sleep(RANK0_EXIT_WAIT_S)  # torchrun stops this rank once rank 0 has exited
        sys.exit(2)


def print_notes(cfg, rank: int) -> None:
    """Rank 0: the off-policy warning (losses.offpolicy_warning) and, fully async, how the window strategy and the
    policy loss pair (strategies.pairing_note)."""
    warning = losses.offpolicy_warning(cfg)
    if warning and rank == 0:
        print(warning, file=sys.stderr, flush=True)
    pairing = strategies.pairing_note(cfg.fully_async.sliding_window, cfg.algorithm.policy_loss,
                                      cfg.rollout.mask_offpolicy_in_partial_rollout)
    if pairing and cfg.fully_async.enable and rank == 0:
        print(f"[train] {pairing}", flush=True)


class Run:
    """This rank's run: one method per start-up step, which main calls in order, and close; what a step starts
    (process group, servers, actor, buffer and rollout, logger) stays here for the steps after it."""

    def __init__(self, cfg, claim, world: int, rank: int):
        r = cfg.rollout
        self.cfg, self.claim, self.world, self.rank = cfg, claim, world, rank
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.launched = cfg.run_mode != "train-only" and not r.servers and not r.router_url and r.launch != "none"
        self.colocated = cfg.colocate and cfg.run_mode == "default"
        self.device = self.ctrl = self.resume_path = self.run_id = self.run_state = None
        self.services = self.fleet = self.actor = self.logger = self.buf = self.ro = self.evaluate = None
        self.start_step = 0

    def init_process_group(self) -> None:
        """gloo on CPU, nccl on GPU; a gloo control group (ctrl) for Python objects and long waits; the seeds."""
        cfg, rank = self.cfg, self.rank
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda", self.local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(self.device)
        if "MASTER_ADDR" not in os.environ:  # plain `python train.py`: a one-process group
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(services_lib.free_port()), RANK="0",
                              WORLD_SIZE="1")
        # trainer.cpu_offload on cuda: the offloaded shards' collectives (loading, gradient-norm reduction) are on CPU
        # tensors, which take gloo next to nccl (as torchtitan does)
        backend = ("cuda:nccl,cpu:gloo" if cfg.trainer.cpu_offload else "nccl") if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=cfg.weight_sync.timeout_s)
        store = services_lib.attempt_store(cfg.weight_sync.timeout_s)  # torchrun: this attempt's keys (its doc: why)
        dist.init_process_group(backend, timeout=timeout, **({"store": store, "rank": rank, "world_size": self.world}
                                                             if store is not None else {}))
        # The control group's timeout covers rank 0's longest wait between two collectives (data, pause, server
        # start-up), which the other ranks spend in it.
        self.ctrl = dist.new_group(backend="gloo",
                                   timeout=datetime.timedelta(seconds=config_lib.control_timeout_s(cfg)))
        torch.manual_seed(cfg.seed + rank)
        random.seed(cfg.seed + rank)

    def make_run_dir(self) -> None:
        """run_dir, and model.make_tiny's model (rank 0 makes it), before any rank goes on."""
        cfg = self.cfg
        os.makedirs(cfg.run_dir, exist_ok=True)
        if self.rank == 0 and cfg.model.make_tiny and not os.path.isdir(cfg.model.path):
            from standins import tiny_model

            print(f"[train] making the tiny model at {cfg.model.path} ({cfg.model.tiny_pretrain_steps} pretraining "
                  "steps)", flush=True)
            tiny_model.make_tiny_for(cfg)
        dist.barrier(group=self.ctrl)

    def agree_on_resume(self) -> None:
        """The checkpoint to resume and the run's id, on every rank: rank 0's claim on run_dir decided them."""
        box = [(self.claim.resume, self.claim.run_id) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        self.resume_path, self.run_id = box[0]

    def start_servers(self) -> None:
        """Colocate: the servers start first and release their memory before the model loads; otherwise rank 0's
        start now and the model loads during their start-up (minutes for SGLang at scale); start_workers waits for
        them. They are labelled with the version they first serve."""
        cfg, rank, launched, colocated = self.cfg, self.rank, self.launched, self.colocated
        starts_servers = rank == 0 and (launched or colocated)
        resume_path = self.resume_path if starts_servers else None
        first_version = checkpoint.load_run_state(resume_path)["step"] if resume_path else 0
        if rank == 0 and launched and not colocated:
            self.services = Services(cfg)
            self.services.launch_servers(first_version, 0, wait=False)
        if colocated:
            if rank == 0:
                self.services = Services(cfg)
                self.fleet = self.services.start_fleet(first_version, launched)
                self.fleet.release_memory()
            else:
                self.services = services_lib.for_node(cfg, self.local_rank, launched)
            dist.barrier(group=self.ctrl)  # the other ranks load the model once the servers have let go of the GPUs

    def load_model(self) -> None:
        """The policy, FSDP2-sharded, its AdamW and the Actor (run_mode=rollout-only trains nothing: none)."""
        cfg, rank, device = self.cfg, self.rank, self.device
        if cfg.run_mode == "rollout-only":
            return
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (self.world,))
        model, _ = model_lib.load_model(cfg, mesh, device, rank, self.ctrl)
        if rank == 0:
            print(memory_report(cfg, model, self.world, device, cfg.trainer.entropy_metric), flush=True)
        opt, sched = model_lib.build_optimizer(model, cfg.trainer, optimizer_impl(cfg, device.type),
                                                  cfg.trainer.total_steps * cfg.calls_per_step)
        self.actor = Actor(cfg, model, opt, sched, device, self.ctrl)
        self.actor.run_id = self.run_id
        self.actor.colocate.released = self.colocated

    def start_node_servers(self) -> None:
        """The other ranks: their node's servers, if it has any (colocate started them before the model)."""
        if self.rank != 0 and self.services is None:
            self.services = services_lib.for_node(self.cfg, self.local_rank, self.launched)

    def resume(self) -> None:
        """A resumed run: model, optimizer, RNG on every rank; the run state (step, buffer)."""
        lease.beat()
        if self.resume_path:
            self.run_state = (self.actor.load_checkpoint(self.resume_path) if self.actor
                              else checkpoint.load_run_state(self.resume_path))
            if self.rank == 0:
                print(f"[train] resumed from {self.resume_path} at step {self.run_state['step']}", flush=True)
        self.start_step = self.run_state["step"] if self.run_state else 0

    def start_workers(self) -> None:
        """Rank 0: the logger; the servers' fleet, the buffer and rollout processes with their RPC and the evaluator
        (run_mode=train-only: the saved rollouts, no rollout); a resumed run's buffer state."""
        if self.rank != 0:
            return
        from transformers import AutoTokenizer

        cfg, start = self.cfg, self.start_step
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        # a fresh run never trims; a resumed one drops its own lines after the step it resumes (-1: all)
        self.logger = Logger(cfg, keep_until=None if self.claim.fresh else start if self.run_state else -1,
                             tokenizer=tokenizer)
        if cfg.run_mode == "train-only":
            self.buf = ReplayBuffer(cfg.trainer.rollout_dir or os.path.join(cfg.run_dir, "rollouts"))
            self.ro = NoRollout()
        else:
            waiting = self.fleet is None
            if waiting:  # the URLs now; /health while the RPC workers start (start_workers)
                self.services = self.services or Services(cfg)
                self.fleet = self.services.start_fleet(start, self.launched, wait=False)
            self.buf, self.ro = self.services.start_workers(start, self.launched, wait_servers=waiting)
            if self.actor is None:
                self.actor = RolloutRecorder(cfg, self.fleet)
                self.actor.run_id = self.run_id
            else:
                self.actor.fleet, self.actor.services = self.fleet, self.services
            self.evaluate = make_evaluator(cfg, self.fleet, tokenizer) if cfg.trainer.eval_freq else None
        if self.run_state:
            self.buf.load_state_dict(self.run_state["buffer"])

    def serve_first_weights(self) -> None:
        """The servers serve the trainer's weights (a resumed run's, or model.path's) as version start_step."""
        lease.beat()
        t0 = time.perf_counter()
        actor, start = self.actor, self.start_step
        if isinstance(actor, Actor) and actor.colocate.released:
            actor.memory_to_servers()
        actor.sync_weights(start)
        if self.rank == 0:
            self.buf.set_weight_version(start)
            print(f"[train] weights version {start} on the servers ({time.perf_counter() - t0:.1f} s)", flush=True)
            if self.evaluate is not None and start == 0:
                self.logger.log(0, self.evaluate(0))

    def health(self) -> Optional[Callable[[], dict]]:
        """Rank 0's servers' /health, for run_steps' waiting line (None without servers and on other ranks)."""
        return self.services.fleet.health if self.rank == 0 and self.services and self.services.fleet else None

    def print_weight_versions(self) -> None:
        if self.rank == 0 and self.services is not None and self.services.fleet is not None:
            fleet = self.services.fleet
            print(f"[train] weight versions on the servers at the end: "
                  f"{dict(zip(fleet.workers(), fleet.weight_versions()))}", flush=True)

    def export_hf(self) -> None:
        """trainer.export_hf: the final weights as an HF checkpoint in run_dir/hf (not after a SIGTERM's stop)."""
        if self.cfg.trainer.export_hf and isinstance(self.actor, Actor) and not preemption.stopped():
            lease.beat()
            self.actor.export_hf(os.path.join(self.cfg.run_dir, "hf"))
            if self.rank == 0:
                print(f"[train] exported {os.path.join(self.cfg.run_dir, 'hf')}", flush=True)

    def close(self, ok: bool, keep_servers: bool) -> None:
        """The logger, the services (keep_servers: for rollout.server_keepalive_s), the process group, run_dir."""
        if self.logger is not None:
            self.logger.close()
        if self.services is not None:
            self.services.close(ok, keep_servers=keep_servers)
        if ok:
            with contextlib.suppress(Exception):
                # Every rank tears its gloo groups down together: a rank that destroys them while a peer still
                # has them open can abort at exit ("terminate called without an active exception").
                dist.barrier(group=self.ctrl)
                dist.destroy_process_group()
        if self.claim is not None:
            self.claim.release()  # (the process ends next; a caller of main() in-process gets run_dir back)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plot":  # `python train.py plot RUN_DIR`: the same as `python plot.py RUN_DIR`
        import plot

        return plot.plot_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny.yaml")
    args, overrides = parser.parse_known_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    claim = None
    with bad_input_exits(rank):  # every start-up check before anything starts; errors are one sentence
        cfg = config_lib.load_config(args.config, overrides)
        checks.check_launch(cfg, world)
        if rank == 0:
            checks.check_inputs(cfg)
            # run_dir's lock, held until this process ends, before anything is written there; a fresh run or
            # which checkpoint of which run resumes (rundir.py: one run per run directory)
            claim = rundir.claim(cfg)
    print_notes(cfg, rank)
    run = Run(cfg, claim, world, rank)
    run.init_process_group()
    run.make_run_dir()
    services_lib.share_key(cfg, rank, run.local_rank, run.ctrl)  # launched servers on several nodes: one key for all

    ok, crashed, failed = False, False, 0
    try:
        run.agree_on_resume()
        run.start_servers()
        if cfg.run_mode == "rollout-only" and rank != 0:
            return  # rollout-only trains nothing: rank 0 alone records
        run.load_model()
        run.start_node_servers()
        run.resume()
        run.start_workers()
        run.serve_first_weights()
        with preemption.steps():  # SIGTERM or SIGINT in it: the next step boundary checkpoints and ends the run
            run_steps(cfg, run.actor, run.buf, run.ro, run.logger, run.start_step, run.evaluate, run.health())
        run.print_weight_versions()
        run.export_hf()
        # every rank leaves together: another node's servers (its local rank 0 supervises them) stay up until now
        dist.barrier(group=run.ctrl)
        ok = True
    except Exception as e:
        crashed = True
        failed = services_lib.failure_exit_code(e, run.services, rank)  # prints the root cause; raises what it cannot
        if failed == 2 and rank == 0:  # buffer.NothingToTrain: its sentence
            preemption.report_to_torchrun(str(e))
    finally:
        run.close(ok, keep_servers=crashed and failed != 2)  # a crashed run's servers wait for a restart
    if preemption.stopped() and rank == 0:
        print(preemption.continue_line(), flush=True)
    if failed:
        sys.exit(failed)


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a crash in native code (SIGSEGV, SIGABRT) prints every thread's stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    preemption.install()  # SIGTERM, Ctrl-C: checkpoint at the next step boundary and exit 0 (docs/faults.md)
    try:
        record(main)()  # an exception main does not explain: its traceback is torchrun's root cause
        code = 0
    except SystemExit as e:  # main's own exits: 2 for bad input or a run that cannot train, 1 for a failed run
        if not isinstance(e.code, (int, type(None))):
            raise
        code = e.code or 0
    services_lib.exit_process(code)
