"""Which packed rows flex_attention trains on, on this GPU: one packed forward and backward of a tiny Qwen3 (dense
and MoE) through transformers' flex_attention path, per head_dim, dtype and packed length. Evidence for
model.FLEX_MIN_TOKENS: on an H200 (torch 2.11) every 110-token case failed in inductor ("NoValidChoicesError: No
choices to select"), whatever the head_dim, dtype, MoE or checkpointing, while 200 tokens (head_dim 128) and 1,100
(head_dim 16) compiled (docs/results/gpu_smoke.md). Each case runs in its own process (in one process a failed
compile leaves dynamo's state to the next case). Prints one JSON line per case; --out FILE also writes them.

    python3 bench/flex_probe.py [--out runs/flex_probe.json] [--device cuda] [--cases "dense,16,bfloat16,0,600:500;..."]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback

import torch


def case(kind: str, head_dim: int, dtype: torch.dtype, device: str, ckpt: bool = False, lengths=(60, 50)) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    heads, kv = 4, 2
    common = dict(vocab_size=512, hidden_size=heads * head_dim, num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=4096)
    if kind == "moe":
        cfg = Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                             intermediate_size=64)
        cls = Qwen3MoeForCausalLM
    else:
        cfg = Qwen3Config(**common, intermediate_size=4 * heads * head_dim)
        cls = Qwen3ForCausalLM
    cfg._attn_implementation = "flex_attention"
    torch.manual_seed(0)
    model = cls(cfg).to(device=device, dtype=dtype)
    if ckpt:  # layers recomputed in the backward, as model.activation_checkpointing does
        model.gradient_checkpointing_enable()
        model.train()
    n = sum(lengths)
    ids = torch.randint(3, 512, (1, n), device=device)
    pos = torch.cat([torch.arange(k) for k in lengths]).view(1, n).to(device)  # packed: positions restart
    out = {"kind": kind, "head_dim": head_dim, "dtype": str(dtype).split(".")[-1], "tokens": n,
           "checkpointing": ckpt}
    t0 = time.perf_counter()
    try:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        logits.float().logsumexp(-1).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        out["ok"] = True
    except Exception as e:  # the failure is the finding
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out["where"] = traceback.format_exc().splitlines()[-1][:200]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default=None, help="kind,head_dim,dtype,checkpointing[,len:len...] cases joined by ';'")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in this process (the child)
    args = ap.parse_args()
    if args.case:
        kind, hd, dt, ckpt, lens = (args.case.split(",") + ["60:50"])[:5]
        lengths = tuple(int(k) for k in lens.split(":"))
        print(json.dumps(case(kind, int(hd), getattr(torch, dt), args.device, ckpt == "1", lengths)), flush=True)
        return
    cases = args.cases.split(";") if args.cases else [
        "dense,16,bfloat16,0", "dense,16,float32,0", "moe,16,bfloat16,0", "moe,16,bfloat16,1",
        "dense,32,bfloat16,0", "dense,64,bfloat16,0", "moe,64,bfloat16,1", "dense,128,bfloat16,0",
        "dense,128,bfloat16,0,64:64", "dense,128,bfloat16,0,100:100", "dense,16,bfloat16,0,600:500",
        "moe,16,bfloat16,1,150:106"]
    res = []
    for c in cases:  # each in a fresh process: a failed compile cannot leave state (dynamo's caches) to the next
        p = subprocess.run([sys.executable, __file__, "--device", args.device, "--case", c], capture_output=True,
                           text=True, timeout=300)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("{")), None)
        r = json.loads(line) if line else {"case": c, "ok": False, "error": f"exit {p.returncode}: "
                                           f"{(p.stderr.strip().splitlines() or [''])[-1][:200]}"}
        print(json.dumps(r), flush=True)
        res.append(r)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"torch": torch.__version__, "device": args.device, "cases": res}, fh, indent=1)


if __name__ == "__main__":
    main()
