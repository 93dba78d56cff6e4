"""bench/rollout_heap.py: does the rollout + buffer loop keep Python objects from step to step?

The producer of the CPU default in one process (rollout.Rollout + buffer.PipelineServer + a SyncFleet against a
standins/engine.py it starts; B=8 groups of N=8, rollout.partial=true, abort pauses) runs steps as train.py drives
them: take B groups, pause, a new weight version on the servers and the buffer, resume, both step_metrics. With
tracemalloc on from step 20, it prints the Python heap traced at steps --at (default 100, 300 and 1000) and the
allocation sites that grew most between the first and the last (what a leak in rollout.py, buffer.py,
strategies.py or sglang_client.py would show as a site growing with the steps; bench/soak.py sees only RSS).

Run: nice -n 5 .venv/bin/python bench/rollout_heap.py [--at 100 300 1000] [--model runs/tiny-base]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tracemalloc
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import buffer  # noqa: E402
import config  # noqa: E402
import rollout  # noqa: E402
import sglang_client  # noqa: E402
import tasks  # noqa: E402
from standins import engine, tiny_model  # noqa: E402


TRACE_FROM = 20  # tracing starts after this step: the producer's start-up allocations stay out of the comparison


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--at", type=int, nargs="+", default=[100, 300, 1000])
    p.add_argument("--model", default=os.path.join(ROOT, "runs", "tiny-base"), help="made if missing")
    a = p.parse_args(argv)
    if len(set(a.at)) < 2 or min(a.at) < TRACE_FROM:
        p.error(f"--at needs two or more distinct steps >= {TRACE_FROM} (tracing starts after step {TRACE_FROM}), "
                f"got {a.at}")
    from transformers import AutoTokenizer

    if not os.path.exists(os.path.join(a.model, "config.json")):
        tiny_model.make_tiny_model(a.model)
    url, handle = engine.launch(a.model, num_threads=1)
    cfg = config.load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        f"rollout.servers=[{url}]", "rollout.launch=none", "data_source.num_prompts_per_step=8",
        "data_source.num_trajectories_per_prompt=8", "trainer.mini_batch_size=64", "rollout.filter=[failed]",
        "rollout.async_max_concurrent_samples=64", f"model.path={a.model}"])
    tok = AutoTokenizer.from_pretrained(a.model)
    buf = buffer.PipelineServer(cfg, [tasks.load_prompts(cfg.data_source[0], tok, "train")])
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    ro = rollout.Rollout(cfg, buf, sync, tok)
    snaps = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the concurrency clamp's warning
            ro.start()
        for step in range(1, max(a.at) + 1):
            buf.get(cfg.B, timeout=120)
            ro.pause()
            sync.update_weight_version(step)
            buf.set_weight_version(step)
            buf.step_metrics()
            ro.resume(step)
            ro.step_metrics()
            if step == TRACE_FROM:
                tracemalloc.start(8)
            if step in a.at:
                gc.collect()
                snaps[step] = tracemalloc.take_snapshot()
                print(f"step {step}: Python heap traced {tracemalloc.get_traced_memory()[0] / 2**20:.2f} MiB",
                      flush=True)
    finally:
        ro.stop()
        sync.close()
        buf.close()
        handle.stop()
    first, last = min(snaps), max(snaps)
    print(f"sites that grew most from step {first} to {last}:")
    for d in snaps[last].compare_to(snaps[first], "lineno")[:8]:
        frame = d.traceback[0]
        where = os.path.relpath(frame.filename, ROOT) if frame.filename.startswith(ROOT) else frame.filename
        print(f"  {d.size_diff / 1024:+8.1f} KiB {d.count_diff:+6d} blocks  {where}:{frame.lineno}")


if __name__ == "__main__":
    main()
