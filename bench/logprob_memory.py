"""bench/logprob_memory.py: peak memory of token log-probs from the last hidden states, forward + backward, three ways.

  fused    logprobs.linear_token_logprobs: lm_head and log-softmax per chunk; the [tokens x vocab] logits never exist
  chunked  logits = hidden @ lm_head.T in bf16, then logprobs.token_logprobs (float32 one chunk at a time); the logits
           and their gradient are two bf16 [tokens x vocab] tensors
  naive    log_softmax(logits.float() / T).gather(...): several float32 [tokens x vocab] tensors besides those

Each variant runs in a fresh subprocess on CPU: bf16 hidden states [tokens, hidden] and an lm_head weight [vocab,
hidden] requiring grad are created first, the process's peak RSS is reset (Linux /proc/self/clear_refs) and then
forward + backward run; the figure is peak RSS minus RSS before, GiB. It includes the gradients of hidden and
weight (the fused one's float32 weight-gradient accumulator too), which all variants return. The hidden size only
sets those small terms and the matmul time (--hidden 64 keeps the 2-core machine's run short; the logits terms
depend on tokens x vocab only).

Measured on the 2-core CPU machine (vocab 151936, chunk 1024, --hidden 64):
  --tokens 24576 (the 30B config's micro_batch_tokens): fused 0.92 GiB (93 s), chunked 14.50 GiB (220 s): the
      logits and their gradient, 2 x 6.96 GiB, plus one float32 chunk; naive not run (about 40 GiB)
  --tokens 4096: fused 0.92 GiB, chunked 2.91 GiB, naive 6.97 GiB; all three agree
The fused peak is one chunk's logits in bf16 and float32 (1024 x 151936: 0.87 GiB) whatever the token count.

Run: .venv/bin/python bench/logprob_memory.py [--tokens 4096] [--vocab 151936] [--hidden 64] [--chunk 1024]
     [--entropy] [--variants fused,chunked,naive] [--top-p 1] [--top-k -1]
With --top-p < 1 or --top-k > 0, fused and chunked over that support (logprobs.Support), measured on the same machine
(--tokens 4096 --vocab 151936 --chunk 1024 --variants fused,chunked): see docs/results/sampling_support.md.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GB = 1024 ** 3


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(variant: str, tokens: int, vocab: int, hidden_size: int, chunk: int, entropy: bool, top_p: float,
          top_k: int, temperature: float = 0.8) -> dict:
    import torch

    import logprobs

    torch.manual_seed(0)
    hidden = (torch.randn(tokens, hidden_size) / hidden_size ** 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden_size) * 2).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    weights = torch.randn(tokens)

    def naive():
        logp_all = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logp, (-(logp_all.exp() * logp_all).sum(-1) if entropy else None)

    # with a support (top_p < 1 or top_k > 0): the renormalised log-probs (and entropy), not the log-mass
    support = {"support": logprobs.Support(top_k, top_p)} if logprobs.Support(top_k, top_p).truncates() else {}

    def chunked():
        return logprobs.token_logprobs(hidden @ weight.T, targets, temperature, chunk_size=chunk, with_entropy=entropy,
                                       **support)[:2]

    def fused():
        return logprobs.linear_token_logprobs(hidden, weight, targets, temperature, chunk_size=chunk,
                                            with_entropy=entropy, **support)[:2]

    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: the peak below is this computation's only
        f.write("5")
    before = rss_bytes()
    t0 = time.perf_counter()
    logp, ent = {"naive": naive, "chunked": chunked, "fused": fused}[variant]()
    loss = (logp * weights).sum() + (ent.sum() * 0.1 if entropy else 0.0)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {"peak_gb": (peak_rss_bytes() - before) / GB, "seconds": seconds, "logp_sum": float(logp.sum()),
            "grad_abs_sum": float(hidden.grad.float().abs().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--entropy", action="store_true", help="also compute the entropy (and its gradient)")
    ap.add_argument("--variants", default="fused,chunked,naive")
    ap.add_argument("--top-p", type=float, default=1.0, help="< 1: fused and chunked over this top-p support")
    ap.add_argument("--top-k", type=int, default=-1, help="> 0: fused and chunked over this top-k support")
    ap.add_argument("--child", choices=["naive", "chunked", "fused"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.hidden, args.chunk, args.entropy,
                               args.top_p, args.top_k)))
        return
    if (args.top_p < 1 or args.top_k > 0) and "naive" in args.variants.split(","):  # (the parent imports no torch)
        raise SystemExit("--top-p / --top-k run the fused and chunked variants only: pass --variants fused,chunked")
    logits_gb = args.tokens * args.vocab * 2 / GB
    print(f"token log-probs + backward, CPU, [{args.tokens} tokens x {args.hidden}] @ [{args.hidden} x {args.vocab}] "
          f"in bf16: logits would be {logits_gb:.2f} GiB; chunk {args.chunk} tokens, entropy {args.entropy}, "
          f"top_p {args.top_p}, top_k {args.top_k}")
    results = {}
    for variant in args.variants.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk),
               "--top-p", str(args.top_p), "--top-k", str(args.top_k)]
        out = subprocess.run(cmd + (["--entropy"] if args.entropy else []), capture_output=True, text=True,
                             timeout=1800)
        if out.returncode != 0:
            raise SystemExit(f"{variant} run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        results[variant] = r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {variant:8s} peak memory above the inputs: {r['peak_gb']:6.2f} GiB   time {r['seconds']:6.1f} s")
    sums = [r["logp_sum"] for r in results.values()]
    same = max(sums) - min(sums) <= 1e-3 * abs(sums[0]) + 1e-2
    print(f"  results agree: {same} ({', '.join(f'{k} {v:.1f}' for k, v in zip(results, sums))})")


if __name__ == "__main__":
    main()
