"""bench/gpu_smoke.py: the stages of bench/gpu_smoke.sh, the GPU paths that CPU CI cannot run (issue 27), one
function per stage, each run in its own subprocess with its own timeout; results as JSON in OUT/smoke.json and one
line per stage, each with its figures. A failing (or timed-out) stage does not stop the others; a stage the
preflight finds no module for is skipped, naming it, and a skipped stage fails the smoke (on cuda and in the dry
run alike: every stage can run on CPU).

  preflight    versions (python, torch, CUDA, transformers), GPU name and memory, which optional kernels and
               modules are installed, which stages can run;
  packing      tests/test_packing.py on the device for each installed attention kernel (eager on cpu, sdpa,
               flex_attention, flash_attention_2): the model with random norm gains (a fresh one attends near
               uniformly), packed rows equal the sequences alone given position_ids, the control without restarting
               positions differs, and model.token_logprobs packed equals padded;
  single_rank  a Qwen3 of hidden 2048, vocab 151,936 and 4 layers (tiny on cpu), FSDP2 on one rank (nccl), model
               fp32 with bf16 compute, activation checkpointing, packing, 16-24K-token micro-batches, trained through
               model.load_model and train.Actor.train_plan (the fused lm_head + log-softmax of model.token_logprobs):
               the measured peak against memory.memory_estimate, memory_reserved after the offload of parameters and
               optimizer state (< 0.5 GiB), and a step after an offload round trip equal to one without; then 2
               layers of Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of 768, top-8, the grouped_mm experts; tiny
               on cpu) trained the same way, its peak against the estimate (on cuda within 0.5-1.1x of it, less the
               CUDA context);
  moe          a tiny Qwen3-MoE trained one step under FSDP2 with routes set on its trajectories (routing replay,
               as train.py feeds the servers' routes: every expert call of the forward and of the checkpointed
               recompute runs the set experts, which the routers' own top-k does not), pushed in weight_sync's
               checkpoint names
               (plan_buckets / gather_bucket / hf_export.to_checkpoint) into standins/engine.py's loader (scheduler.load_tensors,
               checkpoint_targets) in this process: every name lands, the engine's log-probs equal the trainer's,
               and the control (the trainer's own fused names) leaves the experts behind and a large gap;
  colocate     train.py device=cuda colocate=true weight_sync.method=tensor on configs/tiny.yaml, 4 steps (standins/engine.py
               server, CUDA IPC pushes): per-phase memory (perf/memory_train_end, _before_push, _after_offload),
               train/rollout_logprob_diff_* after each sync, the HF export.

Run:  python3 bench/gpu_smoke.py --out DIR [--device cuda|cpu] [--only packing,moe]   (bench/gpu_smoke.sh wraps it)
--device cpu (SMOKE_DEVICE=cpu, the dry run): every stage's code with tiny sizes, float32, gloo, so CPU CI's machine
shows the script is not broken; the figures mean nothing there.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GIB = 2 ** 30
TOTAL_S = {"cuda": 560, "cpu": 2100}  # the whole smoke, all stages: one 10-minute call on the GPU machine
# (stage, timeout on cuda, on cpu, the modules it imports beyond torch and transformers). The cpu ones leave room for
# a shared 2-core machine: the dry run takes 51 s idle, 487 s at a load average of ~20 (flex_attention's CPU compile
# alone took > 180 s at 25).
STAGES = [("preflight", 45, 120, []),
          ("packing", 150, 480, ["yaml", "tokenizers", "safetensors"]),
          ("single_rank", 160, 480, ["yaml", "safetensors"]),
          ("moe", 75, 300, ["yaml", "tokenizers", "safetensors"]),
          ("colocate", 130, 720, ["yaml", "tokenizers", "safetensors", "aiohttp", "orjson", "numpy", "requests"])]
OPTIONAL = ["flash_attn", "yaml", "tokenizers", "safetensors", "aiohttp", "orjson", "numpy", "requests", "pyarrow",
            "math_verify", "sglang"]
# Sizes per device: the realistic ones on cuda, tiny on cpu.
SIZES = {
    "cuda": {"dtype": "bfloat16", "hidden": 2048, "inter": 6144, "heads": 16, "kv": 8, "head_dim": 128,
             "vocab": 151936, "layers": 4, "micro_tokens": 20480, "seq_scale": 1},
    "cpu": {"dtype": "float32", "hidden": 64, "inter": 128, "heads": 4, "kv": 2, "head_dim": 16, "vocab": 512,
            "layers": 2, "micro_tokens": 320, "seq_scale": 64},
}
# single_rank's MoE: 2 decoder layers of Qwen3-30B-A3B (its config.json) on cuda, a tiny MoE on cpu
MOE_SIZES = {
    "cuda": {"hidden": 2048, "moe_inter": 768, "experts": 128, "top_k": 8, "heads": 32, "kv": 4, "head_dim": 128,
             "vocab": 151936, "layers": 2},
    "cpu": {"hidden": 64, "moe_inter": 32, "experts": 8, "top_k": 2, "heads": 4, "kv": 2, "head_dim": 16,
            "vocab": 512, "layers": 2},
}


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------

def _free_port() -> int:
    from services import free_port  # below the kernel's ephemeral ports, as train.py's own

    return free_port()


def _device(ctx):
    import torch

    return torch.device("cuda", 0) if ctx["device"] == "cuda" else torch.device("cpu")


def _dist_init(device):
    """One-rank process group (nccl on cuda, gloo on cpu); returns train.py's gloo control group, as train.main
    sets them up."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=300))


