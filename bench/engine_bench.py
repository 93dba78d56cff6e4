"""bench/engine_bench.py: output tokens/s of standins/engine.py at concurrency 1, 16 and 64, against sequential
transformers `generate` calls on the same checkpoint.

Models: "tiny" (tiny_model.make_tiny_model defaults: Qwen3, hidden 64, 2 layers) and "100m" (the same architecture at
hidden 1024, 11 layers: ~104M parameters), both random-init. Every request samples at temperature 1 with
ignore_eos, so all requests generate exactly --max-new-tokens tokens; the baseline samples too (top_k off) and
counts the tokens it actually generated. The baseline runs before the engine starts, so they never share the CPU,
and both use --threads torch threads (default 1, standins/engine.py's CPU default).
Simplified: prompts are random token ids (8-32 tokens). Wall-clock figures depend on what else the machine runs,
so each figure also comes as tokens per CPU-second (the CPU time the baseline / the engine process used, from
/proc), which stays meaningful on a shared machine; the load average is printed.

Run:  .venv/bin/python bench/engine_bench.py [--models tiny,100m] [--device auto] [--max-new-tokens 64]

--prefix-cache: instead, trajectories/s of the model thread alone (scheduler.Scheduler driven in-process, no HTTP)
on the CPU default's workload (the tiny model, groups of 16 samples of a distinct 16-32 token prompt, 6 new tokens,
temperature 1), once with an empty prefix cache and once with a full one (filled by the same workload until the
tree holds all but 256 of --cache-tokens, or until eviction has begun; every finished request then inserts new
tokens, so eviction runs in steady state). Runs against any scheduler.py: with one that takes max_total_tokens
(the KV pool), the pool is --cache-tokens; an older one holds scheduler.PREFIX_CACHE_TOKENS (65,536) in its cache.
Run:  .venv/bin/python bench/engine_bench.py --prefix-cache [--cache-tokens 65536] [--trajectories 4096] [--repeats 3]

--long-text: the latency of refusing a /generate body whose `text` (10 MB of digits) cannot fit the context
(standins/engine.py refuses it by its character count before tokenizing, `_parse_one`; tokenizing it took 14 s), and the
latency of small one-token requests sent one after another meanwhile, against the same small requests alone.
Run:  .venv/bin/python bench/engine_bench.py --long-text [--repeats 3]
"""
import argparse
import asyncio
import inspect
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standins import engine  # noqa: E402 (after the sys.path line)
from standins import tiny_model  # noqa: E402

MODELS = {"tiny": dict(hidden_size=64, num_layers=2), "100m": dict(hidden_size=1024, num_layers=11)}
CONCURRENCY = (1, 16, 64)


