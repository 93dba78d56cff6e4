"""train.py's memory estimate (params, grads, optimizer, snapshot, the root unit, the recomputed layer per rank),
a layer's activations against what autograd saves, the 30B and 4B configs' fit on 80 GB GPUs, and the warning that
names what to change. No model is loaded: its HF config builds it on the meta device, which gives the parameter
count without allocating a byte.
Run: .venv/bin/python -m pytest -q tests/test_memory.py
"""
import os
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import config  # noqa: E402
import memory  # noqa: E402

CONFIG_30B = os.path.join(ROOT, "configs", "qwen3_30b_a3b_dapo.yaml")
GIB = 2 ** 30


@pytest.fixture(scope="module")
def qwen3_30b():
    """Qwen/Qwen3-30B-A3B's config.json values, the model on the meta device."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    hf = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                        num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False,
                        max_position_embeddings=40960)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


@pytest.fixture(scope="module")
def qwen3_4b():
    """Qwen/Qwen3-4B's config.json values (transformers' Qwen3Config defaults are no published size), the model on
    the meta device."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    hf = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                     max_position_embeddings=40960)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


CONFIG_30B_8GPU = os.path.join(ROOT, "configs", "qwen3_30b_a3b_dapo_8gpu.yaml")
CONFIG_4B = os.path.join(ROOT, "configs", "qwen3_4b_math_8gpu.yaml")
GPU_80GB = memory.GPU_80GB_GIB * GIB  # what torch reports for an "80 GB" H100 (79.11 GiB)
USABLE_80GB = (1 - memory.ALLOCATOR_SLACK) * memory.GPU_80GB_GIB  # GiB: less the caching allocator's fragmentation


def _layer_30b(tokens: int) -> float:
    """GiB of the recomputed Qwen3-30B-A3B layer at `tokens`, bf16, counted here from its widths (memory.py's rule
    written out: attention and norms, the grouped_mm experts, the router)."""
    h, q, kv, k, i, e = 2048, 4096, 512, 8, 768, 128
    per_token = (4 * (2 * h + q + kv) + 2 * (2 * h + q + kv + q + kv + kv + q + 2 * h) + 2 * k * (2 * h + 4 * i)
                 + 2 * 4 * e + k * 40 + 2 * (2 * h + 3 * k * h))
    return tokens * per_token / GIB


