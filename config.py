"""config.py: the whole run's configuration as one typed dataclass tree.

Loaded from `configs/<name>.yaml` and overridden on the command line with dotted `a.b=c` arguments:

    torchrun train.py --config configs/tiny.yaml fully_async.enable=true trainer.total_steps=50

Loading (load_config, from_dict) builds the tree, registers the `module:attr` plugins it names (load_plugins) and
fills in what is left to be derived (resolve); `validate` checks it and changes nothing. Unknown keys, wrong types,
non-finite floats (check_finite) and bad values fail at start-up in one sentence naming the key: each section's
dataclass checks its own fields (`check`), `validate` adds the rules across sections. Key names follow the spec
(docs/design.md: B = data_source.num_prompts_per_step, N = ...num_trajectories_per_prompt, M = trainer.mini_batch_size).
The role files own their settings: `algorithm` is losses.LossSettings, `buffer` buffer.BufferSettings (its keys: KEYS;
Config.buffer_settings() fills in the rest). Role files do not import this one (the entry points do: train.py,
workers.py, services.py, checks.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import buffer
import logprobs
import losses
import plugins
import scoring
import strategies
from buffer import BufferSettings, validate_concurrency
from losses import LossSettings

PAUSE_MODES = ("abort", "retract", "in_place")  # rollout.pause_mode: what servers do with requests at a boundary
# model.attn_implementation: each keeps packed sequences apart given position_ids alone (eager, sdpa,
# flex_attention: tests/test_packing.py; flash_attention_2 runs varlen from them: bench/gpu_smoke.sh)
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flex_attention", "flash_attention_2")
RUN_MODES = ("default", "rollout-only", "train-only")
DEVICES = ("auto", "cpu", "cuda")
ONE_OR_MORE = ("data_source",)  # list keys that also take one mapping, a list of one (and to_dict writes it so)


@dataclass
class ModelConfig:
    path: str = "runs/tiny-model"  # HF checkpoint directory (config.json, safetensors, tokenizer)
    make_tiny: bool = False  # create the tiny model at `path` when it does not exist yet (standins/tiny_model.py)
    tiny_hidden_size: int = 64  # width of the tiny model made by `make_tiny`
    tiny_num_layers: int = 2  # decoder layers of the tiny model
    tiny_pretrain_steps: int = 300  # supervised steps of the tiny base on its task's pretraining task (0 = random)
    tiny_num_experts: int = 0  # > 0: the tiny model is a Qwen3-MoE with this many experts per layer (0 = dense)
    tiny_experts_per_token: int = 2  # top-k experts per token of the tiny Qwen3-MoE
    dtype: str = "float32"  # training parameter dtype on GPU mixed precision: float32 | bfloat16
    activation_checkpointing: bool = False  # recompute each decoder layer in backward to save memory
    attn_implementation: str = "auto"  # auto (cuda: flash_attention_2 if installed, else flex_attention; cpu: sdpa) | ...

    def check(self) -> None:
        """model.*, one sentence per rule."""
        if self.tiny_pretrain_steps < 0:
            raise ValueError(f"model.tiny_pretrain_steps must be >= 0, got {self.tiny_pretrain_steps}")
        if self.tiny_num_experts < 0:
            raise ValueError(f"model.tiny_num_experts must be >= 0 (0: a dense model), got {self.tiny_num_experts}")
        if self.tiny_num_experts and not 0 < self.tiny_experts_per_token <= self.tiny_num_experts:
            raise ValueError(f"model.tiny_experts_per_token must be in 1 .. model.tiny_num_experts "
                             f"({self.tiny_num_experts}), got {self.tiny_experts_per_token}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"model.attn_implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, got "
                             f"'{self.attn_implementation}'")


@dataclass
class DataSourceConfig:
    task: str = "reverse_digits"  # toy task name (tasks.py) or "jsonl" / "parquet" for a file
    path: Optional[str] = None  # dataset file for jsonl / parquet tasks
    reward: Optional[str] = None  # reward function name (tasks.py); None = the task's own
    num_prompts_per_step: int = 64  # B: prompt groups consumed per training step
    num_trajectories_per_prompt: int = 8  # N: trajectories sampled per prompt
    num_prompts: int = 4096  # size of a generated toy dataset (one epoch)
    num_eval_prompts: int = 64  # held-out prompts for trainer.eval_freq evaluation
    weight: float = 1.0  # mixing weight when data_source lists several sources (synchronous mode only)
    seed: int = 0  # seed of the dataset generation and of the epoch shuffles
    shuffle: bool = True  # reshuffle the prompt order every epoch (deterministic from seed + epoch)

    def check(self, key: str = "data_source") -> None:
        """One data source (`key`: data_source, or data_source[i] of several), one sentence per rule."""
        for name in ("num_prompts_per_step", "num_trajectories_per_prompt", "weight"):
            _positive(getattr(self, name), f"{key}.{name}")


@dataclass
class TrainerConfig:
    mini_batch_size: int = 64  # M: trajectories per optimizer update; M // N groups per training call
    total_steps: int = 100  # outer training steps (each consumes B groups)
    save_freq: int = 0  # checkpoint every this many steps (0 = only at the end)
    keep_checkpoints: int = 3  # the newest this many checkpoints stay, older ones go after each save (0 = keep all)
    eval_freq: int = 0  # greedy evaluation on held-out prompts every this many steps (0 = off)
    resume: str = "none"  # none | auto (newest checkpoint in run_dir that loads; none loading: stop) | a checkpoint dir
    overwrite: bool = False  # a fresh run in a run_dir of another run's results moves them to run_dir/old-<time>/
    num_nodes: int = 1  # training nodes
    num_gpus_per_node: int = 8  # training GPUs per node (on CPU: trainer processes)
    use_rollout_log_probs: bool = False  # use the engine's log-probs as old_log_probs (skips a forward)
    lr: float = 1e-6  # AdamW learning rate
    warmup_steps: int = 0  # linear warmup of the learning rate, in optimizer updates
    lr_decay: str = "constant"  # after the warmup: constant | linear | cosine, to lr x min_lr_ratio at the last update
    min_lr_ratio: float = 0.0  # the decay's floor, a fraction of lr in [0, 1]
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple = (0.9, 0.999)  # AdamW betas
    optimizer_impl: str = "auto"  # AdamW kernel: auto (fused on cuda, foreach on cpu) | fused | foreach | for_loop
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    micro_batch_tokens: int = 16384  # max tokens per forward/backward micro-batch on one rank (padded: rows x longest)
    packing: bool = True  # a micro-batch is one row of concatenated sequences (restarting position_ids, no padding)
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: param/grad shards and AdamW state in host memory, step on CPU
    snapshot: str = "device"  # where the old-policy copy of the weight shards lives: device | cpu (host memory)
    logprob_chunk_tokens: int = 1024  # tokens per chunk in the chunked log-prob / entropy computation
    entropy_metric: bool = True  # train/entropy: computed in the training forward (no loss term here uses it)
    kl_probe_tokens: int = 128  # train/kl_to_start: KL(pi_t || pi_0) at this many fixed loss positions (0 = off)
    kl_probe_every: int = 1  # measure train/kl_to_start every this many steps (one forward of the probe set)
    export_hf: bool = True  # export the final model as an HF checkpoint in run_dir/hf
    export_dtype: str = "auto"  # its dtype: auto (model.path's own, from its config.json) | float32 | bfloat16 | float16
    rollout_dir: Optional[str] = None  # run_mode=train-only: a rollout-only run's saved groups (None: run_dir/rollouts)

    def check(self) -> None:
        """trainer.*, one sentence per rule."""
        for key in ("mini_batch_size", "total_steps", "num_nodes", "num_gpus_per_node", "lr", "micro_batch_tokens",
                    "logprob_chunk_tokens", "kl_probe_every"):
            _positive(getattr(self, key), f"trainer.{key}")
        if self.snapshot not in ("device", "cpu"):
            raise ValueError(f"trainer.snapshot must be device or cpu, got '{self.snapshot}'")
        if self.kl_probe_tokens < 0:
            raise ValueError(f"trainer.kl_probe_tokens must be >= 0 (0 turns train/kl_to_start off), got "
                             f"{self.kl_probe_tokens}")
        if self.export_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"trainer.export_dtype must be auto, float32, bfloat16 or float16, got "
                             f"'{self.export_dtype}'")
        if self.optimizer_impl not in ("auto", "fused", "foreach", "for_loop"):
            raise ValueError(f"trainer.optimizer_impl must be auto, fused, foreach or for_loop, got "
                             f"'{self.optimizer_impl}'")
        for key in ("save_freq", "eval_freq", "warmup_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"trainer.{key} must be >= 0, got {getattr(self, key)}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"trainer.keep_checkpoints must be >= 0 (0 keeps every checkpoint), got "
                             f"{self.keep_checkpoints}")
        if self.lr_decay not in ("constant", "linear", "cosine"):
            raise ValueError(f"trainer.lr_decay must be constant, linear or cosine, got '{self.lr_decay}'")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"trainer.min_lr_ratio must be in [0, 1] (a fraction of trainer.lr), got "
                             f"{self.min_lr_ratio}")
        if self.resume not in ("none", "auto") and not os.path.isdir(self.resume):
            raise ValueError(f"trainer.resume must be none, auto or an existing checkpoint directory, got "
                             f"'{self.resume}'")


@dataclass
class FullyAsyncConfig:
    enable: bool = False  # background producer + collector + PipelineBuffer (requires colocate: false)
    sliding_window: str = "no-window"  # no-window | window-gated | windowed-fifo | preset (docs/staleness.md) | custom
    stale_steps: float = 0.0  # capacity C = int(B * (1 + stale_steps)) groups in flight + buffered (not presets)
    policy_param: Optional[float] = None  # a preset's knob in its own unit; null = one step of staleness

    def check(self, B: int, N: int) -> None:
        """fully_async.*, one sentence per rule: a registered strategy (strategies.lookup) and the knob its kind takes
        (a preset's policy_param, strategies.Preset.check; stale_steps for the others). B, N: the data source's."""
        if self.stale_steps < 0:
            raise ValueError(f"fully_async.stale_steps must be >= 0, got {self.stale_steps}")
        strategy = strategies.lookup(self.sliding_window)
        if not issubclass(strategy, strategies.Preset):
            if self.policy_param is not None:
                raise ValueError(f"fully_async.policy_param is the knob of a preset (areal, verl, pipelinerl, "
                                 f"prime-rl, roll, slime-async); fully_async.sliding_window={self.sliding_window} "
                                 "takes fully_async.stale_steps")
            return
        if not self.enable:
            raise ValueError(f"fully_async.sliding_window={self.sliding_window} is a fully-async staleness policy; "
                             "set fully_async.enable=true (synchronous mode always uses B + num_oversample groups)")
        if self.stale_steps != 0:
            raise ValueError(f"fully_async.stale_steps is the spec strategies' knob; the {self.sliding_window} preset "
                             f"takes its {strategy.param_name} as fully_async.policy_param (got stale_steps="
                             f"{self.stale_steps})")
        strategy.check(self.policy_param, B, N)


@dataclass
class SamplerConfig:
    num_oversample: int = 0  # extra groups dispatched per synchronous step for dynamic sampling (0 in fully-async)

    def check(self) -> None:
        if self.num_oversample < 0:
            raise ValueError(f"rollout.sampler.num_oversample must be >= 0, got {self.num_oversample}")


@dataclass
class SGLangArgs:
    max_running_requests: Optional[int] = None  # per-server concurrency limit passed to each server we launch
    mem_fraction_static: Optional[float] = None  # SGLang --mem-fraction-static for servers we launch
    host: str = "127.0.0.1"  # --host of servers we launch (0.0.0.0: reachable by other machines, keyed as always)
    api_key_file: Optional[str] = None  # 0600 file `api-key: KEY` (null: run_dir/servers/api_key.yaml, made per run)
    extra: list = field(default_factory=list)  # any other launch flags, as strings: ["--context-length", "32768"]

    def check(self) -> None:
        """rollout.sglang_args.*, one sentence per rule."""
        if self.max_running_requests is not None:
            _positive(self.max_running_requests, "rollout.sglang_args.max_running_requests")
        keyed = [f for f in self.extra if str(f).split("=")[0] in ("--api-key", "--admin-api-key", "--config")]
        if keyed:
            raise ValueError(f"rollout.sglang_args.extra may not hold {keyed[0].split('=')[0]}: the launch passes the "
                             "servers' key as SGLang's --config file (rollout.sglang_args.api_key_file, default "
                             "run_dir/servers/api_key.yaml), never on a command line")


@dataclass
class ServerLayout:
    node: int = 0  # trainer node (torchrun --node_rank) whose local rank 0 launches and supervises this server
    gpus: list = field(default_factory=list)  # physical GPU ids on that node (its CUDA_VISIBLE_DEVICES); [] on CPU
    tp: int = 1  # SGLang --tp-size
    dp: int = 1  # SGLang --dp-size
    pp: int = 1  # SGLang --pp-size (dp or pp > 1: weight_sync.method=disk only, see validate_server_layout)

    def check(self, key: str) -> None:
        """One server (`key`: rollout.server_layout[i]) on its own; validate_server_layout checks the rest."""
        for name in ("tp", "dp", "pp"):
            _positive(getattr(self, name), f"{key}.{name}")
        if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in self.gpus):
            raise ValueError(f"{key}.gpus must be a list of GPU ids (integers >= 0), got {self.gpus!r}")


@dataclass
class SamplingConfig:
    temperature: float = 1.0  # sampling temperature; the trainer scales logits by the same value
    top_p: float = 1.0  # nucleus sampling (1 = off; below 1 the trainer renormalises its log-probs over the kept set)
    top_k: int = -1  # top-k sampling (-1 = off; the trainer renormalises over the kept set too)
    min_p: float = 0.0  # min-p sampling: keep p >= min_p x the largest (0 = off; renormalised over the kept set too)
    backend: str = "auto"  # auto | flashinfer | pytorch: the servers' --sampling-backend (auto: from sglang_args.extra)
    max_new_tokens: int = 16  # response length limit per trajectory (summed over turns in multi-turn)

    def check(self) -> None:
        """rollout.sampling.*, one sentence per rule."""
        _positive(self.max_new_tokens, "rollout.sampling.max_new_tokens")
        _positive(self.temperature, "rollout.sampling.temperature")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:  # SGLang's own rule (sampling_params.py: verify)
            raise ValueError(f"rollout.sampling.top_k must be -1 (off) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:  # SGLang's own rule too
            raise ValueError(f"rollout.sampling.min_p must be in [0, 1], got {self.min_p}")


@dataclass
class RolloutConfig:
    servers: list = field(default_factory=list)  # URLs of running inference servers (connect mode)
    router_url: Optional[str] = None  # URL of an sglang-router; its workers are listed via GET /workers
    launch: str = "engine"  # engine | sglang | none: which servers rank 0 starts when `servers` is empty
    server_layout: list[ServerLayout] = field(default_factory=lambda: [ServerLayout()])  # servers to launch, one each
    base_port: int = 31000  # first port of launched servers (server i of server_layout listens on base_port + i)
    sglang_args: SGLangArgs = field(default_factory=SGLangArgs)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    function: str = "single_turn"  # single_turn | multi_turn_tool | module:function
    env: Optional[str] = None  # multi-turn tool environment: null = the task's own (calc_tool, calc_py) | module:attr
    env_max_concurrent: int = 64  # environment steps in progress at once (a sync step: on as many threads)
    env_step_timeout_s: float = 60.0  # one environment step longer than this fails its trajectory
    env_fail_stop_steps: int = 64  # stop the run when this many environment steps in a row failed (0: never)
    env_retries: int = 0  # times a step that raised or timed out is run again (idempotent tools only)
    env_max_obs_tokens: int = 2048  # an environment observation is cut to this many tokens (counted), before it is kept
    partial: bool = False  # keep in-flight work across the step boundary (how: pause_mode) instead of waiting for it
    pause_mode: str = "abort"  # abort (restore complete groups, re-send) | retract | in_place (servers keep requests)
    mask_offpolicy_in_partial_rollout: bool = False  # loss mask 0 on restored tokens from older weight versions
    filter: list = field(default_factory=lambda: ["failed"])  # collector filters: failed | all_equal_reward
    filter_stop_groups: Optional[int] = None  # stop when the filter drops this many in a row (null: 4 x B, >= 64; 0: off)
    min_group_size: Optional[int] = None  # filter failed: train on >= this many survivors (null: N // 2, >= 2)
    async_max_concurrent_samples: Optional[int] = None  # cap on generating trajectories (groups = value // N)
    max_weight_staleness: Optional[int] = None  # drop a group with a trajectory whose current - start version exceeds this
    max_prompt_tokens: Optional[int] = None  # longer prompts stop the run at start-up, counted (null = no limit)
    trajectory_timeout_s: float = 600.0  # abort a trajectory running longer than this and mark it failed
    request_timeout_s: float = 1500.0  # HTTP timeout of one /generate call (with a router: below its own timeout)
    router_request_timeout_s: float = 1800.0  # sglang-router's --request-timeout-secs (its default is 1800)
    max_retries: int = 5  # retries of a /generate call on connection errors and 5xx
    retry_backoff_s: float = 0.5  # first /generate retry (and failed abort) delay; doubles each time, capped at 30 s
    router_max_concurrent_requests: Optional[int] = None  # the router's concurrency limit; null = unlimited
    reward_pool: str = "auto"  # auto (process if the reward may hang: math; else thread) | thread | process | inline
    reward_workers: int = 4  # threads or processes scoring rewards off the rollout event loop
    reward_timeout_s: float = 30.0  # reward_pool process: a call longer than this is killed and fails its trajectory
    startup_timeout_s: float = 300.0  # wait this long for launched servers to report healthy
    pause_timeout_s: float = 600.0  # a longer pause fails the run; also each /pause_generation, /continue_generation call's timeout
    reuse_servers: bool = True  # a restarted attempt reuses the launched servers the crashed one left running
    server_keepalive_s: float = 300.0  # a launched server stops when no trainer renewed its lease for this long
    server_stall_s: float = 0.0  # no step-loop progress for this long stops the lease's renewal; 0: control timeout

    def check(self, N: int) -> None:
        """rollout.*, one sentence per rule (its sections' own checks included); N: the data source's
        num_trajectories_per_prompt. The server layout is checked with the nodes it runs on: validate_server_layout."""
        if self.mask_offpolicy_in_partial_rollout and not self.partial:
            raise ValueError("rollout.mask_offpolicy_in_partial_rollout=true requires rollout.partial=true")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"rollout.pause_mode must be one of {', '.join(PAUSE_MODES)}, got '{self.pause_mode}'")
        if self.pause_mode != "abort" and not self.partial:
            raise ValueError(f"rollout.pause_mode={self.pause_mode} requires rollout.partial=true (without it the "
                             "step boundary waits for everything in flight and keeps nothing)")
        validate_concurrency(self.async_max_concurrent_samples, N)
        if self.max_prompt_tokens is not None:
            _positive(self.max_prompt_tokens, "rollout.max_prompt_tokens")
        if self.max_weight_staleness is not None and self.max_weight_staleness < 0:
            raise ValueError(f"rollout.max_weight_staleness must be >= 0 or null, got {self.max_weight_staleness}")
        for f in self.filter:
            if f not in ("failed", "all_equal_reward"):
                raise ValueError(f"rollout.filter entry '{f}' is unknown; accepted: failed, all_equal_reward")
        if self.filter_stop_groups is not None and self.filter_stop_groups < 0:
            raise ValueError(f"rollout.filter_stop_groups must be >= 0 (0: never stop) or null (4 x B, at least 64), "
                             f"got {self.filter_stop_groups}")
        buffer.validate_min_group_size(self.min_group_size, N)
        if "all_equal_reward" in self.filter and N == 1:
            raise ValueError("rollout.filter all_equal_reward needs data_source.num_trajectories_per_prompt > 1: "
                             "with one trajectory per prompt every group has equal rewards and would be dropped")
        if self.launch not in ("engine", "sglang", "none"):
            raise ValueError(f"rollout.launch must be one of engine, sglang, none, got '{self.launch}'")
        self.sampler.check()
        self.sglang_args.check()
        self.sampling.check()
        logprobs.sampling_backend(self.sampling.backend, self.sglang_args.extra)  # an unknown or contradicted backend
        self._check_client()
        self._check_env()

    def _check_client(self) -> None:
        """The timeouts, retries and limits of the rollout's requests and reward calls."""
        for key in ("trajectory_timeout_s", "request_timeout_s", "startup_timeout_s", "pause_timeout_s",
                    "retry_backoff_s", "reward_workers", "reward_timeout_s", "router_request_timeout_s"):
            _positive(getattr(self, key), f"rollout.{key}")
        if self.server_keepalive_s < 5:
            raise ValueError(f"rollout.server_keepalive_s must be at least 5 (seconds: the trainer renews the "
                             f"launched servers' lease every second), got {self.server_keepalive_s!r}")
        if self.router_url and self.request_timeout_s >= self.router_request_timeout_s:
            raise ValueError(f"rollout.request_timeout_s ({self.request_timeout_s:g}) must be below "
                             f"rollout.router_request_timeout_s ({self.router_request_timeout_s:g}, the router's "
                             "--request-timeout-secs), so that ours fires first and the client, not the router and "
                             "its own retries, decides what happens to a request that runs too long")
        if self.max_retries < 0:
            raise ValueError(f"rollout.max_retries must be >= 0, got {self.max_retries}")
        if self.router_max_concurrent_requests is not None:
            _positive(self.router_max_concurrent_requests, "rollout.router_max_concurrent_requests")
        if self.reward_pool not in scoring.POOLS:
            raise ValueError(f"rollout.reward_pool must be one of {', '.join(scoring.POOLS)}, got "
                             f"'{self.reward_pool}'")

    def _check_env(self) -> None:
        """The tool environment of multi-turn rollout functions and the bounds of its steps."""
        for key in ("env_max_concurrent", "env_step_timeout_s", "env_max_obs_tokens"):
            _positive(getattr(self, key), f"rollout.{key}")
        if self.env_retries < 0:
            raise ValueError(f"rollout.env_retries must be >= 0 (0: a failed step is not run again), got "
                             f"{self.env_retries}")
        if self.function != "single_turn" and (self.env_retries + 1) * self.env_step_timeout_s >= self.pause_timeout_s:
            step = (f"rollout.env_step_timeout_s ({self.env_step_timeout_s:g})" if not self.env_retries else
                    f"rollout.env_step_timeout_s x (rollout.env_retries + 1) ({self.env_step_timeout_s:g} x "
                    f"{self.env_retries + 1}, a step and its retries)")
            raise ValueError(f"{step} must be below rollout.pause_timeout_s ({self.pause_timeout_s:g}): a pause waits "
                             "for the environment steps in progress, which are never cut short (their side effects "
                             "would be half done)")
        if self.env_fail_stop_steps < 0:
            raise ValueError(f"rollout.env_fail_stop_steps must be >= 0 (0: never stop), got "
                             f"{self.env_fail_stop_steps}")
        if self.env is not None and self.function == "single_turn":
            raise ValueError(f"rollout.env={self.env} is used by multi-turn rollout functions only; set rollout."
                             "function=multi_turn_tool (or a module:function of yours that calls tasks.make_env), or "
                             "unset rollout.env")
        if self.env is not None:
            import tasks

            plugins.lookup(tasks.ENVS, self.env, "rollout.env", also="null (the task's own), ")


@dataclass
class WeightSyncConfig:
    method: str = "distributed"  # distributed (broadcast group) | tensor (colocate: shared tensors / CUDA IPC) | disk
    bucket_mb: int = 512  # MiB of whole FSDP units per bucket (one push call; a larger unit alone)
    timeout_s: float = 600.0  # every weight-sync call and the broadcast group time out after this
    master_port: int = 29700  # port of the trainer-to-servers broadcast group
    master_address: Optional[str] = None  # where servers reach trainer rank 0 (None: 127.0.0.1 if it launched them)
    delta: bool = False  # send only the elements changed in the servers' dtype (servers: --custom-weight-loader)
    delta_full_every: int = 20  # with delta: every this many versions a full sync (and the first, resume, rejoin)
    dtype: str = "auto"  # the servers' dtype, pushed in: auto (bfloat16 on cuda, float32 on cpu) | bfloat16 | float32

    def check(self) -> None:
        """weight_sync.*, one sentence per rule."""
        if self.method not in ("distributed", "tensor", "disk"):
            raise ValueError(f"weight_sync.method must be distributed, tensor or disk, got '{self.method}'")
        _positive(self.bucket_mb, "weight_sync.bucket_mb")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"weight_sync.dtype must be auto, bfloat16 or float32 (the servers' dtype), got "
                             f"'{self.dtype}'")
        if not isinstance(self.delta_full_every, int) or self.delta_full_every < 1:
            raise ValueError(f"weight_sync.delta_full_every must be an integer >= 1 (1: every sync full), got "
                             f"{self.delta_full_every!r}")
        if self.delta and self.method == "tensor":
            raise ValueError("weight_sync.delta=true needs weight_sync.method distributed or disk: with tensor "
                             "(colocate) nothing crosses a wire, so there is nothing for a delta to save")
        _positive(self.timeout_s, "weight_sync.timeout_s")


@dataclass
class WandbConfig:
    enable: bool = False  # log to wandb (off unless set)
    project: str = "asyncrl"  # wandb project
    mode: str = "online"  # online | offline
    name: Optional[str] = None  # run name (default: run_dir's name)

    def check(self) -> None:
        if self.mode not in ("online", "offline"):
            raise ValueError(f"logging.wandb.mode must be online or offline, got '{self.mode}'")


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    wait_line_s: float = 10.0  # while the trainer waits for groups, a line (stdout, waiting.jsonl) this often; 0 = none
    train_samples: int = 4  # trained trajectories a step in samples/train.jsonl, one a group; -1: all of them

    def check(self) -> None:
        """logging.*, one sentence per rule."""
        if self.wait_line_s < 0:
            raise ValueError(f"logging.wait_line_s must be >= 0 (0: no waiting lines), got {self.wait_line_s}")
        if self.train_samples < -1:
            raise ValueError(f"logging.train_samples must be >= 0 (trajectories a step, one a group) or -1 (every "
                             f"trained trajectory), got {self.train_samples}")
        self.wandb.check()


@dataclass
class Config:
    name: str = "run"  # run name (default: the config file's stem)
    run_dir: Optional[str] = None  # metrics.jsonl, resolved config, checkpoints, child logs (default runs/<name>)
    seed: int = 0  # global seed (model init, sampling seeds, shuffles derive from it)
    colocate: bool = True  # rollout and training share the same GPUs (must be false for fully-async)
    run_mode: str = "default"  # default | rollout-only | train-only (the last two in synchronous mode only)
    device: str = "auto"  # auto | cpu | cuda: where the trainer runs
    model: ModelConfig = field(default_factory=ModelConfig)
    data_source: list[DataSourceConfig] = field(default_factory=lambda: [DataSourceConfig()])  # one source, or a list of several
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: LossSettings = field(default_factory=LossSettings)
    fully_async: FullyAsyncConfig = field(default_factory=FullyAsyncConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferSettings = field(default_factory=BufferSettings)  # its keys: KEYS; the whole: buffer_settings()
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # ---- derived values (computed, never configured) ----
    @property
    def B(self) -> int:
        return self.data_source[0].num_prompts_per_step

    @property
    def N(self) -> int:
        return self.data_source[0].num_trajectories_per_prompt

    @property
    def M(self) -> int:
        return self.trainer.mini_batch_size

    @property
    def capacity(self) -> int:
        """C = int(B * (1 + stale_steps)): in-flight plus buffered prompt groups (docs/design.md, symbols); a preset
        derives it from fully_async.policy_param."""
        return dataclasses.replace(self.buffer_settings(), fully_async=True).capacity

    @property
    def filter_stop_groups(self) -> int:
        """Groups dropped by rollout.filter in a row after which the run stops as untrainable (0: never); see
        buffer.BufferSettings.stop_groups."""
        return self.buffer_settings().stop_groups

    def buffer_settings(self) -> BufferSettings:
        """What the buffer reads of this config (buffer.PipelineServer takes either): the buffer section, its other
        fields filled in from the sections that hold them."""
        fa, r = self.fully_async, self.rollout
        return dataclasses.replace(
            self.buffer, num_prompts_per_step=self.B, num_trajectories_per_prompt=self.N, fully_async=fa.enable,
            sliding_window=fa.sliding_window, stale_steps=fa.stale_steps, policy_param=fa.policy_param,
            num_oversample=r.sampler.num_oversample, async_max_concurrent_samples=r.async_max_concurrent_samples,
            filter=tuple(r.filter), filter_stop_groups=r.filter_stop_groups, min_group_size=r.min_group_size,
            max_weight_staleness=r.max_weight_staleness, partial=r.partial, pause_mode=r.pause_mode,
            sources=[buffer.SourceSettings(d.task, d.reward, d.weight, d.seed, d.shuffle) for d in self.data_source])

    @property
    def flush_on_update(self) -> bool:
        """Whether weight updates flush the servers' cache: not with rollout.pause_mode=in_place, whose kept
        requests still run (SGLang refuses the flush then, failing the update)."""
        return self.rollout.pause_mode != "in_place"

    @property
    def calls_per_step(self) -> int:
        """(B * N) // M training calls per outer step."""
        return self.B * self.N // self.M

    @property
    def groups_per_call(self) -> int:
        """M // N groups fetched from PipelineBuffer per training call."""
        return max(1, self.M // self.N)


# ---- Building a Config from dicts, with errors that name the key ----

def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently coerce) `value` against annotation `tp`; raise ValueError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"config key '{key}' must be a mapping of {tp.__name__} fields, got {value!r}")
        return _from_dict(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 1e-6, written without a dot, as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"config key '{key}' must be a string, got {value!r}")
    if origin is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):  # a list of mappings, each checked
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key '{key}' must be a list of {typing.get_args(tp)[0].__name__} mappings, "
                             f"got {value!r}")
        return [_coerce(v, typing.get_args(tp)[0], item_key(key, i, len(value))) for i, v in enumerate(value)]
    if tp in (list, tuple):
        if isinstance(value, (list, tuple)):
            return tp(value)
        raise ValueError(f"config key '{key}' must be a list, got {value!r}")
    return value


