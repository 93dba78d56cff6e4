"""rundir.py: one run per run directory. Trainer rank 0 calls `claim` before anything in run_dir is written:

- the lock: run_dir/run.lock, flock'ed for the life of rank 0's process (the kernel lets go when it ends, however it
  ends; launched children exec and do not inherit it), its holder (pid, host, run id) written in it. A second run in
  the same run_dir stops in one sentence naming the holder. A filesystem that refuses flock gets a warning instead.
- the run id: run_dir/run.json, made at a fresh start, kept across resumes, in every checkpoint's run_state; a resume
  refuses a checkpoint of another run. A checkpoint without one (written before run ids) resumes as the directory's.
- a fresh start (trainer.resume=none, or auto with no checkpoint and no run recorded) refuses a run_dir holding
  another run's results (checkpoints, metrics, samples, saved rollouts, an HF export) unless trainer.overwrite=true,
  which moves them, with that run's config, logs and run.json, into run_dir/old-<time>/: nothing is deleted.
- trainer.resume=auto resumes the newest checkpoint that loads (newer ones that do not are named in a warning each)
  and stops, naming each and why, when checkpoints exist and none loads: it never starts again from step 0 over them.
"""
from __future__ import annotations

import dataclasses
import fcntl
import glob
import json
import os
import socket
import sys
import time
from typing import Optional

import checkpoint
import lease

LOCK, RECORD = "run.lock", "run.json"
# what a run leaves in run_dir: RESULTS refuse a fresh start; trainer.overwrite moves these and the rest of MOVED aside
RESULTS = ("checkpoints", "metrics.jsonl", "waiting.jsonl", "samples", "rollouts", "hf")
MOVED = RESULTS + ("config.yaml", "logs", "metrics.png", "sync_weights", "wandb", RECORD)
LOCK_WAIT_S = 10.0  # a holder that is exiting (gone or a zombie by its record, or none recorded) lets go within this


class RunDirError(ValueError):
    """run_dir cannot be this run's: its one sentence is the run's error line (train.py exits 2)."""


@dataclasses.dataclass
class Claim:
    run_id: str
    resume: Optional[str]  # the checkpoint directory to resume, or None
    fresh: bool  # a new run: nothing of run_dir's may be trimmed (logger.Logger keep_until None)
    fd: Optional[int]  # run.lock, held until release() or the process ends

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"


def claim(cfg) -> Claim:
    """Rank 0, before anything in cfg.run_dir is written: take its lock and decide what this start is (a fresh run,
    or which checkpoint of which run resumes); raises RunDirError (the lock let go) when it cannot be this run's."""
    run_dir = cfg.run_dir
    os.makedirs(run_dir, exist_ok=True)
    fd = lock(run_dir)
    try:
        record = read_json(os.path.join(run_dir, RECORD))
        dir_id = record.get("run_id") if isinstance(record, dict) else None
        resume, path = cfg.trainer.resume, None
        if resume == "auto":
            path = resume_auto(run_dir, shards=cfg.run_mode != "rollout-only")
        elif resume != "none":
            path = resume
        fresh = path is None and (resume == "none" or dir_id is None)
        # this run's inputs, never results: a model, or the saved groups run_mode=train-only trains on
        inputs = (cfg.model.path, cfg.trainer.rollout_dir or (os.path.join(run_dir, "rollouts")
                                                             if cfg.run_mode == "train-only" else None))
        if fresh:
            found = results(run_dir, skip=inputs)
            if found and cfg.run_mode == "train-only" and not cfg.trainer.rollout_dir:
                raise RunDirError(f"run_dir {run_dir} holds another run's results ({describe(dir_id, found)}); "
                                  "run_mode=train-only trains in a run_dir of its own on a rollout-only run's groups: "
                                  f"give run_dir=<new directory> trainer.rollout_dir={run_dir}/rollouts")
            if found and not cfg.trainer.overwrite:
                steps = checkpoint.steps_of(os.path.join(run_dir, "checkpoints"))
                more = (f" with a trainer.total_steps above {steps[-1][0]}"
                        if steps and steps[-1][0] >= cfg.trainer.total_steps else "")
                raise RunDirError(f"run_dir {run_dir} holds another run's results ({describe(dir_id, found)}); add "
                                  f"trainer.resume=auto{more} to continue it, or trainer.overwrite=true to start "
                                  f"over (its files are moved into {run_dir}/old-<time>/, nothing is deleted), or "
                                  "give another run_dir")
            if found:
                moved_to, names = move_aside(run_dir, keep=inputs)
                print(f"[train] trainer.overwrite=true: the results of the run before ({describe(dir_id, found)}) "
                      f"moved into {moved_to}/: {', '.join(names)}", flush=True)
            run_id = new_run_id()
        else:
            run_id = resumed_run_id(run_dir, dir_id, path)
        if run_id != dir_id:
            lease.write_record(os.path.join(run_dir, RECORD), {"run_id": run_id, "created": time.time()})
        _write_holder(fd, run_id)
        return Claim(run_id, path, fresh, fd)
    except BaseException:
        os.close(fd)
        raise


