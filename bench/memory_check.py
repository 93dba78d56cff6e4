"""bench/memory_check.py: memory.memory_estimate against the measured peak of real training steps, on CPU.

One process (a one-rank gloo group, FSDP2 over it): a random Qwen3 of the given size is written as an HF checkpoint
(or --model-path names one, e.g. the SmolLM2 directory of `python -m models.smollm2`), loaded by model.load_model
(FSDP2-wrapped, activation checkpointing as configured), and trained for a few steps on packed micro-batches of
`--tokens` tokens through model.token_logprobs (the fused lm_head log-probs) and AdamW (model.build_optimizer). The
figure is the process's peak RSS minus its RSS before the model was built (Linux VmHWM, reset after start-up), next to
the estimate's device total for the same config (device=cpu: float32 and no mixed precision, so the compute dtype is
float32 and the CUDA terms are 0). CPU allocator caching and Python overheads are in the measurement, not in the
estimate. Also printed: the peak of the live tensors in the last step (torch's FSDPMemTracker), which the estimate
bounds from above: it adds the gradients and AdamW's temporaries, live after the backward, to the forward's peak.

Measured on the 2-core CPU machine (45.4M parameters: hidden 512, 4 layers, vocab 32000; 4096 tokens, 3 steps,
checkpointing on, foreach AdamW): estimated 1.522 GiB (params 0.169 + grads 0.169 + optimizer 0.338 + optimizer step
0.169 + gathered layers 0.023 + layer gradients 0.012 + root unit 0.183 + activations 0.031 + recomputed layer 0.266
+ log-probs 0.427, the larger of the last two counted), measured peak 1.478 GiB (0.97x). The estimate before issue
36 read 1.518 with an old-policy snapshot (0.169) this script never makes and no root unit.

SmolLM2-135M (Llama: 30 layers, hidden 576, tied embeddings, vocab 49,152; docs/results/smollm2_system.md has the
figures): `--model-path runs/smollm2 --tokens 1024 --no-checkpointing`.

Run: .venv/bin/python bench/memory_check.py [--hidden 512] [--layers 4] [--vocab 32000] [--model-path DIR]
     [--tokens 4096] [--no-checkpointing] [--optimizer foreach|for_loop]
"""
import argparse
import contextlib
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from logprob_memory import peak_rss_bytes, rss_bytes  # noqa: E402  (bench/ is this script's own directory)

GIB = 2 ** 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--model-path", help="an HF checkpoint directory to measure instead of a random Qwen3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--optimizer", default="foreach", choices=["foreach", "for_loop"])
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, Qwen3Config

    import batching
    import config
    import memory
    import model as model_lib

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    ctrl = dist.new_group(backend="gloo")
    path = a.model_path
    if path is None:
        path = tempfile.mkdtemp(prefix="memory_check-")
        hf = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                         num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=a.hidden // 8, max_position_embeddings=max(8192, a.tokens),
                         tie_word_embeddings=False)
        AutoModelForCausalLM.from_config(hf).save_pretrained(path)
    cfg = config.load_config(None, [f"model.path={path}", f"trainer.micro_batch_tokens={a.tokens}",
                                    f"model.activation_checkpointing={not a.no_checkpointing}",
                                    f"trainer.optimizer_impl={a.optimizer}", "trainer.packing=true"])
    device = torch.device("cpu")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss_bytes()
    model, _ = model_lib.load_model(cfg, init_device_mesh("cpu", (1,)), device, 0, ctrl)
    opt, _ = model_lib.build_optimizer(model, cfg.trainer, a.optimizer)
    g = torch.Generator().manual_seed(0)
    lengths = [a.tokens // 8] * 8
    vocab = model.config.vocab_size
    seqs = [{"prompt": torch.randint(3, vocab, (16,), generator=g).tolist(),
             "response": torch.randint(3, vocab, (n - 16,), generator=g).tolist(), "mask": [1] * (n - 16),
             "rollout_lp": [-1.0] * (n - 16), "versions": [0] * (n - 16), "adv": 1.0} for n in lengths]
    b = batching.collate(seqs, packing=True)
    tracker = FSDPMemTracker(model, opt)  # the last step's live tensors (AdamW's state made by the ones before)
    for step in range(a.steps):
        with tracker if step == a.steps - 1 else contextlib.nullcontext():
            logp, ent = model_lib.token_logprobs(model, b, 1.0, cfg.trainer.logprob_chunk_tokens, with_entropy=True)
            ((logp * b["mask"]).sum() / b["mask"].sum() + 0.0 * ent.sum()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    measured = (peak_rss_bytes() - before) / GIB
    live = tracker.get_tracker_snapshot("peak")[device]["Total"] / GIB
    n, largest = memory.param_counts(model)
    est = memory.memory_estimate(cfg, n, largest, 1, "cpu", memory.model_shape(model))
    est["device"] -= est["parts"].pop("snapshot")  # train.Actor's old-policy copy: no Actor here, so none
    parts = " + ".join(f"{k} {v:.3f}" for k, v in est["parts"].items() if v)
    print(f"{n / 1e6:.1f}M parameters, {a.tokens} tokens, checkpointing {not a.no_checkpointing}, AdamW "
          f"{a.optimizer}: estimated {est['device']:.3f} GiB ({parts}; log-probs or the recomputed layer, the "
          f"larger), measured peak {measured:.3f} GiB, measured / estimated {measured / est['device']:.2f}; live "
          f"tensors' peak (FSDPMemTracker, the last step) {live:.3f} GiB, {live / est['device']:.2f} of the estimate")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
