"""bench/buffer_bench.py: what the buffer costs, in one process and over torch.distributed.rpc.

Measures, for 1K- and 20K-token responses (prompts of 200 tokens, N = 8):
  throughput   trajectories/s through dispatch -> put -> TrajQueue -> collector -> PipelineBuffer -> get, with a
               producer putting one group per call and a consumer getting M // N = 16 groups per call;
  step cost    the spec's experiment (B = 64, N = 8, M = 128, stale_steps = 1.0): the trainer's side of one step
               (4 x get(16) + step_boundary + set_weight_version + step_metrics, with the groups already buffered)
               and the rollout's side (64 puts of 8 trajectories), which runs concurrently with generation.
In one process nothing is copied (tensors are shared), so the cost is the bookkeeping; over RPC (three processes
on this machine: buffer, rollout, trainer, as train.py runs them) every tensor crosses TensorPipe twice
(put and get): 20K-token trajectories are ~0.56 MB each (ids, log-probs, versions and loss mask).
Wall and CPU seconds are both printed: on a shared, loaded machine the wall time inflates, while the CPU time
(of the calling process plus the buffer process) is what this sequential path costs on dedicated cores.
Target (issue 2): the buffer's cost per training step under 0.5 s.

Run: python bench/buffer_bench.py [--tokens 1024 20480] [--groups 128] [--repeats 3] [--no-rpc]   (~1 minute)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import buffer  # noqa: E402
import config  # noqa: E402
import remote  # noqa: E402

B, N, M, STALE, PROMPT_TOKENS = 64, 8, 128, 1.0, 200


def make_cfg() -> config.Config:
    return config.validate(config.from_dict({
        "colocate": False, "fully_async": {"enable": True, "sliding_window": "windowed-fifo", "stale_steps": STALE},
        "data_source": {"num_prompts_per_step": B, "num_trajectories_per_prompt": N},
        "trainer": {"mini_batch_size": M}, "buffer": {"rpc_timeout_s": 120.0}}))


def make_prompts(n: int = 4096) -> list:
    return [[{"prompt_ids": list(range(PROMPT_TOKENS)), "label": i} for i in range(n)]]


class Producer:
    """The rollout's side: N distinct response tensors per group slot, reused across groups (as fresh data would
    be for the buffer: a put call never carries the same tensor twice)."""

    def __init__(self, buf, T: int):
        self.buf = buf
        self.slots = [(torch.randint(0, 32000, (T,)), torch.randn(T), torch.zeros(T, dtype=torch.long),
                       torch.ones(T, dtype=torch.long)) for _ in range(N)]

    def group(self, g) -> list:
        return [buffer.Trajectory(g.epoch, g.seq, i, g.prompt_ids, ids, lp, ver, mask, reward=float(i),
                                  start_version=0, end_version=0) for i, (ids, lp, ver, mask) in enumerate(self.slots)]

    def run(self, groups: int) -> float:
        """Dispatch and put `groups` groups, one put per group; returns the seconds spent inside put()."""
        sent, in_put = 0, 0.0
        while sent < groups:
            for g in self.buf.dispatch(groups - sent, 1.0):
                trajs = self.group(g)
                t = time.perf_counter()
                self.buf.put(trajs)
                in_put += time.perf_counter() - t
                sent += 1
        return in_put


def consume(buf, groups: int) -> None:
    per_call = M // N
    got = 0
    while got < groups:
        got += len(buf.get(min(per_call, groups - got), 60.0))


def trainer_step(buf, version: int) -> float:
    """The trainer's side of one step with B groups already buffered: 4 x get(16) and the step's bookkeeping."""
    t = time.perf_counter()
    consume(buf, B)
    buf.step_boundary([])
    buf.set_weight_version(version)
    buf.step_metrics()
    return time.perf_counter() - t


def wait_buffered(buf, k: int) -> None:
    deadline = time.monotonic() + 120
    while buf.stats()["Q"] < k:
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark: {k} groups were not buffered within 120 s")
        time.sleep(0.01)


def bench_in_process(T: int, groups: int, repeats: int) -> dict:
    with buffer.PipelineServer(make_cfg(), make_prompts()) as srv:
        prod = Producer(srv, T)
        th = threading.Thread(target=prod.run, args=(groups,))
        t0 = time.perf_counter()
        th.start()
        consume(srv, groups)
        th.join()
        wall = time.perf_counter() - t0
        srv.step_boundary([])
        out: dict = {"traj_per_s": [groups * N / wall]}
        for step in range(repeats):
            c0 = time.process_time()
            out.setdefault("put_s", []).append(prod.run(B))
            wait_buffered(srv, B)
            out.setdefault("put_cpu", []).append(time.process_time() - c0)
            c0 = time.process_time()
            out.setdefault("trainer_s", []).append(trainer_step(srv, step + 1))
            out.setdefault("trainer_cpu", []).append(time.process_time() - c0)
    return {k: statistics.median(v) for k, v in out.items()}


# ---- over RPC: three processes ----

def _cpu(fn, *args) -> tuple:
    """(result, seconds of CPU this process and the buffer process spent): under a loaded machine the CPU time is
    the figure that carries over to dedicated cores, where the wall time of this sequential path is about that."""
    import torch.distributed.rpc as rpc
    b0, c0 = rpc.rpc_sync("buffer", time.process_time), time.process_time()
    out = fn(*args)
    return out, time.process_time() - c0 + rpc.rpc_sync("buffer", time.process_time) - b0


def _rpc_main(rank: int, init: str, T: int, groups: int, repeats: int, barrier, results) -> None:
    torch.set_num_threads(1)
    cfg = make_cfg()
    if rank == 0:
        remote.serve_buffer(cfg.buffer_settings(), init, 0, 3, make_prompts())
        return
    import torch.distributed.rpc as rpc
    name = "rollout" if rank == 1 else "trainer"
    remote.init_rpc(name, rank, 3, init, 120.0)
    rb = remote.Proxy("buffer", 120.0, remote.BUFFER_METHODS)
    if rank == 1:
        prod = Producer(rb, T)
        barrier.wait()
        prod.run(groups)  # throughput phase, concurrently with the trainer's gets
        for step in range(repeats):
            barrier.wait()  # the trainer ran the step boundary
            put_s, put_cpu = _cpu(prod.run, B)  # one step's worth of puts
            results.put({"put_s": put_s, "put_cpu": put_cpu})
            barrier.wait()
    else:
        barrier.wait()
        t0 = time.perf_counter()
        consume(rb, groups)
        results.put({"traj_per_s": groups * N / (time.perf_counter() - t0)})
        rb.step_boundary([])
        for step in range(repeats):
            barrier.wait()
            barrier.wait()
            wait_buffered(rb, B)
            trainer_s, trainer_cpu = _cpu(trainer_step, rb, step + 1)
            results.put({"trainer_s": trainer_s, "trainer_cpu": trainer_cpu})
    rpc.shutdown()


def bench_rpc(T: int, groups: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    procs = [ctx.Process(target=_rpc_main, args=(r, init, T, groups, repeats, barrier, results)) for r in range(3)]
    for p in procs:
        p.start()
    out: dict = {}
    try:
        for _ in range(1 + 2 * repeats):
            for k, v in results.get(timeout=600).items():
                out.setdefault(k, []).append(v)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 20480], help="response tokens per trajectory")
    ap.add_argument("--groups", type=int, default=128, help="groups through the buffer in the throughput phase")
    ap.add_argument("--repeats", type=int, default=3, help="steps measured per setting (the median is printed)")
    ap.add_argument("--no-rpc", action="store_true", help="skip the three-process RPC measurements")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"buffer_bench: B={B} N={N} M={M} stale_steps={STALE}, prompts {PROMPT_TOKENS} tokens, "
          f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), torch {torch.__version__}; "
          f"per-step figures are the median of {args.repeats} steps")
    rows = []
    for T in args.tokens:
        modes = [("in-process", bench_in_process)] + ([] if args.no_rpc else [("rpc", bench_rpc)])
        for mode, fn in modes:
            r = fn(T, args.groups, args.repeats)
            r.update(mode=mode, tokens=T, mb_per_step=B * N * (T * 28 + PROMPT_TOKENS * 8) / 2 ** 20)
            rows.append(r)
            cpu = r["trainer_cpu"] + r["put_cpu"]
            print(f"{mode:>10} {T:>6} tokens: {r['traj_per_s']:8.0f} trajectories/s | one step ({B * N} trajectories, "
                  f"{r['mb_per_step']:.0f} MB): trainer side {r['trainer_s']:.3f} s wall / {r['trainer_cpu']:.3f} s "
                  f"CPU, rollout puts {r['put_s']:.3f} s wall / {r['put_cpu']:.3f} s CPU; CPU together {cpu:.3f} s "
                  f"({'under' if cpu < 0.5 else 'OVER'} the 0.5 s target)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
