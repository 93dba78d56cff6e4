"""bench/sandbox_bench.py: what a Python tool call costs, today's sandbox against the one it replaced.

The old pool (sandbox.py at commit a399291, loaded from `git show` into a temporary module) keeps long-lived worker
interpreters and sends each call over a pipe; the new one (sandbox.py) starts a bwrap sandbox and a fresh
interpreter per call. Measured, each with its pool made and warmed first:
  latency     one call at a time (workers=1): median and p90 wall ms of a trivial call (`6*7`) and of a small
              computation (`sum(i * i for i in range(200000))`), through run(); the new pool's arun() in one event
              loop too (what tasks.PyToolEnv uses);
  throughput  calls/s of the trivial call with workers=4 and 16 callers at once (threads for the old pool, asyncio
              tasks for the new), the shape of configs/tiny_agent.yaml's rollout.
On a shared machine wall figures move between runs; run the two pools back to back, as here.

Run: python bench/sandbox_bench.py [--calls 60] [--throughput-calls 200] [--old-commit a399291]   (~1 minute)
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import sandbox  # noqa: E402

TRIVIAL, SMALL = "6*7", "sum(i * i for i in range(200000))"


def load_old(commit: str, tmp: str):
    """sandbox.py as it was at `commit`, as a module of its own (its workers run that file)."""
    path = os.path.join(tmp, "sandbox_old.py")
    with open(path, "w") as f:
        f.write(subprocess.run(["git", "show", f"{commit}:sandbox.py"], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout)
    spec = importlib.util.spec_from_file_location("sandbox_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sandbox_old"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def quantiles(xs: list) -> tuple:
    xs = sorted(xs)
    return statistics.median(xs) * 1e3, xs[min(len(xs) - 1, int(0.9 * len(xs)))] * 1e3


def latency_sync(pool, code: str, calls: int) -> tuple:
    for _ in range(3):
        pool.run(code)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        r = pool.run(code)
        times.append(time.perf_counter() - t0)
        assert r.error is None, r
    return quantiles(times)


def latency_async(pool, code: str, calls: int) -> tuple:
    async def main():
        for _ in range(3):
            await pool.arun(code)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            r = await pool.arun(code)
            times.append(time.perf_counter() - t0)
            assert r.error is None, r
        return times

    return quantiles(asyncio.run(main()))


def throughput_threads(pool, calls: int) -> float:
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(pool.run, [TRIVIAL] * 8))
        t0 = time.perf_counter()
        results = list(ex.map(pool.run, [TRIVIAL] * calls))
    assert all(r.error is None for r in results)
    return calls / (time.perf_counter() - t0)


def throughput_async(pool, calls: int) -> float:
    async def main():
        await asyncio.gather(*(pool.arun(TRIVIAL) for _ in range(8)))
        sem = asyncio.Semaphore(16)

        async def one():
            async with sem:
                return await pool.arun(TRIVIAL)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(calls)))
        assert all(r.error is None for r in results)
        return calls / (time.perf_counter() - t0)

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=60, help="calls per latency figure")
    ap.add_argument("--throughput-calls", type=int, default=200)
    ap.add_argument("--old-commit", default="a399291", help="the commit whose sandbox.py is today's baseline")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_mod = load_old(args.old_commit, tmp)
        old = old_mod.SandboxPool(workers=1, cpu_s=5, wall_s=30)
        rows.append((f"old ({args.old_commit}, worker pool, {old.run('1').network})", "run",
                     latency_sync(old, TRIVIAL, args.calls), latency_sync(old, SMALL, args.calls)))
        old.close()
        old4 = old_mod.SandboxPool(workers=4, cpu_s=5, wall_s=30)
        old_tput = throughput_threads(old4, args.throughput_calls)
        old4.close()
    new = sandbox.SandboxPool(workers=1, cpu_s=5, wall_s=30)
    mode = "root, uid 65533-slot" if os.geteuid() == 0 else "user namespace"
    rows.append((f"new (bwrap per call, {mode})", "run", latency_sync(new, TRIVIAL, args.calls),
                 latency_sync(new, SMALL, args.calls)))
    rows.append((f"new (bwrap per call, {mode})", "arun", latency_async(new, TRIVIAL, args.calls),
                 latency_async(new, SMALL, args.calls)))
    new4 = sandbox.SandboxPool(workers=4, cpu_s=5, wall_s=30)
    new_tput = throughput_async(new4, args.throughput_calls)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end, {args.calls} calls a figure\n")
    print("| pool | call | trivial median ms | trivial p90 ms | small median ms | small p90 ms |")
    print("|---|---|---|---|---|---|")
    for name, how, (t50, t90), (s50, s90) in rows:
        print(f"| {name} | {how} | {t50:.1f} | {t90:.1f} | {s50:.1f} | {s90:.1f} |")
    print(f"\nthroughput, workers=4, 16 callers: old {old_tput:.0f} calls/s, new {new_tput:.0f} calls/s")


if __name__ == "__main__":
    main()