# A config key, or a key=value, this project no longer has -> the sentence that refuses it, naming the new one;
# _from_dict consults it for every key it reads.
RENAMED_SETTINGS = {
    "rollout.sglang_args.api_key": "rollout.sglang_args.api_key is now rollout.sglang_args.api_key_file, a file of "
                                   "mode 0600 holding one line `api-key: KEY` (a key in the config would be in "
                                   "run_dir/config.yaml and on the servers' command lines); servers the run launches "
                                   "get a key of their own without it",
    "algorithm.m2po.enable": "algorithm.m2po.enable is now algorithm.m2_mask.enable (with algorithm.m2_mask.tau): "
                             "AReaL's M2PO mask of log(pi_old / mu) inside the PPO clip; the published M2PO, ratio "
                             "pi_theta / mu and no clip, is algorithm.policy_loss=m2po (algorithm.m2po.tau)",
    "algorithm.policy_loss=recompute": "algorithm.policy_loss=recompute is now decoupled_ppo, AReaL's decoupled PPO as "
                                       "published (behaviour weight pi_prox / mu masked above "
                                       "algorithm.decoupled_ppo.behav_imp_weight_cap, not clamped at "
                                       "algorithm.is_correction.clip; behav_imp_weight_action=clamp for AReaL's clamp)",
    "data_sources": "data_sources is now data_source, which takes one source's mapping or a list of them (several "
                    "sources, mixed by weight in synchronous mode)",
}