def _cfg(ctx, *overrides):
    import config

    return config.load_config(None, [f"device={ctx['device']}", "colocate=false", "fully_async.enable=false",
                                     *overrides])


def _seqs(lengths, vocab: int, seed: int = 0) -> list:
    """Random trajectories as batching.make_sequences returns them (tests/test_packing.py _seqs)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in lengths:
        out.append({"prompt": torch.randint(3, vocab, (p,), generator=g).tolist(),
                    "response": torch.randint(3, vocab, (r,), generator=g).tolist(),
                    "mask": (torch.rand(r, generator=g) > 0.2).long().tolist(),
                    "rollout_lp": (-torch.rand(r, generator=g) * 3).tolist(), "versions": [0] * r,
                    "adv": float(torch.randn((), generator=g))})
    return out


def _plan(cfg, seqs) -> tuple:
    """Packed micro-batches of one rank and the loss denominator, as Actor.train_minibatch makes them."""
    import batching
    import losses

    plan = [batching.collate(mb, packing=True)
            for mb in batching.plan_micro_batches(seqs, cfg.trainer.micro_batch_tokens, packing=True)]
    denom = sum(losses.loss_denominator(mb["mask"], cfg.algorithm.loss_agg_mode, cfg.rollout.sampling.max_new_tokens)
                for mb in plan)
    return plan, denom


def _sharpen(model, seed: int = 0) -> None:
    """Random norm gains (tests/test_packing.py _model): a fresh tiny model's attention would be near uniform."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_((1 + torch.randn(p.shape, generator=g)).to(p.dtype))


def _installed_kernels(device_type: str) -> list:
    """The attention kernels to check: flash_attention_2 where transformers accepts it (model.flash_attn_2_available:
    sglang's flash-attn-4 leaves a flash_attn namespace package that find_spec finds and transformers refuses)."""
    import model as model_lib

    impls = (["eager"] if device_type == "cpu" else []) + ["sdpa", "flex_attention"]
    return impls + (["flash_attention_2"] if device_type == "cuda" and model_lib.flash_attn_2_available() else [])


# ---------------------------------------------------------------------------------------------------------------
# stages: each returns {"figures": {...}, "checks": {name: bool}, "line": one-line summary}
# ---------------------------------------------------------------------------------------------------------------

