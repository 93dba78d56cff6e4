"""bench/preemption_bench.py: SIGTERM to torchrun on the CPU default (configs/tiny.yaml, 2 ranks), as a scheduler's
preemption notice: seconds from the signal to torchrun's exit, the step the run stopped at and its checkpoint, the
exit code of each trainer rank and of torchrun, then `trainer.resume=auto` from it.

Each repetition starts `torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml` (free ports and
its own run_dir; everything else the config's), sends SIGTERM to torchrun at a random moment after step --after (a
random step in [after, after + 3], then a random fraction of a step), and waits for torchrun to exit. The run stops
at the step in progress then (its row not logged yet), or at the next one if the signal came after that step's
agreement (preemption.stop_here, before its checkpoint). Each rank runs under a small wrapper that records its exit
code and time (torchrun does not report them after a SIGTERM) and ignores the signal itself, so the rank gets
torchrun's forwarded SIGTERM as it would without the wrapper. Then the run is resumed for 2 more steps: it must say
"resumed from .../step_S at step S", log steps S+1 and S+2, and train no prompt that the preempted part trained
(metrics.jsonl `data/prompt_ids`; tiny.yaml's filter drops groups of equal rewards, so the exactly-once count of
every prompt is tests/test_train.py's, with rollout.filter=[failed]).

Run:
    python bench/preemption_bench.py [--reps 5] [--after 2] [--seed N] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from services import free_port  # noqa: E402


def rank_wrapper(argv: list) -> None:
    """`preemption_bench.py --rank RC_DIR train.py ...` (torchrun runs this as each rank): run the rank, record its exit
    code and the time it exited in RC_DIR/rank_<RANK>, exit with it. SIGTERM is ignored here only: the rank installs
    its own handler."""
    rc_dir, cmd = argv[0], argv[1:]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p = subprocess.Popen([sys.executable, *cmd], preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    rc = p.wait()
    with open(os.path.join(rc_dir, f"rank_{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(f"{rc} {time.time()}")
    sys.exit(rc if rc >= 0 else 128 - rc)


def rows(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def torchrun(run_dir: str, rc_dir: str, *extra: str, stdout=None) -> subprocess.Popen:
    os.makedirs(rc_dir, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.abspath(__file__), "--rank", rc_dir, "train.py", "--config", os.path.join(ROOT, "configs",
                                                                                         "tiny.yaml"),
         f"run_dir={run_dir}", f"rollout.base_port={free_port()}", f"weight_sync.master_port={free_port()}", *extra],
        cwd=ROOT, stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def repetition(i: int, args, work: str, rng: random.Random) -> dict:
    run_dir = os.path.join(work, f"rep{i}")
    log = open(os.path.join(work, f"rep{i}.log"), "w")
    p = torchrun(run_dir, os.path.join(work, f"rep{i}_rc"), f"model.path={args.model}", stdout=log)
    at = rng.randint(args.after, args.after + 3)
    deadline = time.monotonic() + 600
    while not (os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and
               any(r["step"] >= at for r in rows(run_dir))):
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"repetition {i} ended or stalled before step {at}; see {log.name}")
        time.sleep(0.05)
    step_s = [r["timing/step"] for r in rows(run_dir) if r["step"] > 0][-1]
    time.sleep(rng.uniform(0.0, step_s))
    t0, wall = time.monotonic(), time.time()
    p.send_signal(signal.SIGTERM)
    rc = p.wait(120)
    seconds = time.monotonic() - t0
    log.close()
    text = open(log.name).read()
    line = next((ln for ln in text.splitlines() if ln.startswith("[train] SIGTERM ")), "")
    stopped = int(line.split("checkpointing step ")[1].split(",")[0]) if line else None
    ranks, ranks_s = {}, 0.0
    for name in sorted(os.listdir(os.path.join(work, f"rep{i}_rc"))):
        with open(os.path.join(work, f"rep{i}_rc", name)) as f:
            code, at_exit = f.read().split()
        ranks[name], ranks_s = int(code), max(ranks_s, float(at_exit) - wall)
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    part1 = [tuple(x) for r in rows(run_dir) for x in r.get("data/prompt_ids", [])]
    r_log = open(os.path.join(work, f"rep{i}_resume.log"), "w")
    q = torchrun(run_dir, os.path.join(work, f"rep{i}_resume_rc"), f"model.path={args.model}",
                 "trainer.resume=auto", f"trainer.total_steps={(stopped or 0) + 2}", stdout=r_log)
    resumed_rc = q.wait(600)
    r_log.close()
    r_text = open(r_log.name).read()
    all_rows = [r for r in rows(run_dir) if r["step"] > 0]
    part2 = [tuple(x) for r in all_rows if stopped is not None and r["step"] > stopped
             for x in r.get("data/prompt_ids", [])]
    return {"rep": i, "signal_after_step": at, "stopped_at": stopped, "seconds": seconds, "ranks_s": ranks_s,
            "to_checkpoint": next((r["time"] - wall for r in all_rows if r["step"] == stopped), float("nan")),
            "during": next((r["step"] for r in all_rows if r["time"] > wall), None),
            "torchrun_rc": rc,
            "ranks_rc": ranks, "sigkill": "forcefully exiting" in text, "checkpoints": ckpts,
            "checkpoint_of_stop": stopped is not None and f"step_{stopped:06d}" in ckpts,
            "step_s": step_s, "resumed": f"resumed from {run_dir}/checkpoints/step_{stopped:06d} at step {stopped}"
            in r_text if stopped is not None else False, "resumed_rc": resumed_rc,
            "steps": [r["step"] for r in all_rows], "repeated": len(set(part1) & set(part2)) +
            (len(part1) - len(set(part1))) + (len(part2) - len(set(part2))), "trained": (len(part1), len(part2))}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:
        return rank_wrapper(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--after", type=int, default=2, help="the signal comes after a random step in [after, after + 3]")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--work", default=None, help="directory for the runs (default: a new temporary one)")
    ap.add_argument("--model", default=None, help="model.path (default WORK/tiny-base, made by the first run)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(10 ** 6)
    rng = random.Random(seed)
    work = args.work or tempfile.mkdtemp(prefix="preemption-")
    os.makedirs(work, exist_ok=True)
    args.model = args.model or os.path.join(work, "tiny-base")
    print(f"bench/preemption_bench.py: seed {seed}, {args.reps} repetitions of configs/tiny.yaml (2 ranks) in {work}",
          flush=True)
    out = []
    for i in range(args.reps):
        r = repetition(i, args, work, rng)
        out.append(r)
        print(json.dumps(r), flush=True)
    print("\n| rep | signal during step | stopped at | a step (s) | signal -> step checkpointed and logged (s) "
          "| -> last rank's exit (s) | -> torchrun's exit (s) | ranks' exit | torchrun's exit | checkpoint of the stop "
          "| resumed there | prompts trained twice |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['rep']} | {r['during']} | {r['stopped_at']} | {r['step_s']:.2f} "
              f"| {r['to_checkpoint']:.2f} | {r['ranks_s']:.2f} | {r['seconds']:.2f} "
              f"| {' '.join(str(v) for v in r['ranks_rc'].values())} | {r['torchrun_rc']} | "
              f"{'yes' if r['checkpoint_of_stop'] else 'NO'} | "
              f"{'yes' if r['resumed'] and r['resumed_rc'] == 0 else 'NO'} | {r['repeated']} |")
    for key, what in (("ranks_s", "the last rank's exit"), ("seconds", "torchrun's exit")):
        s = [r[key] for r in out]
        print(f"signal -> {what}: median {statistics.median(s):.2f} s, min {min(s):.2f}, max {max(s):.2f} over "
              f"{len(s)}")


if __name__ == "__main__":
    main()