def item_key(key: str, i: int, n: int) -> str:
    """Entry i of the n of list key `key`, as messages name it: key[i]; the key alone for a ONE_OR_MORE key's one."""
    return key if key in ONE_OR_MORE and n == 1 else f"{key}[{i}]"


def _keys(cls) -> list:
    """The config keys of a section's dataclass: its fields (the buffer section: BufferSettings.KEYS)."""
    return list(BufferSettings.KEYS) if cls is BufferSettings else [f.name for f in dataclasses.fields(cls)]


def _from_dict(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = set(_keys(cls))
    kwargs = {}
    for k, v in data.items():
        for old in (prefix + k, f"{prefix}{k}={v}" if isinstance(v, str) else None):
            if old in RENAMED_SETTINGS:
                raise ValueError(RENAMED_SETTINGS[old])
        if k not in names:
            raise ValueError(f"unknown config key '{prefix}{k}'; {cls.__name__} accepts: {', '.join(sorted(names))}")
        if prefix + k in ONE_OR_MORE:  # one mapping (a list of one), or a non-empty list of them
            v = [v] if isinstance(v, dict) else v
            if not (isinstance(v, list) and v):
                raise ValueError(f"config key '{prefix}{k}' must be a mapping or a non-empty list of them, got {v!r}")
        kwargs[k] = _coerce(v, hints[k], prefix + k)
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    """The resolved config as plain YAML-able data (saved beside metrics.jsonl; sent to child processes): config
    keys only, a ONE_OR_MORE list of one as its mapping."""
    d = dataclasses.asdict(cfg)
    d["trainer"]["betas"] = list(d["trainer"]["betas"])
    d["buffer"] = {k: d["buffer"][k] for k in BufferSettings.KEYS}
    d.update({key: d[key][0] for key in ONE_OR_MORE if len(d[key]) == 1})
    return d


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[parts[-1]] = value


def parse_overrides(args: list[str]) -> dict:
    """`a.b=c` strings -> nested dict; values are parsed as YAML (so 1, 1.5, true, null, [1,2] work)."""
    import yaml  # here, not at the top: only reading YAML (a file, an override's value) needs it

    out: dict = {}
    for a in args:
        if "=" not in a:
            raise ValueError(f"override '{a}' must look like key=value, e.g. fully_async.enable=true")
        k, v = a.split("=", 1)
        _set_dotted(out, k.strip(), yaml.safe_load(v) if v != "" else None)
    return out


def _merge(base: dict, over: dict, prefix: str = "") -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v, f"{prefix}{k}.")
        elif isinstance(v, dict) and isinstance(out.get(k), list):  # which entry a.b=c meant is not known
            raise ValueError(f"config key '{prefix}{k}' holds a list here; override it whole ({prefix}{k}=[...]), "
                             "not one field")
        else:
            out[k] = v
    return out


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, validate_cfg: bool = True) -> Config:
    """Load YAML at `path` (may be None), apply `a.b=c` overrides, build the dataclass tree (from_dict: its plugins
    registered, its derived values filled in), validate."""
    import yaml  # here, not at the top: only reading YAML (a file, an override's value) needs it

    data: dict = {}
    if path is not None:
        if not os.path.exists(path):
            raise ValueError(f"config file '{path}' does not exist")
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file '{path}' must contain a mapping at the top level")
        data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    data = _merge(data, parse_overrides(overrides or []))
    cfg = from_dict(data)
    if validate_cfg:
        validate(cfg)
    return cfg