def resume_auto(run_dir: str, shards: bool) -> Optional[str]:
    """trainer.resume=auto: the newest checkpoint that loads (a warning naming each newer one that does not), None
    when there is none; RunDirError when there are checkpoints and none loads."""
    path, skipped = checkpoint.newest_loading(run_dir, shards)
    if path is None and skipped:
        why = "; ".join(f"{os.path.basename(p)}: {problem}" for p, problem in skipped)
        raise RunDirError(f"trainer.resume=auto found {len(skipped)} checkpoint(s) in {run_dir}/checkpoints and none "
                          f"loads ({why}), and does not start again from step 0 over them: repair or remove them, "
                          "give trainer.resume a checkpoint directory, or start over with trainer.resume=none "
                          "trainer.overwrite=true (their files are moved aside)")
    for p, problem in skipped:
        print(f"[train] warning: skipping checkpoint {p}: {problem}; trying the previous one", file=sys.stderr,
              flush=True)
    return path


def resumed_run_id(run_dir: str, dir_id: Optional[str], path: Optional[str]) -> str:
    """The run id a resume continues: run_dir's (run.json), which the checkpoint `path` must carry if it carries
    one (one that carries none, from before run ids, must be in run_dir/checkpoints); a checkpoint in a run_dir of
    none gives its own; one of neither gets a new id."""
    ckpt_id = checkpoint.load_run_state(path).get("run_id") if path else None
    if ckpt_id and dir_id and ckpt_id != dir_id:
        raise RunDirError(f"checkpoint {path} is of run {ckpt_id} but run_dir {run_dir} holds run {dir_id} "
                          f"({os.path.join(run_dir, RECORD)}): a run resumes only its own checkpoints; resume it in "
                          f"a run_dir of its own (trainer.resume={path} run_dir=...), or give a checkpoint of run "
                          f"{dir_id}")
    ours = path and os.path.realpath(os.path.dirname(path)) == os.path.realpath(os.path.join(run_dir, "checkpoints"))
    if path and not ckpt_id and dir_id and not ours:
        raise RunDirError(f"checkpoint {path} carries no run id (written before run ids) and is not in run_dir "
                          f"{run_dir}, which holds run {dir_id}: nothing says it is of that run; resume it in a "
                          f"run_dir of its own (trainer.resume={path} run_dir=...)")
    run_id = dir_id or ckpt_id or new_run_id()
    if path and not ckpt_id:
        print(f"[train] {path} carries no run id (written before run ids): resumed as run {run_id}; the checkpoints "
              "from here on carry it", flush=True)
    return run_id


# ---------------------------------------------------------------------------------------------------------------
# The lock

