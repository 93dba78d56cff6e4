"""bench/failure_bench.py: what a tool that fails at random costs a run, now that a failed trajectory leaves its group
and the group is trained on its survivors (rollout.min_group_size).

The same short agentic run twice, with the same seed: once with a tool that never fails and once with one that
raises on a random --rate of its calls; optionally (--old) a third time at that rate with rollout.min_group_size =
N, which trains only groups with no failure (the rule before survivors were trained). min_group_size is N / 2 in the
other runs. Printed per run: trained groups per second over steps 2..S (rollout/consumed_groups over timing/step;
step 1 holds the start-up), the failed trajectories, the groups trained short and dropped for too few survivors, and
the ratio of the failing run's groups per second to the clean one's (the goal: >= 0.8).

--setup tool-bound (the default; the issue's case, made small): configs/tiny_agent.yaml on the calc_tool task, B = 4
groups of N = 8, one update a step, rollout.filter [failed] (every group that survives is trained), and a tool whose
steps take 0.05-0.3 s, 4 at once (rollout.env_max_concurrent): generation, bound by the tool, is what limits the
run, so every group that failures cost shows. --setup tiny_agent: configs/tiny_agent.yaml as it is (calc_py, its
sandboxed tool, no added latency, [failed, all_equal_reward]): there the trainer is the bound, generation runs ahead
(most early groups have equal rewards and are dropped anyway), and failures cost little under any rule.

The failure injection is a tool environment of its own, usable in any run as rollout.env=failure_bench:<class> with
PYTHONPATH=bench: FlakyPyToolEnv (calc_py, configs/tiny_agent.yaml's own tool, tasks.PyToolEnv) and
FlakyCalcToolEnv (calc_tool, tasks.CalcToolEnv) raise ConnectionError on each call with probability
$FAILURE_BENCH_RATE (default 0.05), drawn from random.Random($FAILURE_BENCH_SEED, default 0) in call order, after
sleeping a uniform $FAILURE_BENCH_LATENCY ("lo,hi" seconds; default none); the rest is the task's own tool. They fail
in the rollout process only: the greedy eval (trainer rank 0) gets the tool as it is. E.g. the eval comparison of
docs/results/failures.md:

    FAILURE_BENCH_RATE=0.05 PYTHONPATH=bench .venv/bin/torchrun --standalone --nproc_per_node 2 train.py \\
        --config configs/tiny_agent.yaml rollout.env=failure_bench:FlakyPyToolEnv rollout.min_group_size=4

Run:
    python bench/failure_bench.py [--rate 0.05] [--steps 12] [--setup tool-bound|tiny_agent] [--seed 0] [--old]
Results: docs/results/failures.md.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tasks  # noqa: E402

# Failures are injected where the trajectories to train on are made, the rollout process (workers.py rollout); the
# greedy eval runs in trainer rank 0 with the same environment and sees the tool as it is, so eval/reward_mean
# measures the policy, not the injected failures.
TRAINING_ROLLOUT = os.path.basename(sys.argv[0]) == "workers.py" and sys.argv[1:2] == ["rollout"]
RATE = float(os.environ.get("FAILURE_BENCH_RATE", "0.05")) if TRAINING_ROLLOUT else 0.0
LATENCY = [float(x) for x in os.environ.get("FAILURE_BENCH_LATENCY", "0,0").split(",")]
_rng = random.Random(int(os.environ.get("FAILURE_BENCH_SEED", "0")))
_latency_rng = random.Random(int(os.environ.get("FAILURE_BENCH_SEED", "0")) + 1)


class _Flaky:
    """The task's tool after a random LATENCY, raising on a random RATE of its calls (one draw per call, when it
    starts)."""

    async def step(self, turn_text):
        fails = _rng.random() < RATE
        if LATENCY[1] > 0:
            await asyncio.sleep(_latency_rng.uniform(*LATENCY))
        if fails:
            raise ConnectionError("failure_bench: the tool's backend dropped the call")
        out = super().step(turn_text)
        return await out if inspect.isawaitable(out) else out


class FlakyPyToolEnv(_Flaky, tasks.PyToolEnv):
    """calc_py's sandboxed Python tool (configs/tiny_agent.yaml), failing at random."""


class FlakyCalcToolEnv(_Flaky, tasks.CalcToolEnv):
    """calc_tool's calculator, failing at random."""