def from_dict(data: dict) -> Config:
    """Build a Config from a plain dict (e.g. `to_dict` output shipped to a child process), with the `module:attr`
    plugins it names registered in this process (load_plugins) and its derived values filled in (resolve)."""
    cfg = _from_dict(Config, data)
    load_plugins(cfg)
    return resolve(cfg)


def resolve(cfg: Config) -> Config:
    """Fill in, in place, what a config leaves to be derived when unset: run_dir (runs/<name>), and a preset's own
    concurrency cap (strategies.Preset.max_concurrent_samples) as rollout.async_max_concurrent_samples."""
    if cfg.run_dir is None:
        cfg.run_dir = os.path.join("runs", cfg.name)
    preset = strategies.REGISTRY.get(cfg.fully_async.sliding_window)
    if (isinstance(preset, type) and issubclass(preset, strategies.Preset)
            and cfg.rollout.async_max_concurrent_samples is None):  # the peer's own cap, the preset's companion knob
        cfg.rollout.async_max_concurrent_samples = preset.max_concurrent_samples(cfg.B, cfg.N)
    return cfg


# ---- Start-up validation: every rule of the spec's parameter table, one sentence each ----

def _positive(value, key: str) -> None:
    if value is None or value <= 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")


# Float fields where +inf means something no finite value does (every other "no limit" is null or 0): the
# behaviour weight pi_prox / mu kept uncapped, and no upper PPO clip.
INFINITY_ACCEPTED = {"algorithm.decoupled_ppo.behav_imp_weight_cap": "an uncapped behaviour weight",
                     "algorithm.clip_high": "no upper clip"}


