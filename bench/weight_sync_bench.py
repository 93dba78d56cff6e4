"""bench/weight_sync_bench.py: trainer -> server weight-sync throughput on CPU, GB/s per weight_sync.method.

A random ~100M-parameter Qwen3 (hidden 768, 11 layers, vocab 32000, tied embeddings; float32 on CPU, so ~0.4 GB
per sync) is loaded by --ranks trainer processes (gloo, FSDP2, torchrun) exactly as train.py loads it, one
standins/engine.py server serves it, and `Actor.sync_weights` pushes it --repeats times per method (a fresh engine and
trainer per method). Printed per method: the first sync (it forms the broadcast group) and the median of the others, in
seconds and GB/s (parameter bytes in the servers' dtype / seconds). --code DIR runs the Actor of another checkout
whose train.py is one SPMD program (model.load_model and Actor take the control group; an older one, with
train._CTRL and Actor.follow, does not run here), whose standins/engine.py serves too; methods it lacks are skipped.
The machine is shared and loaded: compare figures of one run, or of runs taken back to back.

Run: python bench/weight_sync_bench.py [--code DIR] [--ranks 2] [--methods distributed,tensor,disk]
                                       [--bucket-mb 512] [--repeats 3] [--port 24310] [--moe]

--delta (weight_sync.delta, this checkout only): one standins/engine.py --dtype bfloat16 with the delta loader per
(method, lr); the trainer pushes bf16 (as on GPUs), syncs once in full, then --steps times takes one AdamW step at
that lr (language-model loss on random tokens: Adam's update is ~lr per element whatever the loss, so the changed
share is set by lr against the weights' bf16 spacing) and syncs the delta. Printed per step: bytes sent, seconds,
the changed share; per run, how many times the weight-update group formed. --model DIR benchmarks an existing HF
checkpoint (e.g. runs/smollm2) instead of the random one. --draft launches the engine with a speculative draft model
(--speculative-algorithm EAGLE: a draft runner that weight updates may select) and prints the weight operations it
got (none: the trainer's updates select the target).
  python bench/weight_sync_bench.py --delta [--model DIR] [--lrs 1e-6,1e-5] [--steps 5] [--methods distributed,disk]
                                    [--draft]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(path: str, moe: bool = False) -> int:
    """A random ~100M-parameter Qwen3 at `path` (the character tokenizer of tiny_model.make_tiny_model); its size. moe: a
    Qwen3-MoE of Qwen3-30B-A3B's expert count (128 experts, top-8, width 32: 393 checkpoint tensors a layer, as the
    30B's 393), 8 layers, ~120M parameters."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from standins import tiny_model

    tiny_model.make_tiny_model(path)  # tokenizer and generation config
    shared = dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                  tie_word_embeddings=True, max_position_embeddings=512)
    if moe:
        cfg = Qwen3MoeConfig(num_hidden_layers=8, intermediate_size=2304, moe_intermediate_size=32, num_experts=128,
                             num_experts_per_tok=8, decoder_sparse_step=1, **shared)
    else:
        cfg = Qwen3Config(num_hidden_layers=11, intermediate_size=2304, **shared)
    torch.manual_seed(0)
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def worker(a) -> None:
    """One trainer rank under torchrun; rank 0 times the syncs and prints RESULT {...}."""
    import faulthandler

    faulthandler.dump_traceback_later(a.hang_s, exit=True)  # a hang prints every thread's stack, then exits
    sys.path.insert(0, a.code)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import config as config_lib
    import model as model_lib
    import sglang_client
    import actor as actor_lib

    dist.init_process_group("gloo")
    ctrl = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    delta = ["weight_sync.delta=true", f"weight_sync.delta_full_every={a.steps + 1}", "trainer.weight_decay=0.0",
             f"trainer.lr={a.lr}", "weight_sync.dtype=bfloat16"] if a.delta else []
    cfg = config_lib.load_config(None, delta + [f"model.path={a.model}", f"run_dir={a.run_dir}", "device=cpu",
                                        f"weight_sync.method={a.methods}",
                                        "colocate=false", f"weight_sync.bucket_mb={a.bucket_mb}",
                                        f"weight_sync.master_port={a.port + 1}", "weight_sync.master_address=127.0.0.1",
                                        f"trainer.num_gpus_per_node={world}"])
    model, _ = model_lib.load_model(cfg, init_device_mesh("cpu", (world,)), torch.device("cpu"), rank, ctrl)
    opt, sched = model_lib.build_optimizer(model, cfg.trainer)
    actor = actor_lib.Actor(cfg, model, opt, sched, torch.device("cpu"), ctrl)
    if rank == 0:
        actor.fleet = sglang_client.SyncFleet(sglang_client.Fleet([a.url]))
    if a.delta:
        return delta_worker(a, cfg, model, opt, actor, rank)
    nbytes = sum(p.numel() for p in model.parameters()) * 4
    out, version = {}, 0
    for method in a.methods.split(","):  # one per run (main): the other ranks read the same config
        times = []
        for _ in range(a.repeats):  # every rank syncs, as in train.py's step loop
            version += 1
            t0 = time.perf_counter()
            actor.sync_weights(version)
            times.append(time.perf_counter() - t0)
        out[method] = times
    if rank == 0:
        print("RESULT " + json.dumps({"bytes": nbytes, "times": out}), flush=True)
    dist.barrier(group=ctrl)
    dist.destroy_process_group()