def test_the_30b_config_fits_8_gpus_of_80gb_by_its_own_estimate(qwen3_30b):
    """Every term of memory.memory_estimate, from the 30B's HF config on the meta device (never loaded): on the
    device (cpu_offload=false) 76.9 GiB, over the 95% of an 80 GB card the allocator leaves, so the config offloads
    the training state (issue 36: the recomputed MoE layer, the root unit and the longest trajectory were not
    counted, and the estimate read 72.8)."""
    n, largest = memory.param_counts(qwen3_30b)
    assert 30.4e9 < n < 30.6e9  # "30.5B" on the model card
    shape = memory.model_shape(qwen3_30b)
    assert shape["root_params"] == 2 * 151936 * 2048 + 2048  # embeddings, lm_head (untied), final norm
    cfg = config.load_config(CONFIG_30B, ["trainer.cpu_offload=false"])
    tokens = memory.micro_batch_tokens(cfg)
    assert tokens == 20480 + 2048 > cfg.trainer.micro_batch_tokens  # the longest trajectory sits alone
    est = memory.memory_estimate(cfg, n, largest, 8, "cuda", shape)
    p = est["parts"]
    shard = n / 8 * 4 / GIB  # float32 master weights, 1/8 each
    assert p["params"] == pytest.approx(shard) and p["grads"] == pytest.approx(shard)
    assert p["optimizer"] == pytest.approx(2 * shard)  # AdamW: exp_avg + exp_avg_sq
    assert p["optimizer step"] == 0.0  # fused AdamW on cuda: no foreach temporaries
    assert p["gathered layers"] == pytest.approx(2 * largest * 2 / GIB)
    assert p["layer gradients"] == pytest.approx(largest * (2 + 4) / GIB)  # bf16 grad + its float32 reduce input
    h, v = 2048, 151936
    assert p["root unit"] == pytest.approx((shape["root_params"] + v * h) * 2 / GIB)  # gathered + lm_head's grad
    assert p["activations"] == pytest.approx(48 * tokens * h * 2 / GIB)  # checkpointed: each layer's input
    assert p["recomputed layer"] == pytest.approx(_layer_30b(tokens))
    assert p["recomputed layer"] > 4 * 34 * tokens * h / GIB  # the dense rule it replaced: 1.4 GiB
    assert p["log-probs"] == pytest.approx((1024 * v * (2 + 4 + 4) + v * h * 4) / GIB)  # one chunk + entropy
    assert p["cuda runtime"] == memory.CUDA_RUNTIME_GIB
    assert est["host"] == pytest.approx(shard / 2)  # trainer.snapshot: cpu, in bf16 (the compute dtype)
    # the head's log-probs and the recomputed layer are never live together
    assert est["device"] == pytest.approx(sum(x for k, x in p.items() if k != "snapshot") - p["log-probs"])
    assert USABLE_80GB < est["device"] < memory.GPU_80GB_GIB  # 76.9: on the edge, does not fit with margin
    without = memory.memory_estimate(cfg, n, largest, 8, "cuda", shape, with_entropy=False)
    assert without["parts"]["log-probs"] == pytest.approx(p["log-probs"] - 1024 * v * 4 / GIB)
    # a top_p support: its boolean mask and the top values of a fifth of a chunk, 2 bytes a chunk entry
    nucleus = memory.memory_estimate(config.load_config(CONFIG_30B, ["trainer.cpu_offload=false",
                                                                    "rollout.sampling.top_p=0.9"]),
                                     n, largest, 8, "cuda", shape)
    assert nucleus["parts"]["log-probs"] == pytest.approx(p["log-probs"] + 1024 * v * 2 / GIB)
    # foreach AdamW: its temporaries are a full float32 shard more
    foreach = memory.memory_estimate(config.load_config(CONFIG_30B, ["trainer.cpu_offload=false",
                                                                    "trainer.optimizer_impl=foreach"]),
                                     n, largest, 8, "cuda", shape)
    assert foreach["device"] == pytest.approx(est["device"] + shard) and foreach["device"] * GIB > GPU_80GB
    on_device = memory.memory_estimate(config.load_config(CONFIG_30B, ["trainer.cpu_offload=false",
                                                                      "trainer.snapshot=device"]),
                                       n, largest, 8, "cuda", shape)
    assert on_device["device"] == pytest.approx(est["device"] + shard / 2) and on_device["host"] == 0
    assert on_device["device"] * GIB > GPU_80GB
    # as shipped: the state in host memory, the GPU with a wide margin
    shipped = memory.memory_estimate(config.load_config(CONFIG_30B), n, largest, 8, "cuda", shape)
    assert shipped["device"] == pytest.approx(est["device"] - 4 * shard) and shipped["device"] < 0.3 * USABLE_80GB
    assert shipped["host"] == pytest.approx(5 * shard + shard / 2)  # + foreach's temporaries (the step on the CPU)
    print(f"\n30B, 8 trainer ranks: on the device {est['device']:.1f} GiB without offload, {shipped['device']:.1f} "
          f"GiB as shipped (host {shipped['host']:.1f} GiB a rank, {8 * shipped['host']:.0f} GiB for 8)")


def test_the_30b_8_gpu_node_layout_fits_by_the_estimate(qwen3_30b):
    """configs/qwen3_30b_a3b_dapo_8gpu.yaml: 4 trainer ranks with cpu_offload (the state on the host, the step on
    the CPU) beside two TP=2 servers on one 8 x 80 GB node; its header's host memory figure."""
    n, largest = memory.param_counts(qwen3_30b)
    cfg = config.load_config(CONFIG_30B_8GPU)
    assert cfg.trainer.num_gpus_per_node == 4 and cfg.trainer.cpu_offload
    assert sorted(g for s in cfg.rollout.server_layout for g in s.gpus) == [4, 5, 6, 7]
    assert memory.optimizer_impl(cfg, "cuda") == "foreach"  # the step runs on the CPU
    est = memory.memory_estimate(cfg, n, largest, 4, "cuda", memory.model_shape(qwen3_30b))
    shard = n / 4 * 4 / GIB
    assert est["host"] == pytest.approx(5 * shard + shard / 2)  # params, grads, 2 moments, step temporaries, snapshot
    assert est["device"] < 0.3 * USABLE_80GB and 600 < 4 * est["host"] < 650  # GiB a GPU; GiB of host memory
    print(f"\n30B, 4 trainer ranks: on the device {est['device']:.1f} GiB, host {est['host']:.1f} GiB a rank, "
          f"{4 * est['host']:.0f} GiB for 4")