def stage_preflight(ctx) -> dict:
    import torch
    import transformers

    f = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        f.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / GIB, 1), capability=f"{p.major}.{p.minor}")
        with contextlib.suppress(Exception):
            f["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    f["modules"] = {m: importlib.util.find_spec(m) is not None for m in OPTIONAL}
    f["attention_kernels"] = _installed_kernels(ctx["device"])
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        f["flex_attention_importable"] = True
    except Exception:
        f["flex_attention_importable"] = False
    f["stages"] = {}
    for name, _, _, needs in STAGES[1:]:
        missing = [m for m in needs if not f["modules"][m]]
        f["stages"][name] = {"can_run": not missing, "missing": missing}
    checks = {"device_visible": ctx["device"] == "cpu" or torch.cuda.is_available()}
    runnable = [n for n, s in f["stages"].items() if s["can_run"]]
    line = (f"torch {f['torch']} (cuda {f['cuda']}), transformers {f['transformers']}, python {f['python']}, "
            f"{f.get('gpu', 'no GPU')} {f.get('gpu_memory_gib', '')}; kernels {f['attention_kernels']}; "
            f"can run {runnable}")
    return {"figures": f, "checks": checks, "line": line}


def stage_packing(ctx) -> dict:
    """tests/test_packing.py on the device: for each kernel, packed vs alone (must be ~0) against the control that
    does not restart the positions (must be large: the second sequence then attends to the first), and
    model.token_logprobs of a packed micro-batch vs the padded one."""
    import torch
    from transformers import AutoModelForCausalLM

    import batching
    import model as model_lib
    from standins import tiny_model

    device, dtype = _device(ctx), getattr(torch, SIZES[ctx["device"]]["dtype"])
    path = tiny_model.make_tiny_model(os.path.join(ctx["work"], "packing_model"))
    figures, checks, parts = {"dtype": str(dtype)}, {}, []
    seqs = _seqs([(5, 9), (3, 2), (7, 14), (4, 1), (6, 6)], 90)
    for impl in _installed_kernels(device.type):
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=dtype).to(device)
            _sharpen(model)
            model.eval()
            g = torch.Generator().manual_seed(1)
            a, b = (torch.randint(3, 90, (1, n), generator=g).to(device) for n in (9, 6))
            ids = torch.cat([a, b], 1)
            with torch.no_grad():
                alone = [model(input_ids=x, use_cache=False).logits[0].float() for x in (a, b)]
                pos = torch.cat([torch.arange(9), torch.arange(6)]).to(device)[None]
                packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
                run_on = model(input_ids=ids, position_ids=torch.arange(15, device=device)[None],
                               use_cache=False).logits[0].float()
                gap = max(float((packed[:9] - alone[0]).abs().max()), float((packed[9:] - alone[1]).abs().max()))
                control = float((run_on[9:] - alone[1]).abs().max())
                lp = {}
                for pack in (False, True):
                    mb = {k: v.to(device) if isinstance(v, torch.Tensor) else v  # max_len: an int
                          for k, v in batching.collate(seqs, packing=pack).items()}
                    lp[pack] = model_lib.token_logprobs(model, mb, 1.0, 16)[0] * mb["mask"]
                lp_gap = float((lp[True] - lp[False]).abs().max())
            figures[impl] = {"packed_vs_alone_max": gap, "control_max": control, "packed_vs_padded_logp_max": lp_gap}
            # scale-free: the packing error a small fraction of what one sequence attending to the other gives
            checks[impl] = control > 0.5 and gap < 0.1 * control and lp_gap < 0.1 * control
            parts.append(f"{impl} gap {gap:.2g} control {control:.2g} logp {lp_gap:.2g}")
            del model
        except Exception as e:
            figures[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            checks[impl] = False
            parts.append(f"{impl} ERROR {figures[impl]['error'][:80]}")
    return {"figures": figures, "checks": checks, "line": "; ".join(parts)}


def _big_model(ctx) -> str:
    """A Qwen3 with the realistic widths (tiny on cpu), random weights, saved in bfloat16 (fp32 on cpu)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = SIZES[ctx["device"]]
    path = os.path.join(ctx["work"], "big_model")
    cfg = Qwen3Config(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                      head_dim=s["head_dim"], max_position_embeddings=32768, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda" if ctx["device"] == "cuda" else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, s["dtype"]))
    model.save_pretrained(path)
    del model
    return path


def _estimate(cfg, model, world: int, device_type: str) -> dict:
    """memory.memory_estimate of this model and config, as train.py prints it at start-up."""
    import memory

    n, largest = memory.param_counts(model)
    est = memory.memory_estimate(cfg, n, largest, world, device_type, memory.model_shape(model))
    return json.loads(json.dumps(est, default=float))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _state(actor) -> dict:
    """This rank's parameter shards, AdamW state and scheduler state, copied to host memory."""
    params = list(actor.model.parameters())
    return {"params": [_local(p).detach().cpu().clone() for p in params],
            "opt": [{k: _local(v).detach().cpu().clone() for k, v in actor.opt.state[p].items()} for p in params],
            "sched": copy.deepcopy(actor.sched.state_dict())}


def _restore(actor, s: dict) -> None:
    """Copy a _state back in place (the tensors stay where they are: on the device, as DTensor shards)."""
    import torch

    with torch.no_grad():
        for p, x, st in zip(actor.model.parameters(), s["params"], s["opt"]):
            _local(p).copy_(x)
            for k, v in actor.opt.state[p].items():
                _local(v).copy_(st[k])
    actor.sched.load_state_dict(s["sched"])
    actor.old.shards, actor.old.step = None, -1


def stage_single_rank(ctx) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import memory
    import model as model_lib
    import train

    device, s = _device(ctx), SIZES[ctx["device"]]
    ctrl = _dist_init(device)
    path = _big_model(ctx)
    cfg = _cfg(ctx, f"model.path={path}", "model.dtype=float32", "model.activation_checkpointing=true",
               "trainer.packing=true", f"trainer.micro_batch_tokens={s['micro_tokens']}", "trainer.lr=1e-5",
               "trainer.logprob_chunk_tokens=1024", f"run_dir={os.path.join(ctx['work'], 'single_rank_run')}")
    model, _ = model_lib.load_model(cfg, init_device_mesh(device.type, (1,)), device, 0, ctrl)
    opt, sched = model_lib.build_optimizer(model, cfg.trainer)
    actor = train.Actor(cfg, model, opt, sched, device, ctrl)
    k = s["seq_scale"]
    # ~40K tokens of 512-token prompts and 1.5-3.9K-token responses: two packed micro-batches of 18-20K tokens
    lengths = [(512 // k, r // k) for r in (3900, 3500, 3300, 3100, 2900, 2700, 2500, 2300, 2100, 1900, 1700, 1500)]
    plan_a, denom_a = _plan(cfg, _seqs(lengths, s["vocab"], seed=1))
    plan_b, denom_b = _plan(cfg, _seqs(lengths, s["vocab"], seed=2))
    f = {"attn_implementation": model_lib.attn_implementation(cfg, device), "micro_batch_tokens": [
        int(mb["ids"].shape[1]) for mb in plan_b], "parameters": memory.param_counts(model)[0],
         "calls_per_step": cfg.calls_per_step}
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    actor.train_plan(plan_a, 0, denom_a)  # step 0: Adam's moments exist from here
    f["first_step_s"] = time.perf_counter() - t0
    start = _state(actor)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    ref = actor.train_plan(plan_b, 1, denom_b)
    f["step_s"] = time.perf_counter() - t0
    f["peak_allocated_gib"] = ref["perf/train_memory_allocated_max"]
    f["peak_reserved_gib"] = ref["perf/train_memory_reserved_max"]
    f["estimate"] = _estimate(cfg, model, 1, device.type)
    est_dev = f["estimate"].get("device")
    f["peak_over_estimate"] = f["peak_allocated_gib"] / est_dev if est_dev else None
    ref_params = [_local(p).detach().cpu().clone() for p in model.parameters()]
    actor.old.drop()
    f.update(actor.colocate.leave_for_push())  # colocate's order before SGLang's weights come back: optimizer off
    _restore(actor, start)
    # the offload round trip of colocate (Colocate.after_push's offload, memory_to_trainer's onload) with the same
    # start state
    actor.colocate.offload("cpu")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        f["offloaded_reserved_gib"] = torch.cuda.memory_reserved(device) / GIB
        f["offloaded_allocated_gib"] = torch.cuda.memory_allocated(device) / GIB
        f["offloaded_live_tensors"] = _live_cuda_tensors()  # what still holds device memory, if anything
    actor.colocate.offload(device)
    again = actor.train_plan(plan_b, 1, denom_b)
    rt = [_local(p).detach().cpu() for p in model.parameters()]
    upd = sum(float((r - s0).abs().sum()) for r, s0 in zip(ref_params, start["params"]))
    diff = sum(float((r - x).abs().sum()) for r, x in zip(ref_params, rt))
    f.update(loss=ref["train/loss"], loss_after_round_trip=again["train/loss"],
             param_update_abs_sum=upd, round_trip_param_diff_abs_sum=diff,
             round_trip_param_diff_max=max(float((r - x).abs().max()) for r, x in zip(ref_params, rt)))
    tol = 1e-3 if cuda else 1e-6
    checks = {"peak_measured": f["peak_allocated_gib"] > 0,
              "estimate_answered": "error" not in f["estimate"],
              "offload_frees": f.get("offloaded_reserved_gib", 0.0) < 0.5,
              "round_trip_loss_equal": abs(again["train/loss"] - ref["train/loss"])
              <= tol * max(1.0, abs(ref["train/loss"])),
              "round_trip_params_equal": upd > 0 and diff <= 1e-2 * upd}
    line = (f"{f['parameters'] / 1e6:.0f}M params, micro-batches {f['micro_batch_tokens']} tokens "
            f"({f['attn_implementation']}): peak {f['peak_allocated_gib']:.2f} GiB allocated "
            f"({f['peak_reserved_gib']:.2f} reserved) vs estimate {est_dev if est_dev is None else round(est_dev, 2)}"
            f" GiB; offloaded reserved {f.get('offloaded_reserved_gib', float('nan')):.3f} GiB; round trip loss "
            f"{ref['train/loss']:.6g} vs {again['train/loss']:.6g}, params diff/update {diff / max(upd, 1e-30):.2g}")
    if cuda:  # the estimate (less the CUDA context, which max_memory_allocated does not see) bounds the peak
        checks["peak_within_estimate"] = 0.5 <= _peak_ratio(f) <= 1.1
    del actor, model, opt, sched, start, ref_params, rt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    f["moe"] = _single_rank_moe(ctx, device, ctrl, lengths)
    checks.update({f"moe_{k}": v for k, v in f["moe"].pop("checks").items()})
    m = f["moe"]
    line += (f"; MoE {m['parameters'] / 1e6:.0f}M params ({m['experts']} experts, top-{m['top_k']}): peak "
             f"{m['peak_allocated_gib']:.2f} GiB vs estimate {m['estimate']['device']:.2f} GiB (recomputed layer "
             f"{m['estimate']['parts'].get('recomputed layer', 0):.2f}), step {m['step_s']:.1f} s")
    return {"figures": f, "checks": checks, "line": line}


def _peak_ratio(f: dict) -> float:
    """Measured peak allocated / the estimate's device total less the CUDA context (not an allocation)."""
    import memory

    return f["peak_allocated_gib"] / max(f["estimate"]["device"] - memory.CUDA_RUNTIME_GIB, 1e-9)


def _single_rank_moe(ctx, device, ctrl, lengths: list) -> dict:
    """single_rank's MoE part: 2 layers of Qwen3-30B-A3B's shapes (MOE_SIZES; tiny on cpu), random weights saved in
    bf16 (fp32 on cpu), loaded and trained as the dense model: a step's peak against memory.memory_estimate, whose
    recomputed layer counts the grouped_mm experts' tokens x top-k rows."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import memory
    import model as model_lib
    import train

    m, s = MOE_SIZES[ctx["device"]], SIZES[ctx["device"]]
    path = os.path.join(ctx["work"], "moe_widths")
    hf = Qwen3MoeConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=3 * m["hidden"],
                        moe_intermediate_size=m["moe_inter"], num_experts=m["experts"], num_experts_per_tok=m["top_k"],
                        num_hidden_layers=m["layers"], num_attention_heads=m["heads"], num_key_value_heads=m["kv"],
                        head_dim=m["head_dim"], norm_topk_prob=True, max_position_embeddings=32768,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        Qwen3MoeForCausalLM(hf).to(getattr(torch, s["dtype"])).save_pretrained(path)
    cfg = _cfg(ctx, f"model.path={path}", "model.dtype=float32", "model.activation_checkpointing=true",
               "trainer.packing=true", f"trainer.micro_batch_tokens={s['micro_tokens']}", "trainer.lr=1e-5",
               "trainer.logprob_chunk_tokens=1024", f"run_dir={os.path.join(ctx['work'], 'single_rank_moe_run')}")
    model, _ = model_lib.load_model(cfg, init_device_mesh(device.type, (1,)), device, 0, ctrl)
    opt, sched = model_lib.build_optimizer(model, cfg.trainer)
    actor = train.Actor(cfg, model, opt, sched, device, ctrl)
    plan_a, denom_a = _plan(cfg, _seqs(lengths, m["vocab"], seed=1))
    plan_b, denom_b = _plan(cfg, _seqs(lengths, m["vocab"], seed=2))
    actor.train_plan(plan_a, 0, denom_a)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    out = actor.train_plan(plan_b, 1, denom_b)
    f = {"parameters": memory.param_counts(model)[0], "experts": m["experts"], "top_k": m["top_k"],
         "hidden": m["hidden"], "layers": m["layers"], "micro_batch_tokens": [int(mb["ids"].shape[1]) for mb in plan_b],
         "step_s": time.perf_counter() - t0, "loss": out["train/loss"],
         "peak_allocated_gib": out["perf/train_memory_allocated_max"],
         "peak_reserved_gib": out["perf/train_memory_reserved_max"], "estimate": _estimate(cfg, model, 1, device.type)}
    f["peak_over_estimate"] = _peak_ratio(f) if cuda else None
    f["checks"] = {"trained": math.isfinite(out["train/loss"]) and out["train/grad_norm"] > 0,
                   "estimate_counts_the_experts": f["estimate"]["parts"].get("recomputed layer", 0) > 0}
    if cuda:
        f["checks"]["peak_within_estimate"] = 0.5 <= f["peak_over_estimate"] <= 1.1
    del actor, model, opt, sched
    gc.collect()
    return f


def _live_cuda_tensors(top: int = 6) -> list:
    """The largest CUDA tensors Python can still reach (shape, dtype, MiB): what an offload left behind."""
    import torch

    seen, out = set(), []
    with warnings.catch_warnings():  # isinstance on some module objects warns about deprecated attributes
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if type(o) in (torch.Tensor, torch.nn.Parameter) and o.is_cuda and id(o) not in seen:
                    seen.add(id(o))  # exact types: compile's FakeTensors have symbolic sizes that cannot compare
                    out.append((int(o.untyped_storage().nbytes()) / 2 ** 20, [int(d) for d in o.shape],
                                str(o.dtype)))
            except Exception:  # objects that raise on isinstance/attribute access
                continue
    return [{"mib": round(m, 2), "shape": sh, "dtype": dt} for m, sh, dt in sorted(out, reverse=True)[:top]]


def _make_moe(path: str, seed: int) -> str:
    from standins import tiny_model

    return tiny_model.make_sharp_model(path, seed, num_experts=8)  # tests/test_moe.py's tiny MoE


def stage_moe(ctx) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    import logprobs
    import model as model_lib
    import moe as moe_lib
    from standins import scheduler
    import train
    import weight_sync

    device = _device(ctx)
    ctrl = _dist_init(device)
    a, b = (_make_moe(os.path.join(ctx["work"], f"moe_{k}"), seed) for k, seed in (("A", 0), ("B", 1)))
    cfg = _cfg(ctx, f"model.path={b}", "trainer.packing=true", "trainer.micro_batch_tokens=512", "trainer.lr=1e-2",
               "model.activation_checkpointing=true", "algorithm.routing_replay=true",
               # attention: auto, so flex_attention on a GPU without flash-attn: this stage's ~110-token packed rows
               # are what failed to compile on the H200 before model.token_logprobs padded them (FLEX_MIN_TOKENS)
               f"run_dir={os.path.join(ctx['work'], 'moe_run')}")
    model, _ = model_lib.load_model(cfg, init_device_mesh(device.type, (1,)), device, 0, ctrl)
    opt, sched = model_lib.build_optimizer(model, cfg.trainer)
    actor = train.Actor(cfg, model, opt, sched, device, ctrl)
    # routing replay as train.py feeds it: each trajectory's routes (the servers' [positions, layers, top-k]; here
    # k distinct random experts a position, which the routers' own top-k would not pick) collated into the batch
    hc = model.config
    seqs = _seqs([(6, 20), (4, 30), (8, 12), (5, 25)], 90, seed=3)
    g = torch.Generator().manual_seed(5)
    for sq in seqs:
        n = len(sq["prompt"]) + len(sq["response"])
        sq["routes"] = torch.stack([torch.randperm(hc.num_experts, generator=g)[:hc.num_experts_per_tok]
                                    for _ in range(n * hc.num_hidden_layers)]).view(n, hc.num_hidden_layers, -1).int()
    plan, denom = _plan(cfg, seqs)
    calls: dict = {}
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda mod, args, i=i: calls.setdefault(i, []).append(args[1].detach().cpu().long()))
        for i, layer in enumerate(model.model.layers)]
    step = actor.train_plan(plan, 0, denom)
    want = [plan[0]["routes"][0, :, i].long() for i in range(hc.num_hidden_layers)]  # one packed micro-batch
    replayed = {i: [torch.equal(c, want[i]) for c in cs] for i, cs in calls.items()}
    moe_lib.set_routes(model, None)
    calls.clear()
    model.eval()
    with torch.no_grad():  # the control: the routers' own top-k on the same packed row
        model_lib.token_logprobs(model, {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                         for k, v in plan[0].items() if k != "routes"}, 1.0, 1024)
    model_lib.reshard(model)
    model.train()
    own_differs = sum(int((calls[i][0].sort(-1).values != want[i].sort(-1).values).any(-1).sum())
                      for i in calls)
    for h in hooks:
        h.remove()
    dtype = actor.weights.dtype  # the servers' dtype: bf16 on cuda
    converted = [nt for spec in weight_sync.plan_buckets(model, dtype, 1)
                 for nt in weight_sync.gather_bucket(model, spec, dtype, device).named]
    fused = [(n, p.full_tensor().to(dtype) if hasattr(p, "full_tensor") else p.detach().to(dtype))
             for n, p in model.named_parameters()]
    served = scheduler.load_model(a, device, str(dtype).removeprefix("torch."))
    engine = scheduler.Scheduler(served, AutoTokenizer.from_pretrained(a), device, 8, 4096, "0")
    targets = scheduler.checkpoint_targets(served)
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(4)).to(device)
    model.eval()
    with torch.no_grad():
        trainer_lp = model_lib.token_logprobs(model, {"ids": ids, "attn": torch.ones_like(ids)}, 1.0, 1024)[0]
    model_lib.reshard(model)

    def gap() -> float:
        with torch.no_grad():
            logits = served(input_ids=ids, use_cache=False).logits.float()[:, :-1]
            lp, _ = logprobs.token_logprobs(logits, ids[:, 1:], 1.0)
        return float((lp - trainer_lp).abs().max())

    f = {"train_loss": step["train/loss"], "grad_norm": step["train/grad_norm"], "dtype": str(dtype),
         "replayed_expert_calls": sum(map(len, replayed.values())),
         "replayed_calls_matching": sum(map(sum, replayed.values())),
         "own_topk_tokens_differing": own_differs, "tokens": int(want[0].shape[0]), "gap_before_push": gap()}
    engine.load_tensors(fused, "1")
    f["gap_fused_names"] = gap()
    f["fused_names_skipped"] = sum(n not in targets for n, _ in fused)
    engine.load_tensors(converted, "2")
    f["gap_checkpoint_names"] = gap()
    names = {n for n, _ in converted}
    tied = {n for n in targets if n not in names and served.config.tie_word_embeddings
            and n == "lm_head.weight"}
    f.update(pushed=len(names), unknown_to_engine=sorted(names - set(targets))[:10],
             not_pushed=sorted(set(targets) - names - tied)[:10], engine_version=engine.weight_version)
    tol = 0.25 if device.type == "cuda" else 1e-4  # bf16 on both sides on cuda, but different kernels
    checks = {"routes_replayed": f["replayed_expert_calls"] >= 2 * hc.num_hidden_layers  # forward + recompute
              and f["replayed_calls_matching"] == f["replayed_expert_calls"],
              "own_topk_differs": f["own_topk_tokens_differing"] > 0,
              "every_name_lands": not f["unknown_to_engine"] and not f["not_pushed"],
              "fused_names_skipped": f["fused_names_skipped"] > 0,
              "gap_small": f["gap_checkpoint_names"] < tol,
              "control_gap_large": f["gap_fused_names"] > max(0.1, 4 * f["gap_checkpoint_names"])}
    line = (f"routes replayed in {f['replayed_calls_matching']} of {f['replayed_expert_calls']} expert calls "
            f"(own top-k differs on {own_differs} token-layers); "
            f"{len(names)} checkpoint names pushed, {len(f['unknown_to_engine'])} unknown, {len(f['not_pushed'])} "
            f"missing; log-prob gap engine vs trainer {f['gap_checkpoint_names']:.3g} (fused names: "
            f"{f['gap_fused_names']:.3g}, {f['fused_names_skipped']} skipped; before any push "
            f"{f['gap_before_push']:.3g})")
    return {"figures": f, "checks": checks, "line": line}


def stage_colocate(ctx) -> dict:
    cuda = ctx["device"] == "cuda"
    work = os.path.join(ctx["work"], "colocate")
    run_dir = os.path.join(work, "run")
    steps = 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "train.py",
           "--config", "configs/tiny.yaml", f"device={ctx['device']}", "colocate=true", "fully_async.enable=false",
           "rollout.partial=false", "rollout.mask_offpolicy_in_partial_rollout=false", "weight_sync.method=tensor",
           "trainer.packing=true", "trainer.num_gpus_per_node=1", f"model.path={os.path.join(work, 'base')}",
           "model.tiny_pretrain_steps=30", f"run_dir={run_dir}", "data_source.num_prompts=256",
           "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=8",
           "trainer.mini_batch_size=32", f"trainer.total_steps={steps}", "trainer.eval_freq=0",
           "trainer.save_freq=0", "trainer.lr=0.01", "rollout.filter=[failed]", f"rollout.base_port={_free_port()}",
           "buffer.get_timeout_s=120", "rollout.startup_timeout_s=120"]
    log = os.path.join(ctx["out"], "logs", "colocate_train.log")
    with open(log, "w") as fh:
        p = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=ctx["timeout"] - 15,
                           start_new_session=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(x) for x in open(metrics) if x.strip()] if os.path.exists(metrics) else []
    keys = ["train/rollout_logprob_diff_max", "train/rollout_logprob_diff_mean", "perf/memory_train_end",
            "perf/memory_before_push", "perf/memory_after_offload", "perf/train_memory_allocated_max",
            "perf/weight_sync_gbps", "train/grad_norm", "timing/step"]
    f = {"returncode": p.returncode, "steps": [r["step"] for r in rows],
         "per_step": [{k: r.get(k) for k in keys} for r in rows]}
    if rows:
        last = rows[-1]
        f["last"] = {k: last.get(k) for k in keys}
    tol_max, tol_mean = (1.0, 0.05) if cuda else (1e-4, 1e-5)  # bf16 engine and trainer on cuda, fp32 on cpu
    last = rows[-1] if rows else {}

    def num(k):
        v = last.get(k)
        return v if isinstance(v, (int, float)) and math.isfinite(v) else None

    def fmt(k):
        return "n/a" if num(k) is None else f"{num(k):.3g}"

    checks = {"ran": p.returncode == 0 and f["steps"] == list(range(1, steps + 1)),
              "logprob_after_last_sync": num("train/rollout_logprob_diff_max") is not None
              and num("train/rollout_logprob_diff_max") < tol_max
              and num("train/rollout_logprob_diff_mean") < tol_mean,
              "memory_metrics": all(num(k) is not None for k in keys[2:5]),
              "hf_export": os.path.exists(os.path.join(run_dir, "hf", "config.json"))}
    if cuda and checks["memory_metrics"]:  # the offload gave memory back before the KV cache returns
        checks["offload_lowers_memory"] = num("perf/memory_after_offload") < num("perf/memory_train_end")
    if os.path.exists(metrics):
        with open(metrics) as src, open(os.path.join(ctx["out"], "logs", "colocate_metrics.jsonl"), "w") as dst:
            dst.write(src.read())
    line = (f"rc {p.returncode}, steps {f['steps']}; last step: log-prob diff max "
            f"{fmt('train/rollout_logprob_diff_max')} mean {fmt('train/rollout_logprob_diff_mean')}; memory GiB "
            f"train end {fmt('perf/memory_train_end')}, before push {fmt('perf/memory_before_push')}, after "
            f"offload {fmt('perf/memory_after_offload')}; weight sync {fmt('perf/weight_sync_gbps')} GB/s")
    return {"figures": f, "checks": checks, "line": line}


# ---------------------------------------------------------------------------------------------------------------
# driver: one subprocess per stage
# ---------------------------------------------------------------------------------------------------------------

def _child(args) -> int:
    ctx = {"device": args.device, "work": args.work, "out": args.out, "timeout": args.timeout}
    t0 = time.perf_counter()
    try:
        res = globals()[f"stage_{args.stage}"](ctx)
        res["status"] = "pass" if all(res["checks"].values()) else "fail"
    except Exception as e:
        traceback.print_exc()
        first = str(e).splitlines()[0][:200] if str(e) else ""
        res = {"status": "fail", "figures": {}, "checks": {}, "error": f"{type(e).__name__}: {str(e)[:2000]}",
               "line": f"ERROR {type(e).__name__}: {first}"}
    res["seconds"] = round(time.perf_counter() - t0, 2)
    with open(args.result, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    sys.stdout.flush()
    os._exit(0)  # no teardown of NCCL / the engine's threads: the parent reads the JSON


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu_smoke"))
    ap.add_argument("--device", default=os.environ.get("SMOKE_DEVICE", "cuda"), choices=["cuda", "cpu"])
    ap.add_argument("--only", default="", help="comma-separated stages (preflight always runs)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        return _child(args)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    work = os.environ.get("SMOKE_WORK") or os.path.join("/tmp", f"gpu_smoke_{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    only = {s for s in args.only.split(",") if s}
    if only - {n for n, *_ in STAGES}:
        ap.error(f"--only takes stages among {', '.join(n for n, *_ in STAGES)}, got {sorted(only)}")
    start = time.perf_counter()
    deadline = start + TOTAL_S[args.device]
    report = {"device": args.device, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "work": work, "stages": {}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    can_run = {}
    for name, t_cuda, t_cpu, _ in STAGES:
        if only and name not in only and name != "preflight":
            continue
        if name in can_run and not can_run[name]["can_run"]:
            res = {"status": "skipped", "line": f"skipped: missing {can_run[name]['missing']}", "seconds": 0}
        elif deadline - time.perf_counter() < 20:
            res = {"status": "skipped", "line": f"skipped: the {TOTAL_S[args.device]} s budget is spent", "seconds": 0}
        else:
            timeout = min(t_cuda if args.device == "cuda" else t_cpu, deadline - time.perf_counter())
            res = _run_stage(name, args, work, env, timeout)
        if name == "preflight" and "stages" in res.get("figures", {}):
            can_run = res["figures"]["stages"]
        report["stages"][name] = res
        print(f"[gpu_smoke] {name:<11} {res['status'].upper():<7} {res.get('seconds', 0):6.1f} s  {res['line']}",
              flush=True)
        _write(args.out, report, start)
    ran = [r["status"] for r in report["stages"].values()]
    report["passed"] = bool(ran) and all(s == "pass" for s in ran)  # a skipped stage showed nothing: it fails
    _write(args.out, report, start)
    print(f"[gpu_smoke] {'PASS' if report['passed'] else 'FAIL'}: "
          + ", ".join(f"{n} {r['status']}" for n, r in report["stages"].items())
          + f"; {report['wall_s']:.0f} s; {os.path.join(args.out, 'smoke.json')}", flush=True)
    return 0 if report["passed"] else 1


def _write(out: str, report: dict, start: float) -> None:
    report["wall_s"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(out, "smoke.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)


def _run_stage(name: str, args, work: str, env: dict, timeout: float) -> dict:
    result = os.path.join(work, f"{name}.json")
    with open(os.path.join(args.out, "logs", f"{name}.log"), "w") as log:
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--stage", name, "--device", args.device,
                              "--work", work, "--out", args.out, "--result", result, "--timeout", str(timeout)],
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.perf_counter()
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the stage's own process group (its torchrun, engine, ...)
            p.wait()
            return {"status": "timeout", "seconds": round(time.perf_counter() - t0, 1),
                    "line": f"timed out after {timeout:.0f} s (logs/{name}.log)"}
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)  # anything the stage left running in its group
    if not os.path.exists(result):
        return {"status": "fail", "seconds": round(time.perf_counter() - t0, 1),
                "line": f"exited {p.returncode} without a result (logs/{name}.log)"}
    with open(result) as fh:
        return json.load(fh)


if __name__ == "__main__":
    sys.exit(main())