def check_finite(obj, prefix: str = "") -> None:
    """Every float of a dataclass tree (nested dataclasses, lists and tuples of either included) is a finite number:
    NaN never, +-inf only where INFINITY_ACCEPTED names the key (and only +inf); else one sentence naming the key."""
    for f in dataclasses.fields(obj):
        _check_finite_value(getattr(obj, f.name), prefix + f.name)


def _check_finite_value(value, key: str) -> None:
    if dataclasses.is_dataclass(value):
        check_finite(value, key + ".")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite_value(v, item_key(key, i, len(value)))
    elif isinstance(value, float) and not math.isfinite(value):
        if value == math.inf and key in INFINITY_ACCEPTED:
            return
        also = f" (.inf is accepted only by {', '.join(INFINITY_ACCEPTED)})" if math.isinf(value) else ""
        raise ValueError(f"config key '{key}' must be a finite number, got {value!r}{also}")


def control_timeout_s(cfg: Config) -> float:
    """The trainer's control group's timeout: rank 0's longest wait between two collectives (data, pause, server
    start-up, a weight sync), which the other ranks spend in it, plus 600 s for everything else between them."""
    return (cfg.buffer.get_timeout_s + cfg.rollout.pause_timeout_s + cfg.rollout.startup_timeout_s
            + cfg.weight_sync.timeout_s + 600)