def delta_worker(a, cfg, model, opt, actor, rank) -> None:
    """--delta: a full sync, then --steps of (one AdamW step at a.lr, a delta sync); rank 0 prints RESULT."""
    import torch
    import torch.distributed as dist

    assert actor.weights.dtype == torch.bfloat16, "--delta runs with weight_sync.dtype=bfloat16 (the engine's)"
    g = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    rows, forms, form = [], [], actor.weights.distributed.form
    actor.weights.distributed.form = lambda: forms.append(1) or form()  # counts the weight-update group's formations
    for version in range(1, a.steps + 2):
        if version > 1:
            ids = torch.randint(0, vocab, (2, 64), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        t0 = time.perf_counter()
        m = actor.sync_weights(version)
        rows.append({"s": time.perf_counter() - t0, **{k: m.get(k) for k in (
            "perf/weight_sync_bytes", "perf/weight_sync_delta", "perf/weight_sync_changed_frac")}})
    if rank == 0:
        print("RESULT " + json.dumps({"rows": rows, "numel": sum(p.numel() for p in model.parameters()),
                                      "forms": len(forms)}), flush=True)
    dist.barrier(group=actor.ctrl if hasattr(actor, "ctrl") else None)
    dist.destroy_process_group()


def main_delta(a) -> None:
    """--delta: per method and lr, a fresh bf16 engine with the delta loader and fresh trainer ranks."""
    import weight_delta
    from standins import engine

    with tempfile.TemporaryDirectory() as d:
        model = a.model or os.path.join(d, "model")
        if not a.model:
            make_model(model, a.moe)
        draft = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=model) if a.draft else {}
        print(f"model {a.model or 'random ~100M Qwen3'}; {a.ranks} trainer ranks (gloo, CPU), one standins/engine.py "
              f"--dtype bfloat16 --custom-weight-loader {weight_delta.LOADER}"
              f"{' --speculative-algorithm EAGLE' if a.draft else ''}; bucket_mb {a.bucket_mb}; AdamW, "
              "weight_decay 0", flush=True)
        print("| method | lr | sync | kind | bytes | s | changed share |\n|---|---|---|---|---|---|---|")
        notes = []
        for method in [m for m in a.methods.split(",") if m != "tensor"]:  # delta: refused with tensor
            for lr in a.lrs.split(","):
                run_dir = os.path.join(d, f"run_{method}_{lr}")  # disk deltas: read from its sync_weights only
                url, handle = engine.launch(model, port=a.port, dist_timeout=600, wait_timeout=600, dtype="bfloat16",
                                            custom_weight_loader=weight_delta.LOADER, weight_version=0,
                                            env={weight_delta.SYNC_DIR_ENV: os.path.join(run_dir, "sync_weights")},
                                            **draft)
                try:
                    res = run_workers(a, ["--delta", "--lr", lr, "--steps", str(a.steps), "--model", model, "--url",
                                          url, "--run-dir", run_dir, "--methods", method],
                                      os.path.join(d, f"{method}_{lr}.log"), 3600)
                finally:
                    handle.stop()
                with open(handle.log_path) as f:
                    res["draft"] = sum(engine.DRAFT_LOG in ln for ln in f)
                for i, r in enumerate(res["rows"]):
                    kind = "delta" if r["perf/weight_sync_delta"] else "full"
                    frac = "" if i == 0 else f"{100 * r['perf/weight_sync_changed_frac']:.2f}%"
                    print(f"| {method} | {lr} | {i + 1} | {kind} | {r['perf/weight_sync_bytes'] / 1e6:.2f} MB | "
                          f"{r['s']:.2f} | {frac} |", flush=True)
                notes.append(f"{method} lr {lr}: the weight-update group formed {res['forms']} time(s)"
                             f"{'; weight operations the draft model got: ' + str(res['draft']) if a.draft else ''}")
        print("\n" + "\n".join(notes))


