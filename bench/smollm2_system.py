"""bench/smollm2_system.py: the engine's log-probs against the trainer's after every weight-sync method, on a real
model, over more tokens than CI can afford; and packed against padded log-probs on the same tokens.

Under torchrun (2 gloo ranks, FSDP2, float32 on CPU, as train.py loads the model) with one standins/engine.py: for
each weight_sync.method in turn (distributed, tensor, disk), the trainer takes one AdamW step (train.Actor, lr --lr,
GRPO advantages +-1) on the responses it last got, the engine generates --prompts chat prompts x up to --tokens
tokens (temperature 1) under the old weights, the weights are synced (Actor.sync_weights), and the engine generates
again. The trainer's log-probs of each generation's tokens (model.token_logprobs, the training path, padded and
packed) are compared with the engine's: before the sync the gap is the step's movement, after it the sync's error.
Also checked: the lm_head is the embedding (tied) on the trainer, and the sync pushes no lm_head.weight. Prints one
line per method and RESULT {json}.

Run (docs/results/smollm2_system.md has the figures and the tiny model's for comparison):
    python -m models.smollm2 --out runs/smollm2
    torchrun --standalone --nproc_per_node 2 bench/smollm2_system.py --model-path runs/smollm2
    torchrun --standalone --nproc_per_node 2 bench/smollm2_system.py --model-path runs/tiny-base --task \
        reverse_digits --tokens 6 --prompts 128 --lr 1e-3    # the tiny model (configs/tiny.yaml's model and lr)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QUESTIONS = ["What is {a} + {b}? Answer with the number only.", "Write one sentence about the number {a}.",
             "Name {a} colours.", "Count from {a} to {b}."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="runs/smollm2")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="max_new_tokens of each generation")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--methods", default="distributed,tensor,disk")
    p.add_argument("--task", default="chat", help="chat (QUESTIONS through the chat template) or a toy task of "
                   "tasks.py (reverse_digits: the tiny model's prompts)")
    a = p.parse_args()

    import requests
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    import batching
    import config as config_lib
    import model as model_lib
    import sglang_client
    import services
    import tasks
    import train
    import weight_sync
    from standins import engine

    dist.init_process_group("gloo")
    ctrl = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    port = [services.free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0, group=ctrl)
    run_dir = tempfile.mkdtemp(prefix="smollm2_system-") if rank == 0 else None
    box = [run_dir]
    dist.broadcast_object_list(box, src=0, group=ctrl)
    cfg = config_lib.load_config(None, [f"model.path={os.path.abspath(a.model_path)}", f"run_dir={box[0]}",
                                        "device=cpu", f"trainer.lr={a.lr}", f"trainer.num_gpus_per_node={world}",
                                        f"weight_sync.master_port={port[0]}", "weight_sync.master_address=127.0.0.1"])
    model, _ = model_lib.load_model(cfg, init_device_mesh("cpu", (world,)), torch.device("cpu"), rank, ctrl)
    opt, sched = model_lib.build_optimizer(model, cfg.trainer)
    actor = train.Actor(cfg, model, opt, sched, torch.device("cpu"), ctrl)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    pushed = [n for spec in weight_sync.plan_buckets(model, torch.float32, 1 << 40) for unit in spec
              for n, _ in unit[1]]
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    if a.task == "chat":
        texts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(
            a=3 + 7 * i % 29, b=5 + 11 * i % 31)}], add_generation_prompt=True, tokenize=False)
            for i in range(a.prompts)]
    else:
        texts = [text for text, _ in tasks.toy_examples(a.task, a.prompts, 0, "eval")]
    prompts = tok(texts, add_special_tokens=False)["input_ids"]
    stop = tasks.stop_token_ids(tok, cfg.model.path)
    url, handle = engine.launch(cfg.model.path) if rank == 0 else (None, None)
    if rank == 0:
        actor.fleet = sglang_client.SyncFleet(sglang_client.Fleet([url]))

    def generate() -> list:
        """Every rank: the engine's sequences (prompt, response, its log-probs), from rank 0."""
        box = [None]
        if rank == 0:
            outs = requests.post(url + "/generate", timeout=600, json={
                "input_ids": prompts, "return_logprob": True, "sampling_params": {
                    "temperature": 1.0, "max_new_tokens": a.tokens, "stop_token_ids": stop}}).json()
            box = [[{"prompt": q, "response": o["output_ids"], "mask": [1] * len(o["output_ids"]),
                     "rollout_lp": [x[0] for x in o["meta_info"]["output_token_logprobs"]],
                     "versions": [0] * len(o["output_ids"]), "adv": 0.0} for q, o in zip(prompts, outs)]]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        return box[0]

    @torch.no_grad()
    def gaps(seqs: list) -> dict:
        """The trainer's log-probs of the engine's tokens, padded and packed: their largest gaps, and the tokens."""
        out = {}
        for packing in (False, True):
            b = batching.collate(seqs, packing=packing)
            model.eval()
            out[packing] = model_lib.token_logprobs(model, b, 1.0, cfg.trainer.logprob_chunk_tokens)[0] * b["mask"]
            model_lib.reshard(model)
        gap = (out[False] - b["rollout_lp"]).abs() * b["mask"]
        return {"max": float(gap.max()), "mean": float(gap.sum() / b["mask"].sum()),
                "p99": float(gap[b["mask"] > 0].quantile(0.99)), "tokens": int(b["mask"].sum()),
                "packed_vs_padded": float((out[True] - out[False]).abs().max()),
                "eos_stops": sum(s["response"][-1] in stop for s in seqs)}

    results = {"tied": tied, "lm_head_pushed": "lm_head.weight" in pushed, "tensors_pushed": len(pushed)}
    try:
        seqs = generate()
        results["version 0"] = gaps(seqs)
        for version, method in enumerate(a.methods.split(","), 1):
            cfg.weight_sync.method = method
            for i, s in enumerate(seqs):  # one GRPO-like step: half the responses up, half down
                s["adv"] = 1.0 if i % 2 else -1.0
            share = batching.split_balanced(seqs, world)[rank]
            actor.train_plan([batching.collate(share)], step=version, denom=float(sum(len(s["response"])
                                                                                        for s in seqs)))
            before = gaps(generate())  # the engine still serves version - 1
            actor.sync_weights(version)
            seqs = generate()
            after = gaps(seqs)
            served = requests.get(url + "/model_info", timeout=10).json()["weight_version"] if rank == 0 else None
            results[method] = {"before_sync": before, "after_sync": after, "served_version": served}
            if rank == 0:
                print(f"{method:<12} step's movement (before the sync) max {before['max']:.2e}; after the sync "
                      f"max {after['max']:.2e} mean {after['mean']:.1e} p99 {after['p99']:.1e} over "
                      f"{after['tokens']} tokens ({after['eos_stops']} of {a.prompts} stopped at eos); packed vs "
                      f"padded {after['packed_vs_padded']:.1e}; engine serves version {served}", flush=True)
    finally:
        if handle is not None:
            actor.fleet.close()
            handle.stop()
            shutil.rmtree(run_dir, ignore_errors=True)
    if rank == 0:
        print(f"{os.path.basename(cfg.model.path)}: lm_head tied to the embedding {tied}; lm_head.weight among the "
              f"{len(pushed)} tensors pushed: {results['lm_head_pushed']}")
        print("RESULT " + json.dumps(results), flush=True)
    dist.barrier(group=ctrl)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