def server_stall_s(cfg: Config) -> float:
    """How long the step loop may go without progress before the servers' lease is no longer renewed
    (rollout.server_stall_s; 0: control_timeout_s, past which a multi-rank run fails by itself)."""
    return cfg.rollout.server_stall_s or control_timeout_s(cfg)


def validate(cfg: Config) -> Config:
    """Every start-up rule, one sentence each: each section's own (its check method) and the rules across sections.
    Changes nothing (loading registered the plugins and filled in the derived values: from_dict); returns cfg."""
    check_finite(cfg)
    for i, ds in enumerate(cfg.data_source):
        ds.check(item_key("data_source", i, len(cfg.data_source)))
    cfg.trainer.check()
    cfg.model.check()
    _check_batch_sizes(cfg)
    if cfg.run_mode not in RUN_MODES:
        raise ValueError(f"run_mode must be one of {', '.join(RUN_MODES)}, got '{cfg.run_mode}'")
    if cfg.device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got '{cfg.device}'")
    cfg.fully_async.check(cfg.B, cfg.N)
    _check_fully_async(cfg)
    cfg.rollout.check(cfg.N)
    _check_placement(cfg)
    validate_server_layout(cfg)
    _check_sources(cfg)
    cfg.algorithm.check(cfg.trainer.use_rollout_log_probs)
    cfg.weight_sync.check()
    cfg.buffer.check()
    _check_stall(cfg)
    cfg.logging.check()
    return cfg


def _check_batch_sizes(cfg: Config) -> None:
    """B x N, M and N fit together: whole training calls of whole groups (the spec's table)."""
    B, N, M = cfg.B, cfg.N, cfg.M
    if (B * N) % M != 0:
        raise ValueError(
            f"data_source.num_prompts_per_step x data_source.num_trajectories_per_prompt ({B} x {N} = {B * N}) "
            f"must be divisible by trainer.mini_batch_size ({M})")
    if M % N != 0:
        warnings.warn(f"trainer.mini_batch_size ({M}) is not a multiple of data_source.num_trajectories_per_prompt "
                      f"({N}); each training call fetches M // N = {M // N} groups", stacklevel=3)
    if M < N:
        raise ValueError(f"trainer.mini_batch_size ({M}) must be >= data_source.num_trajectories_per_prompt ({N}) "
                         "so that every training call gets at least one complete group")