def test_the_4b_config_fits_4_gpus_of_80gb_with_its_state_on_them(qwen3_4b):
    """configs/qwen3_4b_math_8gpu.yaml: 4 trainer ranks with every term on the GPU (no offload, fused AdamW), the
    figures its header states; tied embeddings count once (lm_head is embed_tokens)."""
    n, largest = memory.param_counts(qwen3_4b)
    assert n == 4_022_468_096  # "4.0B" on the model card
    shape = memory.model_shape(qwen3_4b)
    assert shape["root_params"] == 151936 * 2560 + 2560  # embeddings (= lm_head) and the final norm
    cfg = config.load_config(CONFIG_4B)
    assert memory.micro_batch_tokens(cfg) == cfg.trainer.micro_batch_tokens == 16384 > 2048 + 8192
    assert memory.optimizer_impl(cfg, "cuda") == "fused" and cfg.trainer.snapshot == "device"
    est = memory.memory_estimate(cfg, n, largest, 4, "cuda", shape)
    p, shard = est["parts"], n / 4 * 4 / GIB
    assert p["params"] == pytest.approx(shard) == pytest.approx(3.746, abs=1e-3)
    assert p["optimizer"] == pytest.approx(2 * shard) and p["snapshot"] == pytest.approx(shard / 2)
    assert p["recomputed layer"] > p["log-probs"]  # so the log-probs are the term left out
    assert est["host"] == 0
    assert est["device"] == pytest.approx(sum(p.values()) - p["log-probs"])
    header = {"params": 3.75, "grads": 3.75, "optimizer": 7.49, "snapshot": 1.87, "gathered layers": 0.38,
              "layer gradients": 0.56, "root unit": 1.45, "activations": 2.81, "recomputed layer": 3.64,
              "log-probs": 2.90, "cuda runtime": 2.00}
    assert {k: round(p[k], 2) for k in header} == header
    assert round(est["device"], 1) == 27.7 and est["device"] < 0.4 * USABLE_80GB
    longer = memory.memory_estimate(config.load_config(CONFIG_4B, ["rollout.sampling.max_new_tokens=16384"]),
                                    n, largest, 4, "cuda", shape)
    assert round(longer["device"] - est["device"], 1) == 0.8  # 18,432-token micro-batches
    print(f"\n4B, 4 trainer ranks: on the device {est['device']:.2f} GiB: "
          + " + ".join(f"{k} {v:.2f}" for k, v in p.items()))


def test_the_4b_servers_one_gpu_each_hold_their_weights_and_a_kv_cache(qwen3_4b):
    """The header's server figures (SGLang's memory, not memory_estimate): bf16 weights within mem_fraction_static
    of an 80 GB GPU, and the KV cache the rest holds, in tokens, against max_running_requests."""
    cfg = config.load_config(CONFIG_4B)
    n, _ = memory.param_counts(qwen3_4b)
    c = qwen3_4b.config
    weights = n * 2 / GIB
    kv_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2  # K and V, bf16
    kv = cfg.rollout.sglang_args.mem_fraction_static * memory.GPU_80GB_GIB - weights
    tokens = kv * GIB / kv_token
    assert all(s.tp == 1 and len(s.gpus) == 1 for s in cfg.rollout.server_layout)
    assert round(weights, 1) == 7.5 and kv_token == 144 * 1024 and round(kv, 1) == 59.8
    assert round(tokens, -3) == 435_000 and int(tokens // (2048 + 8192)) == 42
    assert round(tokens / cfg.rollout.sglang_args.max_running_requests, -2) == 3400


def test_no_snapshot_without_a_second_training_call_or_with_rollout_log_probs(qwen3_30b):
    n, largest = memory.param_counts(qwen3_30b)
    one_call = config.load_config(CONFIG_30B, ["trainer.mini_batch_size=512"])  # B x N = 512: one call per step
    rollout_lp = config.load_config(CONFIG_30B, ["trainer.use_rollout_log_probs=true", "algorithm.m2_mask.enable=false"])
    for cfg in (one_call, rollout_lp):
        assert memory.memory_estimate(cfg, n, largest, 8, "cuda")["parts"]["snapshot"] == 0.0


def test_the_start_up_line_warns_and_names_what_to_change_when_it_does_not_fit(qwen3_30b, qwen3_4b, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=GPU_80GB))
    cuda = torch.device("cuda", 0)
    line = memory.memory_report(config.load_config(CONFIG_30B), qwen3_30b, 8, cuda)
    assert line.startswith("[train] memory per rank, estimated at a step's peak (30.53B parameters over 8 ranks, "
                           "micro-batches up to 22528 tokens)")
    assert "warning" not in line
    line = memory.memory_report(config.load_config(CONFIG_30B, ["trainer.cpu_offload=false"]), qwen3_30b, 8, cuda)
    assert "[train] warning: that is more than 95% of the device's 79.1 GiB; set trainer.micro_batch_tokens" in line
    assert "trainer.cpu_offload=true" in line and "trainer.snapshot=cpu" in line and "model.dtype=bfloat16" in line
    line = memory.memory_report(config.load_config(CONFIG_4B), qwen3_4b, 4, cuda)
    assert line.startswith("[train] memory per rank, estimated at a step's peak (4.02B parameters over 4 ranks, "
                           "micro-batches up to 16384 tokens)")
    assert "on the device 27.70 GiB, in host memory 0.00 GiB" in line and "warning" not in line


