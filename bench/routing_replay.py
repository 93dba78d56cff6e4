"""bench/routing_replay.py: how often the trainer's MoE routers disagree with the server's, with and without rollout
routing replay (algorithm.routing_replay, moe.py), when the trainer's weights differ from the server's by
bf16-sized noise (each weight times 1 + eps * N(0, 1), eps = 2^-8: bfloat16's rounding error, as between a bf16
server and a trainer's fp32 master weights or bf16 kernels that add in another order).

standins/engine.py (--enable-return-routed-experts) serves the tiny Qwen3-MoE base of configs/tiny_moe.yaml and samples
responses to reverse_digits prompts (temperature 1, as rollouts do), returning each position's experts; the trainer's
forward (batching.collate + model.token_logprobs, fp32, no FSDP) runs on the same tokens with the noisy weights, and
the experts its MoE blocks actually ran with are read at their input. Printed per noise level:
  decisions   % of (token, layer) router decisions whose top-k set differs from the server's (Megatron-LM#4168
              reports ~10% per forward pass for Qwen3-30B-A3B between SGLang/vLLM and Megatron);
  tokens      % of tokens that differ in at least one layer;
  lp gap      mean and max |trainer - server| log-prob over the response tokens.

Run: python bench/routing_replay.py [--model runs/tiny-moe-base] [--prompts 64] [--eps 0 0.00390625 0.0156]
(1-2 minutes; the model is made as train.py would, 300 copy_digits steps, when --model does not exist)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import buffer  # noqa: E402
import config  # noqa: E402
from standins import engine  # noqa: E402
import moe  # noqa: E402
import rollout  # noqa: E402
import rollout_fns  # noqa: E402
import sglang_client  # noqa: E402
import tasks  # noqa: E402
from standins import tiny_model  # noqa: E402
import batching  # noqa: E402
import model as model_lib  # noqa: E402


def sample(url: str, tokenizer, n_prompts: int, layers: int, top_k: int) -> list:
    """Trajectories of n_prompts reverse_digits eval prompts x 4 samples, with their routes (as rollout.py)."""
    import requests

    ds = config.DataSourceConfig(task="reverse_digits", num_eval_prompts=n_prompts)
    prompts = [p["prompt_ids"] for p in tasks.load_prompts(ds, tokenizer, "eval")]
    body = {"input_ids": [p for p in prompts for _ in range(4)], "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 0}}
    items = requests.post(url + "/generate", json=body, timeout=300).json()
    side = object.__new__(rollout.Rollout)
    side.routes_shape, side.routes_dtype = (layers, top_k), torch.uint8
    out = []
    for p, item in zip(body["input_ids"], items):
        t = buffer.Trajectory(0, 0, 0, torch.tensor(p))
        gen = sglang_client.parse_generate_response(item)
        rollout_fns.extend(t, gen.ids, gen.log_probs, gen.versions, 1)
        side._extend_routes(t, item, 0)
        out.append(t)
    return out


def measure(model, trajs: list, replay: bool) -> dict:
    seqs = batching.make_sequences([buffer.Group(None, trajs)], config.Config())
    b = batching.collate(seqs)
    ref, known = b["routes"], b["routed"].reshape(-1)  # [rows, L, layers, k]: the server's, where it ran them
    if not replay:
        b = {k: v for k, v in b.items() if k not in ("routes", "routed")}
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.experts.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[1])))
    with torch.no_grad():
        lp, _ = model_lib.token_logprobs(model, b, 1.0, 4096)
    for h in hooks:
        h.remove()
    differ = torch.stack([(seen[i].sort(-1).values != ref[:, :, i].reshape(len(known), -1).long().sort(-1).values)
                          .any(-1) for i in sorted(seen)], 1)[known]  # [tokens, layers]
    gap = (lp - b["rollout_lp"]).abs()[b["mask"] > 0]
    return {"decisions": 100 * differ.float().mean().item(), "tokens": 100 * differ.any(1).float().mean().item(),
            "gap_mean": gap.mean().item(), "gap_max": gap.max().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "runs", "tiny-moe-base"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--eps", type=float, nargs="+", default=[0.0, 2 ** -8, 2 ** -6])
    args = ap.parse_args()
    if not os.path.isdir(args.model):
        tiny_model.make_tiny_model(args.model, 64, 2, 0, "copy_digits", 300, num_experts=8, experts_per_token=2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    url, handle = engine.launch(args.model, enable_return_routed_experts=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, experts_implementation="eager").eval()
        cfg = model.config
        trajs = sample(url, tokenizer, args.prompts, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    finally:
        handle.stop()
    exact = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = sum(t.num_tokens - 1 for t in trajs)
    print(f"{len(trajs)} trajectories, {tokens} routed positions x {cfg.num_hidden_layers} layers, "
          f"{cfg.num_local_experts} experts top-{cfg.num_experts_per_tok}")
    print("| noise eps | replay | router decisions differing | tokens differing in >= 1 layer | "
          "log-prob gap mean | max |\n|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for eps in args.eps:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(exact[n] * (1 + eps * torch.randn(p.shape, generator=gen)))
        for replay in (False, True):
            m = measure(model, trajs, replay)
            print(f"| {eps:.5g} | {'on' if replay else 'off'} | {m['decisions']:.2f}% | {m['tokens']:.2f}% | "
                  f"{m['gap_mean']:.2e} | {m['gap_max']:.2e} |", flush=True)
        moe.set_routes(model, None)


if __name__ == "__main__":
    main()
