"""run_modes.py: what train.py's step loop runs with besides the trainer and the rollout: run_mode=rollout-only
(RolloutRecorder: the groups saved, no training), run_mode=train-only (ReplayBuffer of those groups, NoRollout),
and the greedy evaluator (make_evaluator: eval/* through the servers every trainer.eval_freq steps; a prompt that
failed is counted, not scored), which generates with generate_dataset (a rollout.Rollout over a DatasetBuffer of
fixed prompts; also workers.py generate)."""
from __future__ import annotations

import contextlib
import copy
import glob
import logging
import os
import shutil
import sys
import threading
import time
from collections import deque
from typing import Callable, Optional

import torch

import buffer as buffer_lib
import checkpoint
import staleness
from buffer import FAILED, Exchange, PromptGroup, Trajectory
from logger import sample_records


class RolloutRecorder:
    """run_mode=rollout-only: no training; each call's groups are saved to run_dir/rollouts/ (for train-only) and
    the servers' version label still advances every step, so staleness reads as it would when training."""

    def __init__(self, cfg, fleet):
        self.cfg, self.fleet = cfg, fleet
        self.dir = os.path.join(cfg.run_dir, "rollouts")
        os.makedirs(self.dir, exist_ok=True)
        self.calls: dict = {}
        self.run_id = None  # the run's id (rundir.claim): in every checkpoint's run_state

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
        checkpoint.commit(path + ".tmp", path, {**run_state, "run_id": self.run_id, "scheduler": {},
                                                    "rng": [checkpoint.rng_state()]})
        checkpoint.prune(os.path.dirname(path), self.cfg.trainer.keep_checkpoints, path)

    def memory_to_trainer(self):
        return {}

    def memory_to_servers(self):
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

    def pause(self, checkpoint=False):
        return {}

    def resume(self, version):
        pass

    def step_metrics(self):
        return {}

    def stop(self):
        pass


# ---------------------------------------------------------------------------------------------------------------
# Generation of a fixed list of prompts through the producer, against running servers (the evaluator, workers.py
# generate)
# ---------------------------------------------------------------------------------------------------------------

class DatasetBuffer(Exchange):
    """The buffer interface over a fixed list of prompts: each dispatched once, trajectories collected by group."""

    def __init__(self, prompts: list[dict], n: int):
        self.n = n
        self.pending = deque(PromptGroup(0, i, i, torch.tensor(p["prompt_ids"], dtype=torch.long), p["label"],
                                         0, p.get("metadata", {})) for i, p in enumerate(prompts))
        self.prompts = {g.seq: g for g in self.pending}
        self.results: dict[int, list[Trajectory]] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        if not self.pending:
            self.done.set()

    def dispatch(self, max_groups: Optional[int] = None, timeout: float = 0.0) -> list[PromptGroup]:
        if not self.pending:
            time.sleep(timeout)  # as PipelineServer.dispatch: nothing to hand out, wait instead of spinning
        with self.lock:
            k = len(self.pending) if max_groups is None else min(max_groups, len(self.pending))
            return [self.pending.popleft() for _ in range(k)]

    def put(self, trajs: list[Trajectory]) -> None:
        with self.lock:
            for t in trajs:
                self.results.setdefault(t.seq, []).append(t)
            if sum(len(v) for v in self.results.values()) == self.n * len(self.prompts):
                self.done.set()

    def boundary_aborts(self, kind: str) -> list:
        return []

    def step_boundary(self, returned: list[Trajectory], kind: str = staleness.Boundary.ABORT) -> dict:
        return {}

    def set_max_concurrent_samples(self, value: int) -> None:
        """Nothing to do: the producer's own free-slot count already bounds what is dispatched from here."""


def generate_dataset(cfg, prompts: list[dict], sync, tokenizer, progress_timeout_s: float
                     ) -> tuple[DatasetBuffer, dict]:
    """Generate and score N trajectories for every prompt with a rollout.Rollout against `sync` (a
    sglang_client.SyncFleet); returns the filled DatasetBuffer and a summary dict (its reward_mean and pass_rate over
    the trajectories that did not fail, null when all did; `failed` counts those). Unset
    rollout.async_max_concurrent_samples means the fleet's concurrency here (there is no capacity C)."""
    import lease
    from rollout import Rollout

    if cfg.rollout.async_max_concurrent_samples is None:
        cfg.rollout.async_max_concurrent_samples = sync.concurrency()
    buf = DatasetBuffer(prompts, cfg.N)
    rollout = Rollout(cfg, buf, sync, tokenizer)
    t0 = time.monotonic()
    rollout.start()
    finished = -1
    try:
        lease.beat(progress_timeout_s)  # the servers' lease (the evaluator): progress is a trajectory finishing
        while not buf.done.wait(progress_timeout_s):
            now = sum(len(v) for v in buf.results.values())
            if now == finished:
                raise TimeoutError(f"no trajectory finished in {progress_timeout_s} s ({now} of "
                                   f"{cfg.N * len(prompts)} done); are the servers in rollout.servers alive?")
            finished = now
            lease.beat(progress_timeout_s)
        metrics = rollout.step_metrics()
    finally:
        rollout.stop()
    trajs = [t for v in buf.results.values() for t in v]
    scored = [t for t in trajs if t.status != FAILED]
    wall = time.monotonic() - t0
    summary = {"prompts": len(prompts), "trajectories": len(trajs), "wall_s": round(wall, 3),
               "reward_mean": metrics["rollout/reward_mean"] if scored else None,  # over those not failed
               "pass_rate": sum(t.reward >= 1.0 for t in scored) / len(scored) if scored else None,
               "truncation_ratio": metrics["rollout/truncation_ratio"],
               "failed": metrics["rollout/failed_count"],
               "response_length_mean": metrics["rollout/response_length_mean"],
               "generated_tokens_per_s": sum(len(t.response_ids) for t in trajs) / max(wall, 1e-9),
               "max_concurrent_samples": rollout.max_samples}
    return buf, summary


