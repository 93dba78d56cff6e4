"""train.py: the RL trainer, one SPMD program: every trainer rank runs the same `main()` and the same step loop.

main: config and start-up checks (checks.py) -> rank 0 claims run_dir (rundir.py: its lock for the process's life; a
fresh run, or the checkpoint of this run to resume) -> distributed init (gloo on CPU, nccl on GPU; a gloo control group)
-> the policy, FSDP2-sharded, and AdamW (model.py; actor.py drives them) -> rank 0 starts the inference servers
(standins/engine.py on CPU, SGLang on GPUs, or connects to rollout.servers / rollout.router_url), the buffer process
and the rollout process (services.py) -> resume (checkpoint.py) -> run_steps, the step loop (docs/design.md):
fetch -> forward/backward and optimizer step, (B x N) // M times -> pause -> checkpoint every trainer.save_freq ->
weight sync (weight_sync.py) -> resume the producer. Rank 0 alone talks to the buffer, the rollout and the servers,
and logs, each under `if rank == 0`; the other ranks get their share by a collective. The model side of the loop:
actor.py. Colocate: colocate.py.
run_mode=rollout-only / train-only and the greedy evaluator: run_modes.py; logging: logger.py; plots: plot.py.
Faults (docs/faults.md): a launched server that dies is relaunched and gets the weights at the next sync; any other
child that dies stops the run with its report as the one error line; bad inputs are refused before anything starts
(exit code 2), as is a run that cannot train (buffer.NothingToTrain); SIGTERM (a preemption) checkpoints the next step
boundary and exits 0 (preemption.py). Under torchrun --max-restarts with trainer.resume=auto a restarted attempt
resumes from the checkpoint and reuses the servers the crashed one left.

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
    rollout:  start(), pause(checkpoint) -> dict, resume(version), step_metrics() -> dict (rollout.Rollout or its
              remote.Proxy).
    logger:   log(step, metrics: dict); metrics hold numbers plus "data/prompt_ids" ([[epoch, data_index], ...]
              in training order) and "data/samples" (logger.train_samples: records of trained trajectories);
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
        lease.beat()  # each phase below beats as it starts: the servers' lease is renewed while the loop goes on
        t_step = time.perf_counter()
        m: dict = {}
        records: list[dict] = []  # one per training call, aggregated by the spec's naming rule
        prompt_ids, samples = [], []
        done = step + 1
        save = bool(cfg.trainer.save_freq and done % cfg.trainer.save_freq == 0) or done == total  # checkpoint due

        # ---- synchronous mode: the whole batch first, then the producer stops (colocate: servers release) ----
        batch = None
        if sync_mode:
            if rank == 0:
                t0 = time.perf_counter()
                batch = fetch(cfg, buffer, cfg.B, done, logger, servers)
                m["timing/rollout"] = time.perf_counter() - t0
                m.update(rollout.pause(save))
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
                samples += train_samples(groups, cfg.logging.train_samples, len(samples))
            lease.beat()
            t0 = time.perf_counter()
            out = actor.train_minibatch(groups, step) or {}
            rec["timing/train"] = time.perf_counter() - t0 - out.get("timing/process_traj", 0.0)
            records.append({**out, **rec})
        m.update(aggregate(records))
        stop = preemption.stop_here(getattr(actor, "ctrl", None), done, total)  # SIGTERM on a rank: save, then stop
        save = save or stop

        # ---- pause: the producer stops at the step boundary (colocate: the servers take their weights back) ----
        lease.beat()
        if rank == 0 and not sync_mode:  # before a checkpoint every request comes back, to be in it
            m.update(rollout.pause(save))
        if sync_mode and cfg.colocate:
            m.update(actor.memory_to_servers() or {})
        if rank == 0:
            m.update(buffer.step_metrics())
            m.update({k: v for k, v in rollout.step_metrics().items() if k not in m})

        # ---- checkpoint (buffer state taken while paused: unconsumed, in-flight and restored groups are in it) ----
        if save:
            lease.beat()
            t0 = time.perf_counter()
            run_state = {"step": done, "weight_version": done, "buffer": buffer.state_dict()} if rank == 0 else None
            actor.save_checkpoint(done, run_state)
            m["timing/save_ckpt"] = time.perf_counter() - t0

        # ---- weight sync (servers flush their cache unless in_place, serve version step + 1) ----
        lease.beat()
        t0 = time.perf_counter()
        out = {} if stop else dict(actor.sync_weights(done) or {})
        m["timing/update_weights"] = out.pop("timing/update_weights", time.perf_counter() - t0)
        m.update(out)

        # ---- resume the producer; log (wait is everything outside the training block: perf/wait_ratio) ----
        if rank != 0:
            if stop:
                break
            continue
        buffer.set_weight_version(done)
        if done < total and not stop:
            rollout.resume(done)
        m["timing/step"] = time.perf_counter() - t_step
        m["perf/wait_ratio"] = min(1.0, max(0.0, 1.0 - m.get("timing/train", 0.0) / max(m["timing/step"], 1e-9)))
        if evaluate is not None and ((cfg.trainer.eval_freq and done % cfg.trainer.eval_freq == 0) or done == total):
            lease.beat()  # the evaluator beats as its trajectories finish (run_modes.generate_dataset)
            m.update(evaluate(done) if not stop else {})
        m["data/prompt_ids"], m["data/samples"] = prompt_ids, samples
        logger.log(done, m)
        if stop:
            break


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
    claim = None
    try:
        cfg = config_lib.load_config(args.config, overrides)
        checks.check_launch(cfg, world)
        if rank == 0:
            checks.check_inputs(cfg)
            # run_dir's lock, held until this process ends, before anything is written there; a fresh run or
            # which checkpoint of which run resumes (rundir.py: one run per run directory)
            claim = rundir.claim(cfg)
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
    timeout = datetime.timedelta(seconds=cfg.weight_sync.timeout_s)
    store = services_lib.attempt_store(cfg.weight_sync.timeout_s)  # torchrun: this attempt's keys (its doc says why)
    dist.init_process_group(backend, timeout=timeout, **({"store": store, "rank": rank, "world_size": world}
                                                         if store is not None else {}))
    # The control group's timeout covers rank 0's longest wait between two collectives (data, pause, server
    # start-up), which the other ranks spend in it.
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=config_lib.control_timeout_s(cfg)))
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    os.makedirs(cfg.run_dir, exist_ok=True)
    if rank == 0 and cfg.model.make_tiny and not os.path.isdir(cfg.model.path):
        from standins import tiny_model

        print(f"[train] making the tiny model at {cfg.model.path} ({cfg.model.tiny_pretrain_steps} pretraining "
              "steps)", flush=True)
        tiny_model.make_tiny_for(cfg)
    dist.barrier(group=ctrl)
    services_lib.share_key(cfg, rank, local_rank, ctrl)  # launched servers on several nodes: one key for all

    services, ok, failed, crashed, actor, logger, fleet = None, False, 0, False, None, None, None
    buf = ro = evaluate = None
    launched = cfg.run_mode != "train-only" and not r.servers and not r.router_url and r.launch != "none"
    try:
        # ---- the checkpoint to resume and the run's id: rank 0's claim on run_dir decided them ----
        box = [(claim.resume, claim.run_id) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        resume_path, run_id = box[0]

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
            actor.run_id = run_id
            actor.colocate.released = colocated
        if rank != 0 and services is None:  # (colocate started them before the model loaded)
            services = services_lib.for_node(cfg, local_rank, launched)

        # ---- resume: model, optimizer, RNG on every rank; run state (step, buffer) ----
        lease.beat()
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
            # a fresh run never trims; a resumed one drops its own lines after the step it resumes (-1: all)
            logger = Logger(cfg, keep_until=None if claim.fresh else start_step if run_state else -1,
                            tokenizer=tokenizer)
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
                    actor.run_id = run_id
                else:
                    actor.fleet, actor.services = fleet, services
                evaluate = make_evaluator(cfg, fleet, tokenizer) if cfg.trainer.eval_freq else None
            if run_state:
                buf.load_state_dict(run_state["buffer"])

        # ---- the servers serve the trainer's weights (a resumed run's, or model.path's) as version start_step ----
        lease.beat()
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
        with preemption.steps():  # SIGTERM in it: the next step boundary checkpoints and ends the run
            run_steps(cfg, actor, buf, ro, logger, start_step, evaluate, servers=health)
        if rank == 0 and services is not None and services.fleet is not None:
            print(f"[train] weight versions on the servers at the end: "
                  f"{dict(zip(services.fleet.workers(), services.fleet.weight_versions()))}", flush=True)

        # ---- final HF export ----
        if cfg.trainer.export_hf and isinstance(actor, Actor) and not preemption.stopped():
            lease.beat()
            actor.export_hf(os.path.join(cfg.run_dir, "hf"))
            if rank == 0:
                print(f"[train] exported {os.path.join(cfg.run_dir, 'hf')}", flush=True)
        # every rank leaves together: another node's servers (its local rank 0 supervises them) stay up until now
        dist.barrier(group=ctrl)
        ok = True
    except Exception as e:
        crashed = True
        failed = services_lib.failure_exit_code(e, services, rank)  # prints the root cause; raises what it cannot
    finally:
        if logger is not None:
            logger.close()
        if services is not None:  # a crashed run's servers wait for a restart (rollout.server_keepalive_s)
            services.close(ok, keep_servers=crashed and failed != 2)
        if ok:
            with contextlib.suppress(Exception):
                # Every rank tears its gloo groups down together: a rank that destroys them while a peer still
                # has them open can abort at exit ("terminate called without an active exception").
                dist.barrier(group=ctrl)
                dist.destroy_process_group()
        if claim is not None:
            claim.release()  # (the process ends next; a caller of main() in-process gets run_dir back)
    if failed:
        sys.exit(failed)


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a crash in native code (SIGSEGV, SIGABRT) prints every thread's stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    preemption.install()  # SIGTERM: checkpoint at the next step boundary and exit 0 (docs/faults.md)
    try:
        main()
        code = 0
    except SystemExit as e:  # main's own exits: 2 for bad input or a run that cannot train, 1 for a failed run
        if not isinstance(e.code, (int, type(None))):
            raise
        code = e.code or 0
    services_lib.exit_process(code)
