"""bench/logprob_memory.py: peak memory of chunked vs naive token log-probs, forward + backward, on a long sequence.

The chunked `losses.token_logprobs` upcasts `--chunk` tokens at a time to float32 (forward and backward); the naive
reference is `log_softmax(logits.float() / T).gather(...)`, which materialises several float32 [tokens x vocab]
tensors. Each variant runs in a fresh subprocess on CPU: bf16 logits [tokens, vocab] requiring grad are created
first, the process's peak RSS is reset (Linux /proc/self/clear_refs) and then forward + backward run; the figure is
peak RSS minus RSS before the computation, so it includes the bf16 gradient of the logits that both variants must
produce (the same size as the logits). Default size: 4096 tokens x 151936 vocabulary (Qwen's) in bf16 = 1.16 GiB of
logits; the naive variant then needs about 7 GiB, so it fits a 24 GB / 2-core machine next to other jobs (8192
tokens would need about 14 GiB for the naive one, 20+ GiB with --entropy). Figures are GiB.

Measured on the 2-core CPU machine, default size: chunked 1.75 GiB (1.16 of it the gradient), naive 6.96 GiB.

Run: .venv/bin/python bench/logprob_memory.py [--tokens 4096] [--vocab 151936] [--chunk 1024] [--entropy]
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


def child(variant: str, tokens: int, vocab: int, chunk: int, entropy: bool, temperature: float = 0.8) -> dict:
    import torch

    import losses

    torch.manual_seed(0)
    # rank-one random logits: built in bf16 directly and fast (normal_ on 600M elements takes tens of seconds)
    logits = (torch.randn(tokens, 1, dtype=torch.bfloat16) * torch.randn(1, vocab, dtype=torch.bfloat16) * 2)
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    weights = torch.randn(tokens)

    def naive():
        logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logp, (-(logp_all.exp() * logp_all).sum(-1) if entropy else None)

    def chunked():
        return losses.token_logprobs(logits, targets, temperature, chunk_size=chunk, with_entropy=entropy)

    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: the peak below is this computation's only
        f.write("5")
    before = rss_bytes()
    t0 = time.perf_counter()
    logp, ent = {"naive": naive, "chunked": chunked}[variant]()
    loss = (logp * weights).sum() + (ent.sum() * 0.1 if entropy else 0.0)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {"peak_gb": (peak_rss_bytes() - before) / GB, "seconds": seconds, "logp_sum": float(logp.sum()),
            "grad_abs_sum": float(logits.grad.float().abs().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--entropy", action="store_true", help="also compute the entropy (and its gradient)")
    ap.add_argument("--child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.chunk, args.entropy)))
        return
    logits_gb = args.tokens * args.vocab * 2 / GB
    print(f"token log-probs + backward, CPU, bf16 logits [{args.tokens} x {args.vocab}] = {logits_gb:.2f} GiB "
          f"(one float32 copy = {2 * logits_gb:.2f} GiB), chunk {args.chunk} tokens, entropy {args.entropy}")
    results = {}
    for variant in ("chunked", "naive"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--chunk", str(args.chunk)] + (["--entropy"] if args.entropy else [])
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"{variant} run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        results[variant] = r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {variant:8s} peak memory above the inputs: {r['peak_gb']:6.2f} GiB   time {r['seconds']:5.1f} s")
    c, n = results["chunked"], results["naive"]
    same = abs(c["logp_sum"] - n["logp_sum"]) <= 1e-4 * abs(n["logp_sum"]) + 1e-2
    print(f"  naive / chunked peak: {n['peak_gb'] / c['peak_gb']:.1f}x; without the {logits_gb:.2f} GiB bf16 gradient of "
          f"the logits that both must return: chunked {c['peak_gb'] - logits_gb:.2f} GiB, naive "
          f"{n['peak_gb'] - logits_gb:.2f} GiB ({(n['peak_gb'] - logits_gb) / (c['peak_gb'] - logits_gb):.1f}x); "
          f"results agree: {same}")


if __name__ == "__main__":
    main()