# ---------------------------------------------------------------------------------------------------------------
# Evaluation: greedy, on the held-out split, through the servers (the rollout function, so multi-turn works too)
# ---------------------------------------------------------------------------------------------------------------

def make_evaluator(cfg, fleet, tokenizer) -> Callable[[int], dict]:
    """evaluate(steps_done) -> eval/failed_count, eval/reward_mean and eval/exact_ratio (reward >= 1) over the prompts
    that did not fail (absent when all failed), timing/eval and data/eval_samples (every response, for
    samples/step_NNNNNN.jsonl; a failed one's reward null): greedy, one response per held-out prompt. A prompt whose
    reward, environment or rollout function raised (or that timed out) is not scored: one line (eval_failures_line)
    says how many and names the first error, and the eval's log, run_dir/logs/eval.log, holds the first traceback of
    each distinct failure (Rollout.log_traceback)."""
    import tasks
    from buffer import Group

    ecfg = copy.deepcopy(cfg)
    ecfg.data_source = [copy.deepcopy(cfg.data_source[0])]
    ecfg.data_source[0].num_trajectories_per_prompt = 1
    ecfg.rollout.sampling.temperature = 0.0  # greedy (below logprobs.GREEDY_TEMPERATURE)
    ecfg.rollout.partial = False
    ecfg.rollout.async_max_concurrent_samples = None
    prompts = tasks.load_prompts(ecfg.data_source[0], tokenizer, "eval", cfg.rollout.max_prompt_tokens)
    log_path = os.path.join(cfg.run_dir, "logs", "eval.log")

    def evaluate(steps_done: int) -> dict:
        t0 = time.perf_counter()
        fleet.continue_()  # the last step's pause (rollout.partial) leaves the servers paused: eval would wait
        with _rollout_log_to(log_path):
            buf, summary = generate_dataset(ecfg, prompts, fleet, tokenizer, cfg.rollout.trajectory_timeout_s + 60.0)
        groups = [Group(buf.prompts[seq], trajs) for seq, trajs in sorted(buf.results.items())]
        trajs = [t for g in groups for t in g.trajectories]
        failed = [t for t in trajs if t.status == FAILED]
        rewards = [t.reward for t in trajs if t.status != FAILED]
        samples = [{**r, "reward": None} if r["status"] == FAILED else r for r in sample_records(groups)]
        out = {"eval/failed_count": len(failed), "timing/eval": time.perf_counter() - t0,
               "data/eval_samples": samples}
        if rewards:
            out.update({"eval/reward_mean": sum(rewards) / len(rewards),
                        "eval/exact_ratio": sum(r >= 1.0 for r in rewards) / len(rewards)})
        if failed:
            print(eval_failures_line(steps_done, len(trajs), failed, log_path), file=sys.stderr, flush=True)
        return out
    return evaluate


def eval_failures_line(steps_done: int, total: int, failed: list, log_path: str) -> str:
    """The evaluator's one line when prompts failed: how many of how many, whether a score remains, the first
    failure's error (it names the file and line that raised) and the log with the tracebacks."""
    n = len(failed)
    head = (f"all {total} eval prompts failed, so there is no eval score" if n == total else
            f"{n} of {total} eval prompts failed and are not scored (eval/failed_count; eval/reward_mean is over "
            f"the other {total - n})")
    error = failed[0].metadata.get("error", "no reason recorded")
    return (f"[train] step {steps_done}: {head}; the first: {error}; the first traceback of each distinct failure "
            f"is in {log_path}")


@contextlib.contextmanager
def _rollout_log_to(path: str):
    """The `rollout` logger (the evaluator's Rollout and its environment steps) writes to `path` in the block (in the
    trainer, whose logging sets up no other handler, only there: not on the terminal)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("rollout")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
