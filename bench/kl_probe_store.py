"""bench/kl_probe_store.py: what storing train/kl_to_start's pi_0 logits in bfloat16 would cost in precision.

actor.KLProbe keeps pi_0's logits as the forward returned them: bf16 on cuda (FSDP2's compute dtype: the store is the
forward's output exactly), float32 on CPU. This measures the error a bf16 store of float32 logits adds, on the tiny
model: probe positions from the base's own samples (reverse_digits prompts, as the run's first step has them),
pi_0 = the base, pi_t = a trained model (e.g. a tiny run's run_dir/hf), KL(pi_t || pi_0) by logprobs.kl_rows
against the float32 and the bf16-rounded store.

Measured (2-core CPU; base and a 40-step configs/tiny.yaml run's export, 128 positions, vocabulary 101):
  KL(pi_t || pi_0) 2.63285 with the float32 store, 2.63248 with bf16 (error -3.7e-4 of the mean, up to 0.032 at
  one position); at pi_t = pi_0, 2.1e-6 instead of exactly 0 (docs/results/kl_to_start.md).

Run: .venv/bin/python bench/kl_probe_store.py --base runs/tiny-base --trained runs/tiny/hf [--positions 128]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import logprobs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="pi_0: the model the run started from")
    ap.add_argument("--trained", required=True, help="pi_t: a trained model (an HF directory)")
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.base)
    base = AutoModelForCausalLM.from_pretrained(args.base).float().eval()
    trained = AutoModelForCausalLM.from_pretrained(args.trained).float().eval()
    g = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    refs, lives, n = [], [], 0
    while n < args.positions:  # "123=" -> the base's sampled answer: the response positions
        digits = "".join(str(d) for d in torch.randint(0, 10, (int(torch.randint(1, 6, (1,), generator=g)),),
                                                       generator=g).tolist())
        ids = torch.tensor([tok(digits + "=", add_special_tokens=False)["input_ids"]])
        out = base.generate(ids, do_sample=True, max_new_tokens=6, temperature=1.0, top_k=0, pad_token_id=0)
        with torch.no_grad():
            refs.append(base(out).logits[0, ids.shape[1] - 1:-1])
            lives.append(trained(out).logits[0, ids.shape[1] - 1:-1])
        n += refs[-1].shape[0]
    ref, live = torch.cat(refs)[:args.positions], torch.cat(lives)[:args.positions]
    exact = logprobs.kl_rows(live, ref)
    rounded = logprobs.kl_rows(live, ref.bfloat16())
    floor = logprobs.kl_rows(ref, ref.bfloat16())
    print(f"positions {ref.shape[0]}, vocabulary {ref.shape[1]}")
    print(f"KL(pi_t || pi_0): float32 store {float(exact.mean()):.5f}, bf16 store {float(rounded.mean()):.5f} "
          f"(error of the mean {float((rounded - exact).mean()):.2e}, largest at one position "
          f"{float((rounded - exact).abs().max()):.2e})")
    print(f"at pi_t = pi_0: float32 store {float(logprobs.kl_rows(ref, ref).mean()):.1e}, bf16 store "
          f"{float(floor.mean()):.1e} (largest at one position {float(floor.abs().max()):.1e})")


if __name__ == "__main__":
    main()