def _layer_measured(kind: str, dtype: torch.dtype, peak: bool, tokens: int = 512) -> tuple:
    """One small Qwen3 (dense), Qwen3-MoE (grouped_mm experts, 16 of them, top-4) or Llama (dense, no q/k norms)
    decoder layer on CPU, run forward and backward: (bytes of the tensors autograd saved, bytes at the peak besides
    parameters and gradients: torch's MemTracker, when `peak` and where it exists, else None) and
    memory.layer_activation_bytes of its shape."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    common = dict(vocab_size=128, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  num_hidden_layers=1)
    if kind == "moe":
        hf = Qwen3MoeConfig(moe_intermediate_size=96, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                            **common)
        hf._experts_implementation = "grouped_mm"
    else:
        hf = (LlamaConfig if kind == "llama" else Qwen3Config)(intermediate_size=768, **common)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = {"moe": Qwen3MoeForCausalLM, "llama": LlamaForCausalLM}.get(kind, Qwen3ForCausalLM)(hf).to(dtype)
    layer = model.model.layers[0]
    x = torch.randn(1, tokens, 256, dtype=dtype, requires_grad=True)
    pos = torch.arange(tokens)[None]
    pe = tuple(t.detach() for t in model.model.rotary_emb(x, pos))
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x, *pe]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos)
    measured = None
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    except ImportError:
        peak = False
    if peak:
        tracker = MemTracker()
        tracker.track_external(layer, x)
        with tracker:
            y = layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(torch.ones_like(y))
        snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        measured = snap["Total"] - snap[_MemRefType.PARAM] - snap[_MemRefType.GRAD]
    return sum(saved.values()), measured, memory.layer_activation_bytes(memory.model_shape(model), tokens,
                                                                      dtype.itemsize)


@pytest.mark.parametrize("kind,dtype,peak", [("moe", torch.bfloat16, False), ("moe", torch.float32, True),
                                             ("dense", torch.bfloat16, False), ("dense", torch.float32, False),
                                             ("llama", torch.float32, False)])
def test_a_layers_activations_are_what_autograd_saves(kind, dtype, peak):
    """memory.layer_activation_bytes against one decoder layer run on CPU: the bytes autograd saves (bf16: the
    RMSNorms' float32 upcasts; MoE: the grouped_mm experts' per token x top-k rows; Llama: no q_norm / k_norm, whose
    inputs and outputs, counted for it, were 14% of SmolLM2's layer) to 1%, and for a MoE (float32:
    bf16 is slow on CPU) the backward's peak besides parameters and gradients to 6% (its transients: 3 [tokens x
    top-k, hidden]; measured 1.035x in float32, 1.03x in bf16; a dense layer 0.96-0.97x)."""
    saved, peak, est = _layer_measured(kind, dtype, peak)
    assert saved == pytest.approx(est["saved"], rel=0.01)
    if peak is not None:
        assert peak == pytest.approx(est["saved"] + est["transient"], rel=0.06)


def test_a_moes_experts_count_as_stored(qwen3_30b, tmp_path):
    """Every expert counts (not the top-8 a token runs): the largest layer, gathered whole (FSDP2's unit), holds its
    128 experts; and a tiny Qwen3-MoE counts exactly the tensors of its save_pretrained file."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from standins import tiny_model

    _, largest = memory.param_counts(qwen3_30b)
    experts = 128 * 3 * 2048 * 768  # gate, up and down of each expert
    assert experts < largest < experts + 25e6  # + attention, norms and the router
    path = tiny_model.make_tiny_model(str(tmp_path / "moe"), num_experts=8, experts_per_token=2)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        stored = sum(f.get_slice(k).get_shape()[0] * torch.Size(f.get_slice(k).get_shape()[1:]).numel()
                     for k in f.keys())
    n, _ = memory.param_counts(AutoModelForCausalLM.from_pretrained(path))
    assert n == stored