def lock(run_dir: str) -> int:
    """flock run_dir/run.lock (exclusive) and return its fd; RunDirError naming the holder when another process
    holds it. A holder recorded alive on this host (or on another) is refused at once; one recorded gone, or none
    recorded, is waited for LOCK_WAIT_S (it may be exiting: torchrun restarts a crashed attempt)."""
    path = os.path.join(run_dir, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_holder(fd, None)
            return fd
        except BlockingIOError:
            holder = read_json(path)
            if _alive(holder) or time.monotonic() > deadline:
                os.close(fd)
                raise RunDirError(_busy(run_dir, path, holder)) from None
            time.sleep(0.2)
        except OSError as e:  # e.g. ENOLCK, EOPNOTSUPP: a network filesystem without locks
            print(f"[train] warning: {path} cannot be locked ({e.strerror or e}): a second run started in "
                  f"{run_dir} is not refused on this filesystem", file=sys.stderr, flush=True)
            return fd


def _alive(holder) -> bool:
    if not isinstance(holder, dict) or "pid" not in holder:
        return False
    if holder.get("host") != socket.gethostname():
        return True  # another machine's: nothing here can tell
    started = lease.start_time(int(holder["pid"]))
    return started is not None and started == holder.get("start_time")


def _busy(run_dir: str, path: str, holder) -> str:
    who = "another process"
    if isinstance(holder, dict) and "pid" in holder:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0)))
        who = (f"run {holder['run_id']}" if holder.get("run_id") else "a run") + \
            f" (pid {holder['pid']} on {holder.get('host')}, since {since})"
    return (f"run_dir {run_dir} is in use by {who}, which holds its lock {path}; wait for that run to end or stop "
            f"it, or give this run another run_dir (`fuser -v {path}` names the process holding it)")


def _write_holder(fd: int, run_id: Optional[str]) -> None:
    pid = os.getpid()
    data = json.dumps({"pid": pid, "host": socket.gethostname(), "start_time": lease.start_time(pid),
                       "run_id": run_id, "time": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


# ---------------------------------------------------------------------------------------------------------------
# What run_dir holds

def results(run_dir: str, skip=()) -> list[str]:
    """What of a run's results run_dir holds, each in a few words (empty: nothing a fresh start would hide); a path
    in `skip` (this run's inputs) is not one."""
    found, skip = [], [os.path.realpath(p) for p in skip if p]
    steps = [s for s, _ in checkpoint.steps_of(os.path.join(run_dir, "checkpoints"))]
    if steps:
        found.append(f"checkpoints of steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else
                     f"a checkpoint of step {steps[0]}")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    last = _last_step(metrics)
    if last is not None:
        found.append(f"metrics.jsonl to step {last}")
    elif _nonempty(metrics):
        found.append("metrics.jsonl")
    for name, what in (("waiting.jsonl", "waiting.jsonl"), ("samples", "samples/"), ("rollouts", "saved rollouts"),
                       ("hf", "an HF export (hf/)")):
        p = os.path.join(run_dir, name)
        if _nonempty(p) and os.path.realpath(p) not in skip:
            found.append(what)
    return found


def describe(run_id: Optional[str], found: list) -> str:
    return f"run {run_id}: " + ", ".join(found) if run_id else ", ".join(found)


def move_aside(run_dir: str, keep=()) -> tuple[str, list]:
    """Move what a run left in run_dir (MOVED, rollout_*.jsonl) into a new run_dir/old-<time>/: (that directory,
    the names moved). A path in `keep` (model.path, trainer.rollout_dir: inputs of this run) stays, as does what
    holds one of them, and everything else (servers/: lease.py's records of live servers)."""
    dest = os.path.join(run_dir, f"old-{time.strftime('%Y%m%d-%H%M%S')}")
    for n in range(1, 1000):
        if not os.path.exists(dest):
            break
        dest = os.path.join(run_dir, f"old-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
    keep = [os.path.realpath(k) for k in keep if k]
    names = [n for n in (*MOVED, *sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir,
                                                                                            "rollout_*.jsonl"))))
             if os.path.lexists(os.path.join(run_dir, n))]
    moved = []
    os.makedirs(dest)
    for name in names:
        src = os.path.realpath(os.path.join(run_dir, name))
        if any(k == src or k.startswith(src + os.sep) for k in keep):
            continue
        os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
        moved.append(name)
    return dest, moved


def _nonempty(path: str) -> bool:
    if os.path.isdir(path):
        return any(_nonempty(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.isfile(path) and os.path.getsize(path) > 0


def _last_step(path: str) -> Optional[int]:
    """The step of the last whole line of a jsonl file (read from its end), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

