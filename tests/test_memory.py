"""train.py's memory estimate (params, grads, optimizer, snapshot per rank), the 30B config's fit on 8 x 80 GB,
and the warning that names what to change. The 30B model is never loaded: its HF config builds it on the meta
device, which gives the parameter count without allocating a byte.
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
GPU_80GB = 80e9  # bytes, as an H100 / A100 80GB reports them roughly
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


SHAPE_30B = {"hidden_size": 2048, "vocab_size": 151936, "num_hidden_layers": 48}
CONFIG_30B_8GPU = os.path.join(ROOT, "configs", "qwen3_30b_a3b_dapo_8gpu.yaml")


def test_the_30b_config_fits_8_gpus_of_80gb_by_its_own_estimate(qwen3_30b):
    """Every term of memory.memory_estimate, from the 30B's HF config on the meta device (never loaded)."""
    n, largest = memory.param_counts(qwen3_30b)
    assert 30.4e9 < n < 30.6e9  # "30.5B" on the model card
    cfg = config.load_config(CONFIG_30B)
    est = memory.memory_estimate(cfg, n, largest, 8, "cuda", SHAPE_30B)
    p = est["parts"]
    shard = n / 8 * 4 / GIB  # float32 master weights, 1/8 each
    assert p["params"] == pytest.approx(shard) and p["grads"] == pytest.approx(shard)
    assert p["optimizer"] == pytest.approx(2 * shard)  # AdamW: exp_avg + exp_avg_sq
    assert p["optimizer step"] == 0.0  # fused AdamW on cuda: no foreach temporaries
    assert p["gathered layers"] == pytest.approx(2 * largest * 2 / GIB)
    assert p["layer gradients"] == pytest.approx(largest * (2 + 4) / GIB)  # bf16 grad + its float32 reduce input
    tokens, h, v = 24576, 2048, 151936
    assert p["activations"] == pytest.approx((48 * tokens * h * 2 + 34 * tokens * h) / GIB)  # checkpointed
    assert p["log-probs"] == pytest.approx((1024 * v * 6 + v * h * 4) / GIB)  # one chunk, never [tokens, vocab]
    assert p["cuda runtime"] == memory.CUDA_RUNTIME_GIB
    assert est["host"] == pytest.approx(shard / 2)  # trainer.snapshot: cpu, in bf16 (the compute dtype)
    assert est["device"] == pytest.approx(sum(x for k, x in p.items() if k != "snapshot"))
    assert 70 < est["device"] < GPU_80GB / GIB - 1.5  # fits, by under 2 GiB (the config says so)
    # foreach AdamW: its temporaries are a full float32 shard more, and then it does not fit
    foreach = memory.memory_estimate(config.load_config(CONFIG_30B, ["trainer.optimizer_impl=foreach"]), n, largest,
                                    8, "cuda", SHAPE_30B)
    assert foreach["device"] == pytest.approx(est["device"] + shard) and foreach["device"] * GIB > GPU_80GB
    on_device = memory.memory_estimate(config.load_config(CONFIG_30B, ["trainer.snapshot=device"]), n, largest, 8,
                                      "cuda", SHAPE_30B)
    assert on_device["device"] == pytest.approx(est["device"] + shard / 2) and on_device["host"] == 0
    assert on_device["device"] * GIB > GPU_80GB


def test_the_30b_8_gpu_node_layout_fits_by_the_estimate(qwen3_30b):
    """configs/qwen3_30b_a3b_dapo_8gpu.yaml: 4 trainer ranks with cpu_offload (the state on the host, the step on
    the CPU) beside two TP=2 servers on one 8 x 80 GB node."""
    n, largest = memory.param_counts(qwen3_30b)
    cfg = config.load_config(CONFIG_30B_8GPU)
    assert cfg.trainer.num_gpus_per_node == 4 and cfg.trainer.cpu_offload
    assert sorted(g for s in cfg.rollout.server_layout for g in s.gpus) == [4, 5, 6, 7]
    assert memory.optimizer_impl(cfg, "cuda") == "foreach"  # the step runs on the CPU
    est = memory.memory_estimate(cfg, n, largest, 4, "cuda", SHAPE_30B)
    shard = n / 4 * 4 / GIB
    assert est["host"] == pytest.approx(5 * shard + shard / 2)  # params, grads, 2 moments, step temporaries, snapshot
    assert est["device"] < 20 and 4 * est["host"] < 700  # GiB a GPU; GiB of host memory for the node


def test_no_snapshot_without_a_second_training_call_or_with_rollout_log_probs(qwen3_30b):
    n, largest = memory.param_counts(qwen3_30b)
    one_call = config.load_config(CONFIG_30B, ["trainer.mini_batch_size=512"])  # B x N = 512: one call per step
    rollout_lp = config.load_config(CONFIG_30B, ["trainer.use_rollout_log_probs=true", "algorithm.m2po.enable=false"])
    for cfg in (one_call, rollout_lp):
        assert memory.memory_estimate(cfg, n, largest, 8, "cuda")["parts"]["snapshot"] == 0.0


def test_the_start_up_line_warns_and_names_what_to_change_when_it_does_not_fit(qwen3_30b, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=GPU_80GB))
    cuda = torch.device("cuda", 0)
    line = memory.memory_report(config.load_config(CONFIG_30B), qwen3_30b, 8, cuda)
    assert line.startswith("[train] memory per rank, estimated at a step's peak (30.53B parameters over 8 ranks)")
    assert "warning" not in line
    line = memory.memory_report(config.load_config(CONFIG_30B), qwen3_30b, 4, cuda)  # half the ranks: 2x the shards
    assert "[train] warning: that is more than the device's 74.5 GiB; set trainer.cpu_offload=true" in line
    assert "trainer.snapshot=cpu" in line and "model.dtype=bfloat16" in line


def test_a_moes_experts_count_as_stored(qwen3_30b, tmp_path):
    """Every expert counts (not the top-8 a token runs): the largest layer, gathered whole (FSDP2's unit), holds its
    128 experts; and a tiny Qwen3-MoE counts exactly the tensors of its save_pretrained file."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    import tasks

    _, largest = memory.param_counts(qwen3_30b)
    experts = 128 * 3 * 2048 * 768  # gate, up and down of each expert
    assert experts < largest < experts + 25e6  # + attention, norms and the router
    path = tasks.make_tiny_model(str(tmp_path / "moe"), num_experts=8, experts_per_token=2)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        stored = sum(f.get_slice(k).get_shape()[0] * torch.Size(f.get_slice(k).get_shape()[1:]).numel()
                     for k in f.keys())
    n, _ = memory.param_counts(AutoModelForCausalLM.from_pretrained(path))
    assert n == stored