def prompts(n: int, vocab: int, seed: int) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(8, 32))] for _ in range(n)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process pid (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sequential_generate(path: str, device: str, ps: list, max_new: int) -> tuple:
    """(tokens/s, tokens per CPU-s) of one transformers generate call per prompt, one after the other."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    kw = dict(max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=None, top_p=1.0, pad_token_id=0)
    model.generate(torch.tensor([ps[0]], device=device), **{**kw, "max_new_tokens": 4})  # warm-up
    tokens, t0, c0 = 0, time.perf_counter(), cpu_seconds(os.getpid())
    for p in ps:
        out = model.generate(torch.tensor([p], device=device), **kw)
        tokens += out.shape[1] - len(p)
    return tokens / (time.perf_counter() - t0), tokens / (cpu_seconds(os.getpid()) - c0)


async def engine_rate(url: str, pid: int, ps: list, concurrency: int, max_new: int) -> tuple:
    """(tokens/s, tokens per engine CPU-s) of len(ps) /generate calls, `concurrency` of them in flight."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async def one(p):
            async with sem:
                body = {"input_ids": p, "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0,
                                                            "ignore_eos": True}, "return_logprob": True}
                async with s.post(url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["meta_info"]["completion_tokens"]
        await one(ps[0])  # warm-up
        t0, c0 = time.perf_counter(), cpu_seconds(pid)
        tokens = sum(await asyncio.gather(*[one(p) for p in ps]))
        return tokens / (time.perf_counter() - t0), tokens / (cpu_seconds(pid) - c0)


def cache_bench(args) -> None:
    """Trajectories/s of the model thread with an empty and with a full prefix cache (see the module docstring)."""
    from standins import scheduler
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(args.threads)
    tok = tiny_model.build_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model.make_tiny_model(os.path.join(tmp, "tiny"), seed=0, **MODELS["tiny"])
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    kw = {"max_total_tokens": args.cache_tokens} if "max_total_tokens" in inspect.signature(
        scheduler.Scheduler).parameters else {}
    cap = args.cache_tokens if kw else scheduler.PREFIX_CACHE_TOKENS
    sched = scheduler.Scheduler(model, tok, torch.device("cpu"), 256, 16384, "default", **kw)
    sched.thread.start()
    rng, counter = random.Random(0), [0]

    def run(groups: int) -> tuple:
        """Generate `groups` groups of 16 (all submitted at once); returns (trajectories/s, per CPU-second of this
        process: the model thread's work, the waiting main thread uses next to none)."""
        done, left = threading.Event(), [groups * 16]
        lock = threading.Lock()

        def notify(n, final):
            if final:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
        reqs = []
        for _ in range(groups):
            prompt = [rng.randrange(4, len(tok)) for _ in range(rng.randint(16, 32))]
            sp = scheduler.SamplingParams(max_new_tokens=6, temperature=1.0, greedy=False, top_p=1.0, top_k=-1,
                                          min_p=0.0, stop_strs=[], stop_token_ids=[], ignore_eos=True,
                                          skip_special_tokens=True, no_stop_trim=False, min_new_tokens=0,
                                          sampling_seed=None, stream_interval=1)
            for _ in range(16):
                counter[0] += 1
                reqs.append(scheduler.Req(rid=f"b{counter[0]}", input_ids=prompt, sp=sp, notify=notify))
        t0, c0 = time.perf_counter(), time.process_time()
        sched.call(lambda: sched.submit(reqs)).result(60)
        if not done.wait(3600):
            raise TimeoutError(f"{left[0]} of {groups * 16} trajectories did not finish within 3600 s")
        return groups * 16 / (time.perf_counter() - t0), groups * 16 / (time.process_time() - c0)

    try:
        run(8)  # warm-up
        rows = []
        for rep in range(args.repeats):
            assert sched.call(sched.flush_cache).result(600), "the prefix cache could not be flushed"
            empty = run(args.trajectories // 16)
            filled = 0
            # at its bound: every insert from here on meets a full cache (the old code's cache stays within 256
            # tokens of it once reached; with a KV pool, eviction has begun)
            ev0 = getattr(sched, "evicted_nodes", 0)
            while sched.cache_tokens < cap - 256 and getattr(sched, "evicted_nodes", 0) == ev0:
                run(64)
                filled += 64 * 16
            evicted = getattr(sched, "evicted_nodes", None)
            full = run(args.trajectories // 16)
            rows.append((empty, full))
            ev = "" if evicted is None else f", {sched.evicted_nodes - evicted} nodes evicted while measuring"
            print(f"repeat {rep}: empty cache {empty[0]:.0f} trajectories/s ({empty[1]:.0f} per CPU-s), full cache "
                  f"{full[0]:.0f} trajectories/s ({full[1]:.0f} per CPU-s) (x{full[0] / empty[0]:.2f} wall, "
                  f"x{full[1] / empty[1]:.2f} CPU; filled with {filled} trajectories, {sched.cache_tokens} tokens "
                  f"cached of {cap}{ev})", flush=True)
    finally:
        sched.stop()
    for k, unit in ((0, "trajectories/s"), (1, "trajectories per CPU-second")):
        e = sorted(r[0][k] for r in rows)[len(rows) // 2]
        f = sorted(r[1][k] for r in rows)[len(rows) // 2]
        print(f"median of {len(rows)} ({unit}): empty {e:.0f}, full {f:.0f} (full / empty {f / e:.2f})")
    print(f"load average {os.getloadavg()[0]:.1f}")


def long_text_bench(args) -> None:
    """Refusal latency of an over-long `text` and small-request latency meanwhile (see the module docstring)."""
    import requests

    def small(url: str) -> float:
        t = time.perf_counter()
        r = requests.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}},
                          timeout=60)
        assert r.status_code == 200, r.text
        return time.perf_counter() - t

    def pct(xs: list, q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

    body = json.dumps({"text": "1" * (10 << 20), "sampling_params": {"max_new_tokens": 4}})
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model.make_tiny_model(os.path.join(tmp, "tiny"), seed=0, **MODELS["tiny"])
        url, handle = engine.launch(path, device="cpu", num_threads=args.threads)
        try:
            alone = [small(url) for _ in range(200)]
            during, refusals, stop = [], [], threading.Event()

            def loop():
                while not stop.is_set():
                    during.append(small(url))

            thread = threading.Thread(target=loop)
            thread.start()
            try:
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    r = requests.post(url + "/generate", data=body, timeout=60)
                    refusals.append(time.perf_counter() - t)
                    assert r.status_code == 400, r.text
            finally:
                stop.set()
                thread.join()
        finally:
            handle.stop()
    print(f"load average {os.getloadavg()[0]:.1f}; a 10 MB `text` refused in {pct(refusals, 0.5):.0f} ms (median of "
          f"{len(refusals)}, max {max(refusals) * 1000:.0f} ms)")
    print(f"small requests alone: median {pct(alone, 0.5):.1f} ms, p99 {pct(alone, 0.99):.1f} ms; meanwhile: median "
          f"{pct(during, 0.5):.1f} ms, max {max(during) * 1000:.1f} ms ({len(during)} requests)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,100m", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (tiny; 100m uses half)")
    ap.add_argument("--rounds", type=int, default=2, help="requests per level = rounds * concurrency (min 8)")
    ap.add_argument("--seq-prompts", type=int, default=8, help="prompts for the sequential baseline")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the baseline and the engine")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="measure trajectories/s with an empty vs a full prefix cache instead (see above)")
    ap.add_argument("--cache-tokens", type=int, default=1 << 16, help="--prefix-cache: the KV pool in tokens")
    ap.add_argument("--trajectories", type=int, default=4096, help="--prefix-cache: trajectories per measurement")
    ap.add_argument("--repeats", type=int, default=3,
                    help="--prefix-cache: empty/full pairs measured; --long-text: refusals measured")
    ap.add_argument("--long-text", action="store_true",
                    help="measure the refusal of an over-long `text` and small requests meanwhile instead")
    args = ap.parse_args()
    if args.long_text:
        return long_text_bench(args)
    if args.prefix_cache:
        return cache_bench(args)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.set_num_threads(args.threads)
    print(f"device {device}, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = tiny_model.make_tiny_model(os.path.join(tmp, name), seed=0, **MODELS[name])
            n_params = sum(t.numel() for t in load_file(os.path.join(path, "model.safetensors")).values())
            max_new = args.max_new_tokens if name == "tiny" else args.max_new_tokens // 2
            seq_n = args.seq_prompts if name == "tiny" else max(2, args.seq_prompts // 2)
            vocab = len(tiny_model.build_tokenizer())
            seq = sequential_generate(path, device, prompts(seq_n, vocab, 1), max_new)
            url, handle = engine.launch(path, device=device, max_running_requests=max(CONCURRENCY),
                                        num_threads=args.threads)
            try:
                rates = {c: asyncio.run(engine_rate(url, handle.proc.pid, prompts(max(8, args.rounds * c), vocab, c),
                                                    c, max_new)) for c in CONCURRENCY}
            finally:
                handle.stop()
            rows.append((name, n_params, max_new, seq, rates))
            print(f"{name}: {n_params / 1e6:.1f}M params, {max_new} new tokens/request: sequential generate "
                  f"{seq[0]:.0f} tok/s; engine " + ", ".join(f"c={c} {r[0]:.0f} tok/s ({r[0] / seq[0]:.1f}x)"
                                                            for c, r in rates.items()), flush=True)
    for k, unit in ((0, "tok/s (wall clock)"), (1, "tokens per CPU-second")):
        print(f"\n{unit}\n| model | params | sequential generate | "
              + " | ".join(f"engine c={c} (x seq)" for c in CONCURRENCY) + " |")
        print("|---|---|---|" + "---|" * len(CONCURRENCY))
        for name, n_params, _, seq, rates in rows:
            print(f"| {name} | {n_params / 1e6:.1f}M | {seq[k]:.0f} | "
                  + " | ".join(f"{r[k]:.0f} ({r[k] / seq[k]:.1f}x)" for r in rates.values()) + " |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