ENV_OF = {"calc_py": "FlakyPyToolEnv", "calc_tool": "FlakyCalcToolEnv"}
# per setup: the task, the overrides of configs/tiny_agent.yaml, $FAILURE_BENCH_LATENCY
SETUPS = {"tool-bound": ("calc_tool", ["data_source.num_prompts_per_step=4", "trainer.mini_batch_size=32",
                                       "rollout.filter=[failed]"], "0.05,0.3"),
          "tiny_agent": ("calc_py", [], "0,0")}


def run(work: str, name: str, rate: float, min_group_size: int, args) -> dict:
    """One torchrun of train.py; its per-step metrics summed over steps 2..S."""
    from services import free_port

    run_dir = os.path.join(work, name)
    task, overrides, latency = SETUPS[args.setup]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py",
           "--config", os.path.join(ROOT, "configs", "tiny_agent.yaml"), f"run_dir={run_dir}", f"seed={args.seed}",
           f"model.path={os.path.join(args.models, f'{task}-s{args.seed}')}", f"data_source.task={task}", *overrides,
           f"rollout.env=failure_bench:{ENV_OF[task]}", f"rollout.min_group_size={min_group_size}",
           f"trainer.total_steps={args.steps}", "trainer.eval_freq=0", "trainer.save_freq=0",
           "trainer.export_hf=false", f"rollout.base_port={free_port()}", f"weight_sync.master_port={free_port()}",
           "rollout.env_fail_stop_steps=0"]
    env = {**os.environ, "FAILURE_BENCH_RATE": str(rate), "FAILURE_BENCH_SEED": str(args.seed),
           "FAILURE_BENCH_LATENCY": latency,
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                       os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"run {name} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if r["step"] >= 2]
    total = {k: sum(r.get(k, 0) for r in rows) for k in (
        "timing/step", "rollout/consumed_groups", "rollout/failed_count", "rollout/env_steps",
        "rollout/env_error_count", "rollout/failed_removed_count", "rollout/trained_short_groups",
        "rollout/min_group_size_drop", "rollout/filter_drop", "rollout/collected_groups")}
    total.update(name=name, rate=rate, min_group_size=min_group_size, wall_s=time.monotonic() - t0,
                 groups_per_s=total["rollout/consumed_groups"] / total["timing/step"])
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=0.05, help="probability that a tool call raises")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first is not measured)")
    ap.add_argument("--setup", choices=sorted(SETUPS), default="tool-bound")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--old", action="store_true", help="also a run at --rate with rollout.min_group_size = N")
    ap.add_argument("--models", default=os.path.join(ROOT, "runs", "failure_bench_models"),
                    help="where the tiny base of each task and seed is made (once) and kept")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    args = ap.parse_args()
    import config

    N = config.load_config(os.path.join(ROOT, "configs", "tiny_agent.yaml")).N
    arms = [("clean", 0.0, N // 2), ("failing", args.rate, N // 2)] + ([("old_rule", args.rate, N)] if args.old else [])
    with tempfile.TemporaryDirectory(prefix="failure_bench_") as work:
        results = []
        for name, rate, mgs in arms:
            r = run(work, name, rate, mgs, args)
            results.append(r)
            print(f"{name}: rate {rate:g}, min_group_size {mgs}: {r['groups_per_s']:.3f} trained groups/s "
                  f"({r['rollout/consumed_groups']} groups in {r['timing/step']:.1f} s of steps 2-{args.steps}; "
                  f"run {r['wall_s']:.0f} s)", flush=True)
    clean = results[0]["groups_per_s"]
    print(f"\nsetup {args.setup}, N = {N}, seed {args.seed}, steps 2-{args.steps} of each run")
    print("| run | rate | min_group_size | trained groups/s | ratio to clean | env steps | env errors | failed "
          "trajectories | removed | groups trained short | dropped (< min_group_size) | filter drops |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['rate']:g} | {r['min_group_size']} | {r['groups_per_s']:.3f} | "
              f"{r['groups_per_s'] / clean:.2f} | {r['rollout/env_steps']} | {r['rollout/env_error_count']} | "
              f"{r['rollout/failed_count']} | {r['rollout/failed_removed_count']} | "
              f"{r['rollout/trained_short_groups']} | {r['rollout/min_group_size_drop']} | "
              f"{r['rollout/filter_drop']} |")


if __name__ == "__main__":
    main()
