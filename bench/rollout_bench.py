"""bench/rollout_bench.py: does the producer keep standins/engine.py saturated, and what does it cost per trajectory?

Starts standins/engine.py (the tiny model unless --model-path or --url), a PipelineServer (fully-async, no-window) and
the Rollout. After one warm-up step, a trainer stand-in takes groups as fast as they are buffered (no training), so
the producer dispatches all the time and only it and the engine set the pace; a poller reads the engine's /v1/loads
every few ms meanwhile. The --seconds are cut into --steps segments, each ended by a step boundary taken while the
producer is busy (pause, bump the weight version, resume), which measures timing/pause_delay; the poller does not
sample during the boundaries.

Printed figures:
- engine occupancy: the engine's running + waiting requests over S = rollout.async_max_concurrent_samples (mean, and
  the share of samples at S). Below 1 for two reasons, told apart by the next figure: group granularity (a group
  frees its N slots only when its last trajectory ends, so its finished siblings' slots idle meanwhile) and producer
  latency.
- hand-off: the engine's count over the trajectories the producer has in flight at the same moment (mean, share of
  samples where they are equal); below 1 while a request is between the producer and the engine's scheduler
  (HTTP both ways, and the engine admits new requests only between two decode steps).
- producer CPU per trajectory: CPU seconds of the rollout's event-loop thread, and of the benchmark process minus
  the poller and the trainer stand-in (main thread) threads, i.e. loop + reward threads + the threads that call the
  in-process buffer + its collector (the engine is a separate process), divided by the trajectories finished.
- throughput and timing/pause_delay.

Run:
    python bench/rollout_bench.py [--seconds 20] [--concurrency 32] [--n 8] [--b 8] [--max-new-tokens 32]
                                  [--steps 3] [--partial] [--url http://127.0.0.1:30000 --model-path DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import buffer  # noqa: E402
import config  # noqa: E402
from standins import engine  # noqa: E402
import rollout  # noqa: E402
import sglang_client  # noqa: E402
import tasks  # noqa: E402
from standins import tiny_model  # noqa: E402


def poll_loads(url: str, ro: rollout.Rollout, dispatching: threading.Event, stop: threading.Event, out: list,
               cpu: list):
    """(engine running + waiting, producer in flight) samples while `dispatching`, until `stop`; then appends this
    thread's own CPU time to `cpu` (subtracted from the producer's)."""
    session = requests.Session()
    while not stop.is_set():
        if not dispatching.wait(0.1):
            continue
        load = session.get(url + "/v1/loads", timeout=5).json()["loads"][0]
        if dispatching.is_set():
            out.append((load["num_running_reqs"] + load["num_waiting_reqs"], len(ro._active)))
        time.sleep(0.005)
    cpu.append(time.thread_time())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="measured time of continuous dispatch (after warm-up)")
    ap.add_argument("--steps", type=int, default=4, help="step boundaries (pause, version bump, resume) in --seconds")
    ap.add_argument("--concurrency", type=int, default=32, help="rollout.async_max_concurrent_samples S")
    ap.add_argument("--n", type=int, default=8, help="N trajectories per group")
    ap.add_argument("--b", type=int, default=8, help="B groups per step (the trainer stand-in pauses after B)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--engine-max-running", type=int, default=None, help="standins/engine.py --max-running-requests "
                    "(default: S, so the engine runs everything the producer sends)")
    ap.add_argument("--partial", action="store_true", help="rollout.partial=true (abort at each pause)")
    ap.add_argument("--url", default=None, help="use this running server instead of starting standins/engine.py")
    ap.add_argument("--model-path", default=None, help="model (and tokenizer) directory; default: a new tiny model")
    args = ap.parse_args(argv)

    model = args.model_path or tiny_model.make_tiny_model(tempfile.mkdtemp(prefix="rollout-bench-"))
    handle = None
    url = args.url
    if url is None:
        url, handle = engine.launch(model, max_running_requests=args.engine_max_running or args.concurrency)
    cfg = config.load_config(None, [
        "colocate=false", "fully_async.enable=true", "fully_async.stale_steps=1",
        f"data_source.num_prompts_per_step={args.b}", f"data_source.num_trajectories_per_prompt={args.n}",
        f"trainer.mini_batch_size={args.n}", f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        f"rollout.async_max_concurrent_samples={args.concurrency}", f"rollout.servers=[{url}]",
        f"rollout.partial={'true' if args.partial else 'false'}", "data_source.num_prompts=100000"])
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    buf = buffer.PipelineServer(cfg, [tasks.load_prompts(cfg.data_source[0], tokenizer, "train")])
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    ro = rollout.Rollout(cfg, buf, sync, tokenizer)
    samples, poller_cpu, dispatching, stop = [], [], threading.Event(), threading.Event()
    poller = threading.Thread(target=poll_loads, args=(url, ro, dispatching, stop, samples, poller_cpu), daemon=True)
    loop_cpu = lambda: sync.run(_thread_time(), 10.0, "reading the loop thread's CPU time")  # noqa: E731
    version, pauses = 0, []

    def boundary() -> float:
        nonlocal version
        dispatching.clear()
        pause = ro.pause()["timing/pause_delay"]
        version += 1
        sync.update_weight_version(version)
        buf.set_weight_version(version)
        ro.resume(version)
        return pause

    try:
        ro.start()
        buf.get(cfg.B, timeout=300)  # warm-up: the first fill of the pipeline
        boundary()
        ro.step_metrics()
        poller.start()
        t0, cpu0, main0, loop0 = time.monotonic(), time.process_time(), time.thread_time(), loop_cpu()
        for k in range(1, args.steps + 1):
            dispatching.set()
            while time.monotonic() - t0 < args.seconds * k / args.steps:
                buf.get(1, timeout=300)  # the trainer stand-in: groups as fast as they come, no training
            pauses.append(boundary())
        stop.set()
        dispatching.set()
        poller.join(10)
        wall, loop = time.monotonic() - t0, loop_cpu() - loop0
        cpu = time.process_time() - cpu0 - (time.thread_time() - main0) - poller_cpu[0]
        m = ro.step_metrics()
    finally:
        stop.set()
        dispatching.set()
        ro.stop()
        sync.close()
        buf.close()
        if handle is not None:
            handle.stop()
    trajs = m["rollout/trajectories_finished"]
    S = ro.max_samples
    engine_counts = [e for e, _ in samples]
    ratios = [e / p for e, p in samples if p > 0]
    out = {
        "S": S, "N": args.n, "B": args.b, "wall_s": round(wall, 2), "trajectories": trajs,
        "engine_occupancy_mean": round(sum(engine_counts) / max(1, len(samples)) / S, 3),
        "engine_at_S_share": round(sum(e >= S for e in engine_counts) / max(1, len(samples)), 3),
        "engine_busy_share": round(sum(e > 0 for e in engine_counts) / max(1, len(samples)), 3),
        "handoff_mean": round(sum(ratios) / max(1, len(ratios)), 3),
        "handoff_equal_share": round(sum(e >= p for e, p in samples if p > 0) / max(1, len(ratios)), 3),
        "poll_samples": len(samples),
        "loop_cpu_ms_per_traj": round(1e3 * loop / max(1, trajs), 3),
        "producer_cpu_ms_per_traj": round(1e3 * cpu / max(1, trajs), 3),
        "trajectories_per_s": round(trajs / wall, 2),
        "generated_tokens_per_s": round(m["rollout/generated_tokens_per_s"], 1),
        "pause_delay_mean_s": round(sum(pauses) / max(1, len(pauses)), 4), "partial": args.partial,
    }
    print(f"engine occupancy (running+waiting)/S: mean {out['engine_occupancy_mean']:.3f}, "
          f"at S {out['engine_at_S_share']:.1%} of samples, any work {out['engine_busy_share']:.1%}")
    print(f"hand-off (engine count / producer in flight): mean {out['handoff_mean']:.3f}, "
          f"equal in {out['handoff_equal_share']:.1%} of {len(samples)} samples")
    print(f"producer CPU per trajectory: event-loop thread {out['loop_cpu_ms_per_traj']:.2f} ms, producer threads "
          f"{out['producer_cpu_ms_per_traj']:.2f} ms ({trajs} trajectories, {out['trajectories_per_s']} /s, "
          f"{out['generated_tokens_per_s']} tokens/s)")
    print(f"timing/pause_delay over {len(pauses)} step boundaries (rollout.partial={args.partial}): mean "
          f"{out['pause_delay_mean_s']} s")
    print(json.dumps({"rollout_bench": out}))


async def _thread_time() -> float:
    return time.thread_time()


if __name__ == "__main__":
    main()