def _check_fully_async(cfg: Config) -> None:
    """fully_async.enable=true: the strategy accepts the update action the rollout settings select
    (strategies.Strategy.check_action), and the rest of the run is one fully-async mode can run."""
    fa = cfg.fully_async
    if not fa.enable:
        return
    strategies.lookup(fa.sliding_window).check_action(fa.sliding_window, fa.policy_param, cfg.B, cfg.N,
                                                      cfg.rollout.partial, cfg.rollout.pause_mode)
    if cfg.colocate:
        raise ValueError("fully_async.enable=true requires colocate=false: rollout and training need their own "
                         "GPUs")
    if cfg.run_mode != "default":
        raise ValueError(f"fully_async.enable=true supports only run_mode=default, got run_mode={cfg.run_mode}")
    if len(cfg.data_source) != 1:
        raise ValueError(f"fully_async.enable=true supports a single data source, got {len(cfg.data_source)} "
                         "in data_source")
    if cfg.rollout.sampler.num_oversample != 0:
        raise ValueError("rollout.sampler.num_oversample must be 0 when fully_async.enable=true; extra in-flight "
                         "capacity comes from fully_async.stale_steps")


def _check_placement(cfg: Config) -> None:
    """What colocate, device and a speculative draft model allow of the pause, the weight sync and attention."""
    if cfg.rollout.pause_mode == "in_place" and cfg.colocate:
        raise ValueError("rollout.pause_mode=in_place does not work with colocate=true: the kept requests hold "
                         "their KV cache, and a server releases its memory only with no request running; use "
                         "rollout.pause_mode=retract or abort")
    if cfg.colocate and cfg.weight_sync.method == "distributed" and cfg.device == "cuda":
        raise ValueError("colocate=true with weight_sync.method=distributed cannot run on device=cuda: NCCL refuses a "
                         "group of trainer rank 0 and the servers on the same GPUs; use weight_sync.method=tensor")
    if cfg.model.attn_implementation == "flash_attention_2" and cfg.device == "cpu":
        raise ValueError("model.attn_implementation=flash_attention_2 needs device=cuda; on CPU use auto or sdpa")
    extra = " ".join(map(str, cfg.rollout.sglang_args.extra)).replace("=", " ").split()
    algorithm, ws = dict(zip(extra, extra[1:])).get("--speculative-algorithm", "NONE"), cfg.weight_sync
    if algorithm.upper() not in ("NGRAM", "UNO", "NONE") and ws.method == "disk" and not ws.delta:
        raise ValueError(f"weight_sync.method=disk would reload the servers' speculative draft model (--speculative-"
                         f"algorithm {algorithm} in rollout.sglang_args.extra) from the policy's checkpoint; use "
                         "weight_sync.method distributed or tensor, or weight_sync.delta=true (target model only)")


def _check_sources(cfg: Config) -> None:
    """The data sources of one run share N, and a reward that may hang runs where it can be killed."""
    N, sources = cfg.N, cfg.data_source
    for i, ds in enumerate(sources[1:], start=1):
        if ds.num_trajectories_per_prompt != N:
            raise ValueError(f"data_source[{i}].num_trajectories_per_prompt ({ds.num_trajectories_per_prompt}) must "
                             f"equal data_source[0].num_trajectories_per_prompt ({N}): groups of one step share N")
    pool = cfg.rollout.reward_pool
    if pool in ("thread", "inline"):  # a reward that may hang needs a pool whose workers can be killed
        import tasks

        for i, ds in enumerate(sources):
            name = ds.reward or tasks.default_reward(ds.task)
            if scoring.may_hang(tasks.get_reward_fn(name)):
                raise ValueError(f"{item_key('data_source', i, len(sources))}.reward {name} may run for minutes "
                                 f"(math-verify's sympy on an answer such as 9^{{9^{{9^{{9}}}}}}) and must run where "
                                 f"it can be killed: rollout.reward_pool=process or auto, not {pool}")


def _check_stall(cfg: Config) -> None:
    """rollout.server_stall_s leaves every wait of the trainer its own timeout."""
    r, ws = cfg.rollout, cfg.weight_sync
    waits = {"buffer.get_timeout_s": cfg.buffer.get_timeout_s, "rollout.pause_timeout_s": r.pause_timeout_s,
             "rollout.startup_timeout_s": r.startup_timeout_s, "weight_sync.timeout_s": ws.timeout_s}
    longest = max(waits, key=waits.get)
    if r.server_stall_s != 0 and r.server_stall_s < waits[longest]:
        raise ValueError(f"rollout.server_stall_s must be 0 (the control group's timeout, "
                         f"{control_timeout_s(cfg):g} s) or at least the longest wait's own timeout ({longest}="
                         f"{waits[longest]:g}): a trainer waiting within its timeouts is not wedged, got "
                         f"{r.server_stall_s!r}")


def load_plugins(cfg: Config) -> None:
    """Every `module:attr` extension point, loaded with plugins.load and registered in its role's registry under
    the spec string itself, so that the role code finds it by name as it finds a built-in one. from_dict calls this,
    and every process of a run loads its config (trainer ranks, buffer and rollout processes: each a fresh
    interpreter), so each registers its own. A role module is imported only when one of its keys is a plugin."""
    fa, a, r = cfg.fully_async, cfg.algorithm, cfg.rollout

    def register(registry: dict, spec: str, key: str, accepted: str, ok, expected: str) -> None:
        """plugins.load(spec), checked by ok(obj) (else one sentence: `key` must name `expected`), into registry."""
        obj = plugins.load(spec, key, accepted)
        if not ok(obj):
            raise ValueError(f"{key} '{spec}' must name {expected}, got {obj!r}")
        registry[spec] = obj

    if plugins.is_spec(fa.sliding_window):
        register(strategies.REGISTRY, fa.sliding_window, "fully_async.sliding_window", "a registered strategy name",
                 lambda c: isinstance(c, type) and issubclass(c, strategies.Strategy),
                 "a subclass of strategies.Strategy")
    if plugins.is_spec(a.policy_loss):  # its @losses.register declaration travels with the function
        register(losses.POLICY_LOSSES, a.policy_loss, "algorithm.policy_loss",
                 f"one of {plugins.builtin_names(losses.POLICY_LOSSES)}", lambda fn: _takes(fn, 3),
                 "a function (batch: losses.TokenBatch, settings, denominator) -> (loss, metrics), the signature of "
                 "every policy loss")
    for i, ds in enumerate(cfg.data_source):
        if plugins.is_spec(ds.reward):
            import tasks
            key = f"{item_key('data_source', i, len(cfg.data_source))}.reward"
            register(tasks.REWARDS, ds.reward, key, f"one of {plugins.builtin_names(tasks.REWARDS)}", callable,
                     "a function (response_text, label, stopped) -> float")
    if plugins.is_spec(r.env):
        import tasks
        register(tasks.ENVS, r.env, "rollout.env", f"one of {plugins.builtin_names(tasks.ENVS)}",
                 lambda env: _takes(env, 2), "a class or factory that builds one tool environment from (label, "
                 "metadata) (max_turns, step(text), optional restore(turns))")
    if plugins.is_spec(r.function):
        import inspect

        import rollout_fns  # the role module whose ROLLOUT_FUNCTIONS the producer looks the name up in
        register(rollout_fns.ROLLOUT_FUNCTIONS, r.function, "rollout.function",
                 f"one of {plugins.builtin_names(rollout_fns.ROLLOUT_FUNCTIONS)}", inspect.iscoroutinefunction,
                 "an async function (ctx, trajs) -> None")