def run_workers(a, args: list, log_path: str, timeout_s: int) -> dict:
    """torchrun --worker on a.ranks ranks with `args` (plus the shared --code, --bucket-mb, --port, --hang-s) -> the
    RESULT line rank 0 printed; the ranks' output goes to log_path, and its tail is the error when they fail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.ranks),
           os.path.abspath(__file__), "--worker", "--code", a.code, "--bucket-mb", str(a.bucket_mb), "--port",
           str(a.port), "--hang-s", str(a.hang_s), *args]
    # to a file, not a pipe: torch_shm_manager (tensor on CPU) inherits it and outlives torchrun
    with open(log_path, "w+") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        log.seek(0)
        text = log.read()
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not lines:
        raise SystemExit(f"the trainer ranks failed:\n{text[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", default=ROOT, help="checkout whose train.py / standins/engine.py run (default: this one)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--methods", default="distributed,tensor,disk")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE with the 30B's 128 experts a layer (see make_model)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=24310, help="the engine's port; the broadcast group uses port + 1")
    p.add_argument("--hang-s", type=float, default=900, help="a trainer rank that runs longer prints its stacks")
    p.add_argument("--delta", action="store_true", help="weight_sync.delta: full against delta (see above)")
    p.add_argument("--lrs", default="1e-6,1e-5", help="--delta: AdamW learning rates, one run each")
    p.add_argument("--steps", type=int, default=5, help="--delta: optimizer steps (delta syncs) after the full one")
    p.add_argument("--lr", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help="--delta: an HF checkpoint directory to use instead of the random model")
    p.add_argument("--draft", action="store_true", help="--delta: the engine with a speculative draft model (EAGLE)")
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.code = os.path.abspath(a.code)
    if a.worker:
        return worker(a)
    sys.path.insert(0, a.code)
    if a.delta:
        return main_delta(a)
    from standins import engine

    if not os.path.exists(os.path.join(a.code, "weight_sync.py")):  # the code before the rewrite: no tensor path
        a.methods = ",".join(m for m in a.methods.split(",") if m != "tensor")
    res = {"times": {}}
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, "model")
        n = make_model(model, a.moe)
        for method in a.methods.split(","):  # a fresh engine and trainer per method: every rank runs its config
            url, handle = engine.launch(model, port=a.port, dist_timeout=600, wait_timeout=600)
            try:
                one = run_workers(a, ["--model", model, "--url", url, "--run-dir", os.path.join(d, "run"),
                                      "--methods", method, "--repeats", str(a.repeats)],
                                  os.path.join(d, f"{method}.log"), 1800)
            finally:
                handle.stop()
            res["bytes"] = one["bytes"]
            res["times"].update(one["times"])
    gb = res["bytes"] / 1e9
    print(f"code {a.code}: {n / 1e6:.0f}M parameters{' (MoE)' if a.moe else ''} ({gb:.2f} GB float32), {a.ranks} "
          f"trainer ranks (gloo), one standins/engine.py, bucket_mb {a.bucket_mb}; shared, loaded machine")
    for method, times in res["times"].items():
        rest = statistics.median(times[1:]) if len(times) > 1 else times[0]
        print(f"  {method:<12} first {times[0]:6.2f} s ({gb / times[0]:.3f} GB/s)   then median {rest:6.2f} s "
              f"({gb / rest:.3f} GB/s) over {max(1, len(times) - 1)}")


if __name__ == "__main__":
    main()
