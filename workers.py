"""workers.py: the command lines of the buffer and rollout processes, and standalone generation.

The role files (buffer.py, rollout.py) never read a config file: they take settings. This file is where a resolved
config becomes those settings and a process joins RPC, so it is the one place beside train.py and services.py that
imports config.py (and yaml, transformers, tasks). services.py starts the two processes with these command lines:

    python workers.py buffer  --config RESOLVED.yaml --rpc-init tcp://127.0.0.1:29500 --rank 1 --world-size 3
    python workers.py rollout --config RESOLVED.yaml --rpc-init tcp://127.0.0.1:29500 --rank 2 --world-size 3

Standalone generation (no training): generate and score a dataset against running servers, JSONL + a summary line:

    python workers.py generate --config configs/tiny.yaml rollout.servers=[http://127.0.0.1:31000] [--split eval]

Both processes serve their object the same way, remote.serve_object (the buffer's PipelineServer through
remote.serve_buffer, the rollout's Rollout through serve_rollout here); the trainer calls them through remote.Proxy.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from typing import Optional

import config
import remote
import rollout
import run_modes
import sglang_client


def serve_buffer(cfg, rpc_init: str, rank: int, world_size: int) -> None:
    """The buffer process: the train-split prompts of every data source (tasks.load_prompts), then remote.serve."""
    import tasks
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts = [tasks.load_prompts(ds, tokenizer, "train", cfg.rollout.max_prompt_tokens) for ds in cfg.data_source]
    remote.serve_buffer(cfg.buffer_settings(), rpc_init, rank, world_size, prompts, decode=tokenizer.decode,
                        startup_timeout=rpc_startup_timeout(cfg))


def serve_rollout(cfg, rpc_init: str, rank: int, world_size: int, startup_timeout: Optional[float] = None) -> None:
    """The rollout process: a Rollout against the buffer process (remote.Proxy) and the fleet, served as RPC
    worker "rollout" (remote.ROLLOUT_METHODS) until the trainer shuts RPC down. startup_timeout: how long init_rpc
    waits for the others (default buffer.rpc_timeout_s)."""

    @contextlib.contextmanager
    def make():
        from transformers import AutoTokenizer

        with contextlib.closing(sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))) as sync:
            # The trainer waited for /health and checked versions (services.Services.start_fleet); a colocated
            # server has released its memory since, so its /health (a generated token) would wait 20 s and fail:
            # reachable is what is asked here.
            sync.live_workers(cfg.rollout.startup_timeout_s)
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            buf = remote.Proxy("buffer", cfg.buffer.rpc_timeout_s, remote.BUFFER_METHODS)
            producer = rollout.Rollout(cfg, buf, sync, tokenizer)
            try:
                yield producer
            finally:
                producer.stop()

    remote.serve_object("rollout", remote.ROLLOUT_METHODS, make, rpc_init, rank, world_size, cfg.buffer.rpc_timeout_s,
                        startup_timeout)


def rpc_startup_timeout(cfg) -> float:
    """How long a worker waits in init_rpc for the trainer: started before the servers answer /health, it joins
    within rollout.startup_timeout_s of them, and within buffer.rpc_timeout_s of the other workers."""
    return cfg.rollout.startup_timeout_s + cfg.buffer.rpc_timeout_s


def generate(cfg, split: str, limit: Optional[int], out: Optional[str]) -> dict:
    """Generate and score the prompts of `split` against the running servers; writes one JSON line per trajectory to
    `out` (default run_dir/rollout_<split>.jsonl) and returns the summary."""
    import tasks
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts = tasks.load_prompts(cfg.data_source[0], tokenizer, split)[:limit]
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    try:
        sync.wait_healthy(cfg.rollout.startup_timeout_s)
        buf, summary = run_modes.generate_dataset(cfg, prompts, sync, tokenizer,
                                                  cfg.rollout.trajectory_timeout_s + 60.0)
    finally:
        sync.close()
    out = out or os.path.join(cfg.run_dir, f"rollout_{split}.jsonl")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        for seq in sorted(buf.results):
            g = buf.prompts[seq]
            for t in sorted(buf.results[seq], key=lambda t: t.index):
                f.write(json.dumps({
                    "data_index": g.data_index, "index": t.index, "prompt": tokenizer.decode(g.prompt_ids.tolist()),
                    "response": tokenizer.decode(t.response_ids.tolist(), skip_special_tokens=True),
                    "label": g.label, "reward": t.reward, "status": t.status,
                    "response_length": len(t.response_ids), "start_version": t.start_version,
                    "end_version": t.end_version, "error": t.metadata.get("error")}) + "\n")
    return {**summary, "split": split, "out": out}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["buffer", "rollout", "generate"],
                        help="buffer / rollout: an RPC worker process; generate: standalone generation")
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml or a resolved one)")
    parser.add_argument("--rpc-init", help="buffer, rollout: the RPC init method, e.g. tcp://127.0.0.1:29500")
    parser.add_argument("--rank", type=int, help="buffer, rollout: RPC rank")
    parser.add_argument("--world-size", type=int, help="buffer, rollout: RPC world size")
    parser.add_argument("--split", default="eval", choices=["train", "eval"], help="generate: prompts to generate")
    parser.add_argument("--limit", type=int, help="generate: only the first LIMIT prompts")
    parser.add_argument("--out", help="generate: JSONL output (default run_dir/rollout_<split>.jsonl)")
    args, overrides = parser.parse_known_args(argv)
    if args.role != "generate" and (args.rpc_init is None or args.rank is None or args.world_size is None):
        parser.error(f"{args.role} needs --rpc-init, --rank and --world-size")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config.load_config(args.config, overrides)
    if args.role == "buffer":
        serve_buffer(cfg, args.rpc_init, args.rank, args.world_size)
    elif args.role == "rollout":
        serve_rollout(cfg, args.rpc_init, args.rank, args.world_size, rpc_startup_timeout(cfg))
    else:
        print(json.dumps({"rollout_summary": generate(cfg, args.split, args.limit, args.out)}))


if __name__ == "__main__":
    main()
    import services

    services.exit_process(0)  # RPC is down and the role has stopped: no teardown of torch to wait for