def _takes(obj, n: int) -> bool:
    """Whether obj can be called with n positional arguments: a policy loss with (batch, settings, denominator),
    a tool environment with (label, metadata) as tasks.make_env builds one."""
    import inspect

    if not callable(obj):
        return False
    try:
        inspect.signature(obj).bind(*[None] * n)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): cannot tell, let the first call say
        return True
    return True


def validate_server_layout(cfg: Config) -> None:
    """rollout.server_layout: nodes that exist, tp x dp x pp GPUs per server, no GPU given to two servers of a node
    (overlap with the trainer's GPUs is checked per node at start-up: services.check_gpu_overlap)."""
    r = cfg.rollout
    if r.servers or r.router_url or r.launch == "none" or cfg.run_mode == "train-only":
        return
    if not r.server_layout:
        raise ValueError(f"rollout.server_layout is empty but rollout.launch={r.launch}; give one entry per server "
                         "(e.g. [{node: 0, gpus: [0, 1], tp: 2}]), or rollout.servers to connect to")
    if cfg.run_mode == "rollout-only" and any(s.node for s in r.server_layout):
        raise ValueError("run_mode=rollout-only launches servers on node 0 only (it has no trainer ranks elsewhere); "
                         "set every rollout.server_layout[].node to 0, or give rollout.servers")
    taken: dict = {}
    for i, s in enumerate(r.server_layout):
        key = f"rollout.server_layout[{i}]"
        s.check(key)
        if not 0 <= s.node < cfg.trainer.num_nodes:
            raise ValueError(f"{key}.node={s.node} is not a trainer node: nodes are 0 .. trainer.num_nodes - 1 "
                             f"= {cfg.trainer.num_nodes - 1} (each node's local rank 0 launches its servers)")
        if r.launch == "engine" and s.tp * s.dp * s.pp != 1:
            raise ValueError(f"{key}: standins/engine.py serves one rank (tp = dp = pp = 1), got tp={s.tp} dp={s.dp} "
                             f"pp={s.pp}; use rollout.launch=sglang for parallel servers")
        if r.launch == "sglang" and len(s.gpus) != s.tp * s.dp * s.pp:
            raise ValueError(f"{key}.gpus lists {len(s.gpus)} GPUs but tp x dp x pp = {s.tp} x {s.dp} x {s.pp} = "
                             f"{s.tp * s.dp * s.pp}; give one physical GPU id per rank")
        # SGLang 0.5.23 updates weights in memory on dp = pp = 1 servers only: tokenizer_control_mixin.py asserts
        # dp_size == 1 in the update endpoints (HTTP 500 at the first sync); weight_updater.py's
        # init_weights_update_group joins rank_offset + tp_rank, no pp rank: the stages of pp > 1 collide.
        method = cfg.weight_sync.method
        if method in ("distributed", "tensor") and s.dp > 1:
            raise ValueError(f"{key}.dp={s.dp} with weight_sync.method={method}: SGLang refuses in-memory weight "
                             "updates on a data-parallel server (dp_size == 1); launch several dp=1 servers behind "
                             "the router instead, or use weight_sync.method=disk")
        if method in ("distributed", "tensor") and s.pp > 1:
            raise ValueError(f"{key}.pp={s.pp} with weight_sync.method={method}: SGLang joins every pipeline stage "
                             "to the weight-update group as rank_offset + tp_rank, so the stages collide and the "
                             "broadcast hangs; use pp=1 servers (several behind the router), or "
                             "weight_sync.method=disk")
        for g in s.gpus:
            if (s.node, g) in taken:
                raise ValueError(f"{key} and rollout.server_layout[{taken[s.node, g]}] both use GPU {g} of node "
                                 f"{s.node}; give each server its own GPUs")
            taken[s.node, g] = i


# ---- `python config.py docs`: docs/parameters.md's table, generated from the field comments above ----

def parameter_table() -> str:
    """Markdown table of every config key with its default and its one-line comment (kept in docs/parameters.md)."""
    import inspect
    import re

    import yaml

    rows = []

    def walk(cls, prefix: str) -> None:
        comments = {}
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+): [^=]+?(?: = .*?)?\s+# (.*)$", line)
            if m:
                comments[m.group(1)] = m.group(2)
        hints = typing.get_type_hints(cls)
        default_obj = cls()
        for name in _keys(cls):
            tp = hints[name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")
                continue
            default = getattr(default_obj, name)
            shown = "null" if default is None else (str(default).lower() if isinstance(default, bool) else default)
            item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
            one = prefix + name in ONE_OR_MORE  # one mapping of defaults, `{}`, whose fields are the rows below
            if dataclasses.is_dataclass(item):  # a list of mappings: the default as YAML, then each field's row
                shown = "{}" if one else yaml.safe_dump([dataclasses.asdict(d) for d in default],
                                                        default_flow_style=True, sort_keys=False).strip()
            rows.append(f"| `{prefix}{name}` | `{shown}` | {comments.get(name, '').replace('|', '/')} |")
            if dataclasses.is_dataclass(item):
                walk(item, f"{prefix}{name}{'.' if one else '[].'}")

    walk(Config, "")
    return "| key | default | meaning |\n|---|---|---|\n" + "\n".join(rows)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["docs"] and sys.argv[2:3] == ["--write"]:  # refresh the table in docs/parameters.md or FILE
        import re
        path = sys.argv[3] if len(sys.argv) > 3 else "docs/parameters.md"
        table = f"<!-- params:begin -->\n{parameter_table()}\n<!-- params:end -->"
        text = re.sub(r"<!-- params:begin -->\n.*?<!-- params:end -->", lambda _: table, open(path).read(), flags=re.S)
        open(path, "w").write(text)
    elif sys.argv[1:2] == ["docs"]:
        print(parameter_table())
    elif sys.argv[1:2] == ["check"]:  # checks.py's command (it imports this module: run as a script, not imported)
        import runpy
        sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "checks.py"), *sys.argv[2:]]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        print("usage: python config.py docs [--write docs/parameters.md] | "
              "python config.py check CONFIG.yaml [a.b=c ...]")
