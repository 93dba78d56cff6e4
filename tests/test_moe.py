"""Qwen3-MoE weights leave the trainer in checkpoint names (issue 26, first part). transformers 5 keeps a layer's
experts fused (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj); its checkpoint, and sglang 0.5.23's
loader (models/qwen3_moe.py Qwen3MoeForCausalLM.load_weights: FusedMoE.make_expert_params_mapping, and
`if name not in params_dict: continue` for any other name), know only experts.{i}.gate_proj/up_proj/down_proj.
standins/engine.py (scheduler.load_tensors) loads the same way, so fused names are dropped silently and only a
trainer-vs-engine log-prob gap shows it; weight_sync's converted buckets close the gap; configs/tiny_moe.yaml runs
through train.py with the gap < 1e-4 after every sync. Rollout routing replay (moe.py): the engine's routes in
sglang's layout, the trainer's experts equal to them, its log-probs equal to the engine's. CPU only, fp32.
Run: .venv/bin/python -m pytest -q tests/test_moe.py
"""
import asyncio
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import buffer
import config
from standins import engine
import logprobs
import moe as moe_lib  # (the fixture `moe` is the engine)
import rollout
import rollout_fns
import sglang_client
from standins import scheduler
from standins import tiny_model
import batching
import checks
import hf_export
import model as model_lib
import sync_disk
import sync_distributed
import sync_tensor
import weight_sync
from test_engine import first_chunk_stream, generate, last_chunk, loads, make_model, post, version
from services import free_port  # noqa: E402
from test_train import ROOT, TORCHRUN

TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe.yaml")

PROMPTS = [[5, 6, 7], list(range(20, 31))]


def make_moe(path: str, seed: int) -> str:
    """A tiny Qwen3-MoE (hidden 64, 8 experts, top-2, 2 layers, random init and random RMSNorm gains as
    test_engine.make_model) with tasks' character tokenizer, written by save_pretrained (per-expert names)."""
    tiny_model.make_tiny_model(path, seed=seed)  # the tokenizer and generation config; the dense weights are replaced
    dense = AutoConfig.from_pretrained(path)
    cfg = Qwen3MoeConfig(vocab_size=dense.vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                         max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=dense.bos_token_id,
                         eos_token_id=dense.eos_token_id, pad_token_id=dense.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(2 * torch.randn(p.shape))
    model.save_pretrained(path)
    return path


def no_fsdp(model):
    """weight_sync's gathering on a model without FSDP2 (its unit's unshard/reshard are then no-ops: the full
    parameters are already there); the FSDP2 gather itself is tested in test_train.py."""
    for m in [model, *model.model.layers]:
        m.unshard = m.reshard = lambda: None
    return model


def buckets(model) -> list:
    """weight_sync's converted buckets, 1 byte limit: one FSDP unit per bucket."""
    return [weight_sync.gather_bucket(model, spec, torch.float32, torch.device("cpu"))
            for spec in weight_sync.plan_buckets(no_fsdp(model), torch.float32, 1)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    paths = {k: make_moe(str(root / k), s) for k, s in (("A", 0), ("B", 1))}
    url, handle = engine.launch(paths["A"], dist_timeout=60, wait_timeout=120)
    yield url, paths, AutoModelForCausalLM.from_pretrained(paths["B"]).eval()
    alive = handle.proc.poll() is None
    handle.stop()
    assert alive, f"the engine died during the tests:\n{handle.log_tail()}"


def gap(url, ref) -> float:
    """max |engine - trainer| log-prob over greedy continuations of PROMPTS (test_engine's logprob check)."""
    worst = 0.0
    for p in PROMPTS:
        o = generate(url, p, max_new_tokens=12, temperature=0, ignore_eos=True)
        ids = torch.tensor([p + o["output_ids"]])
        with torch.no_grad():
            logits = ref(ids).logits.float()[:, len(p) - 1:-1]
        trainer, _ = logprobs.token_logprobs(logits, ids[:, len(p):], 1.0)
        got = torch.tensor([[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]])
        worst = max(worst, (got - trainer).abs().max().item())
    return worst


def push_gloo(url, named: list, flat: list = ()) -> list:
    """One /update_weights_from_distributed of (name, tensor) over a gloo group (test_engine's gloo test); with
    `flat`, one call per Bucket in load_format flattened_bucket, each one broadcast of its bytes. The answers."""
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": f"g{port}", "backend": "gloo"}
    with cf.ThreadPoolExecutor(1) as ex:
        joined = ex.submit(post, url, "/init_weights_update_group", init)
        pg = scheduler.init_weight_update_group("127.0.0.1", port, 0, 2, f"g{port}", "gloo", timeout_s=30)
        assert joined.result(timeout=30).json()["success"] is True
        body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "group_name": f"g{port}",
                "weight_version": str(version(url) + 1)}
        assert post(url, "/begin_weight_update", {}).json()["success"] is True
        answers = []
        for b in flat:
            named = b.named
            done = ex.submit(post, url, "/update_weights_from_distributed", {
                **body, "names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "load_format": "flattened_bucket"})
            scheduler.broadcast_tensors(pg, [b.flat.view(torch.uint8)], timeout_s=30)
            answers.append(done.result(timeout=30))
        if not flat:
            done = ex.submit(post, url, "/update_weights_from_distributed", body)
            scheduler.broadcast_tensors(pg, [t.contiguous() for _, t in named], timeout_s=30)
            answers.append(done.result(timeout=30))
        assert post(url, "/end_weight_update", {}).json()["success"] is True
    for r in answers:  # success either way, as 0.5.23 answers
        assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert post(url, "/destroy_weights_update_group", {"group_name": f"g{port}"}).json()["success"] is True
    return answers


def test_fused_names_are_skipped_and_checkpoint_names_load(moe):
    """Fused trainer names pushed as they are: every expert tensor is skipped (sglang 0.5.23 Qwen3MoeForCausalLM.
    load_weights' `continue`), the call still succeeds, and the engine's log-probs stay far from the trainer's;
    weight_sync's converted buckets over the same gloo path make them equal."""
    url, paths, ref = moe
    named = [(n, p.detach()) for n, p in ref.named_parameters()]
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in named)
    push_gloo(url, named)
    assert gap(url, ref) > 1e-2  # the attention and norms did load, the experts did not
    converted = [nt for b in buckets(ref) for nt in b.named]
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in dict(converted)
    assert not any(n.endswith("gate_up_proj") for n, _ in converted)
    push_gloo(url, converted)
    assert gap(url, ref) < 1e-5
    assert post(url, "/update_weights_from_disk", {"model_path": paths["A"]}).json()["success"] is True
    assert gap(url, ref) > 1e-2  # back to A: the disk path reloads the experts too


def test_flattened_bucket_is_one_broadcast_per_bucket_and_refuses_what_sglang_refuses(moe):
    """load_format "flattened_bucket" (sglang 0.5.23 model_runner_components/weight_updater.py
    _receive_bucketed_weights_from_distributed, weight_sync/tensor_bucket.py FlattenedTensorBucket.empty /
    reconstruct_tensors): the names, dtypes and shapes of one uint8 buffer of the tensors back to back, received by
    ONE broadcast and split into views; weight_sync's Bucket is that layout. Refused without joining the broadcast
    (400, success false, "Failed to receive weights: ..."): no tensor, an offset not aligned to its dtype."""
    url, paths, ref = moe
    kept = buckets(ref)
    # each unit's expert tensors are views of the unshard, never a copy of the fused gate_up (to_checkpoint)
    fused = dict(ref.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    up = hf_export.to_checkpoint(ref, dict(ref.model.layers[0].named_parameters(prefix="model.layers.0")))
    assert up["model.layers.0.mlp.experts.5.up_proj.weight"].data_ptr() == fused[5, fused.shape[1] // 2:].data_ptr()
    assert len(push_gloo(url, [], flat=kept)) == len(kept) == 3  # 2 layers + the root: 3 broadcasts in all
    assert gap(url, ref) < 1e-5
    port = free_port()
    with cf.ThreadPoolExecutor(1) as ex:
        joined = ex.submit(post, url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": f"g{port}", "backend": "gloo"})
        scheduler.init_weight_update_group("127.0.0.1", port, 0, 2, f"g{port}", "gloo", timeout_s=30)
        assert joined.result(timeout=30).json()["success"] is True
    assert post(url, "/begin_weight_update", {}).json()["success"] is True
    for names, dtypes, shapes, why in (
            ([], [], [], "Cannot create empty tensor bucket"),
            (["a", "b"], ["bfloat16", "float32"], [[3], [2]], "Unaligned received tensor b: byte offset 6, dtype "
                                                               "torch.float32")):
        r = post(url, "/update_weights_from_distributed", {"names": names, "dtypes": dtypes, "shapes": shapes,
                                                            "group_name": f"g{port}", "load_format": "flattened_bucket"})
        assert r.status_code == 400 and r.json() == {"success": False, "message": f"Failed to receive weights: {why}"}
    assert post(url, "/end_weight_update", {}).json()["success"] is True
    assert post(url, "/destroy_weights_update_group", {"group_name": f"g{port}"}).json()["success"] is True
    assert post(url, "/update_weights_from_disk", {"model_path": paths["A"]}).json()["success"] is True


def test_only_the_sending_rank_builds_buckets(moe, monkeypatch):
    """WeightSync.push: every rank joins each unit's all-gather, but with the distributed method (and the delta)
    only rank 0 sends, so the other ranks build no bucket (no flat buffer, no checkpoint conversion): join_gather
    alone."""
    _, _, ref = moe
    calls = []
    monkeypatch.setattr(weight_sync, "gather_bucket", lambda *a: calls.append("build"))
    monkeypatch.setattr(weight_sync, "join_gather", lambda spec: calls.append("join"))
    ws = object.__new__(weight_sync.WeightSync)
    ws.cfg = config.load_config(None, ["weight_sync.method=distributed"])
    ws.model, ws.device, ws.dtype, ws.rank, ws.world, ws.fleet = no_fsdp(ref), torch.device("cpu"), torch.float32, 1, \
        1, None
    ws.cfg.weight_sync.bucket_mb = 0  # (refused in a config) one unit a bucket: 2 layers and the root
    ws.delta, ws.transports = None, {"distributed": sync_distributed.DistributedTransport(ws)}
    ws.push(3)
    assert calls == ["join"] * 3 and ws.last_bytes == sum(p.numel() * 4 for p in ref.parameters())


def test_colocate_tensor_path_pushes_checkpoint_names(moe):
    """Colocate's /update_weights_from_tensor (test_engine's shared-tensor test): each converted bucket's views of
    its flat buffer as one payload; fused names the same way are skipped."""
    url, paths, ref = moe
    def push(named):
        body = {"serialized_named_tensors": [sync_tensor.serialize_named_tensors(named)]}
        r = post(url, "/update_weights_from_tensor", body)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert post(url, "/begin_weight_update", {}).json()["success"] is True
    push([(n, p.detach()) for n, p in ref.named_parameters()])
    assert post(url, "/end_weight_update", {}).json()["success"] is True
    assert gap(url, ref) > 1e-2
    kept = buckets(ref)  # the payloads name shared-memory files: the buffers live until the calls returned
    assert post(url, "/begin_weight_update", {}).json()["success"] is True
    for b in kept:
        push(b.named)
    assert post(url, "/end_weight_update", {}).json()["success"] is True
    assert gap(url, ref) < 1e-5
    assert post(url, "/update_weights_from_disk", {"model_path": paths["A"]}).json()["success"] is True


def test_disk_method_writes_save_pretrained_keys_that_the_engine_and_from_pretrained_load(moe, tmp_path):
    """sync_disk.DiskTransport.push (hf_export.export_hf, as run_dir/hf is written): save_pretrained's keys and
    shapes in run_dir/sync_weights, loadable by from_pretrained with the same logits, and by standins/engine.py's
    /update_weights_from_disk, which the push asks every server for."""
    url, paths, ref = moe
    asked = []

    def update_weights_from_disk(path, version, flush):
        asked.append((path, version, flush))
        assert post(url, "/update_weights_from_disk", {"model_path": path}).json()["success"] is True
    ws = types.SimpleNamespace(model=no_fsdp(ref), dtype=torch.float32, rank=0,
                               fleet=types.SimpleNamespace(update_weights_from_disk=update_weights_from_disk),
                               cfg=types.SimpleNamespace(run_dir=str(tmp_path), flush_on_update=True,
                                                         model=types.SimpleNamespace(path=paths["B"])))
    nbytes = sync_disk.DiskTransport(ws).push(3)
    hf = tmp_path / "sync_weights"
    assert asked == [(str(hf), 3, True)] and nbytes == os.path.getsize(hf / "model.safetensors") - 8 - int.from_bytes(
        open(hf / "model.safetensors", "rb").read(8), "little")  # the tensors' bytes: the file less its header
    def keys(d):
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert keys(hf) == keys(paths["B"])
    again = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref(ids).logits)
    assert gap(url, ref) < 1e-5


def test_a_dense_models_names_do_not_change(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(make_model(str(tmp_path / "dense"), 0))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    got = [(n, tuple(t.shape)) for b in buckets(model) for n, t in b.named]
    assert got == [(n, shapes[n]) for _, names in hf_export.fsdp_units(model) for n in names]  # the units' order


def test_fsdp2_gathered_buckets_equal_the_save_pretrained_file(moe):
    """2 FSDP2 ranks (gloo, torchrun, as test_train.py): each decoder layer one unit, gathered and converted bucket
    by bucket, gives save_pretrained's keys and tensors exactly (run below, under __main__)."""
    _, paths, _ = moe
    p = subprocess.run([*TORCHRUN, os.path.abspath(__file__), paths["B"]], cwd=ROOT, capture_output=True, text=True,
                       timeout=240, start_new_session=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])})
    assert p.returncode == 0 and "RESULT same" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    # hf_export.export_hf under a bf16 unshard: the float32 bits, where weight_sync's gather rounds them; auto
    # takes the base's own dtype (make_moe's float32, from its config.json)
    assert "RESULT export exact" in p.stdout and "RESULT unshard rounded" in p.stdout, p.stdout[-2000:]
    assert "RESULT auto ['torch.float32']" in p.stdout, p.stdout[-2000:]


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory) -> str:
    """configs/tiny_moe.yaml's base, briefly copy-pretrained (30 steps: its groups' rewards differ, so every step
    moves the policy)."""
    return tiny_model.make_tiny_model(str(tmp_path_factory.mktemp("moe_base") / "base"), 64, 2, 0, "copy_digits", 30,
                                 num_experts=8, experts_per_token=2)


@pytest.mark.parametrize("mode", ["distributed", "colocate-tensor"])
def test_tiny_moe_config_runs_with_engine_and_trainer_log_probs_equal(mode, moe_base, tmp_path):
    """configs/tiny_moe.yaml through train.py (2 FSDP2 ranks, standins/engine.py), synchronous so that each step's
    trajectories come from the weights the previous step pushed: the trainer's step-start log-probs equal the
    engine's after every sync, over the broadcast group (distributed, with routing replay) and over shared tensors
    (colocate). With the fused names pushed (hf_export.to_checkpoint made the identity), the engine keeps the
    base's experts: the gap after the syncs of steps 1 and 2 was 0.11, 0.43 (distributed, without replay) and 1.01,
    2.08 (colocate). run_dir/hf has save_pretrained's keys.

    colocate-tensor is also the colocate end-to-end check, on CPU through the GPU's code path: the servers launched
    and released before the model loads, trainer offload / onload around generation, the staged resume (weights,
    then KV cache), every phase timed and its memory logged. The servers run with --enable-weights-cpu-backup
    (services.py): standins/engine.py, like SGLang, gives a released weights region back undefined without it, buffers
    included, and no push restores those (a dense run measured without the pushes after the first: gaps of 3.0,
    4.5, 6.8 at steps 2-4)."""
    run_dir = tmp_path / "run"
    extra = (["colocate=true", "weight_sync.method=tensor"] if mode == "colocate-tensor" else
             ["weight_sync.method=distributed", f"weight_sync.master_port={free_port()}",
              "algorithm.routing_replay=true"])  # and the trainer replays the engine's routes
    p = subprocess.run([*TORCHRUN, "train.py", "--config", TINY_MOE, f"run_dir={run_dir}", f"model.path={moe_base}",
                        *extra, "fully_async.enable=false", "rollout.partial=false",
                        "rollout.mask_offpolicy_in_partial_rollout=false", "weight_sync.bucket_mb=1",
                        f"rollout.base_port={free_port()}", "data_source.num_prompts=64",
                        "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=8",
                        "trainer.mini_batch_size=32", "trainer.total_steps=3", "trainer.eval_freq=0",
                        "trainer.save_freq=0", "trainer.lr=0.01", "rollout.filter=[failed]",
                        "buffer.get_timeout_s=120", "rollout.startup_timeout_s=120"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/rollout_logprob_diff_max"] < 1e-4, (r["step"], r["train/rollout_logprob_diff_max"])
        assert r["train/approx_kl"] < 1e-6, r  # float32 on both sides, same weights
        assert r["rollout/weight_version"] == r["step"] - 1 and r["perf/weight_sync_gbps"] > 0, r
        if mode == "colocate-tensor":
            for key in ("timing/release_rollout", "timing/onload_train", "timing/resume_rollout",
                        "timing/resume_kv_cache"):
                assert key in r, (key, r)
            # per-phase memory (CPU: resident set; on GPU the reserved bytes, which these phases free)
            assert all(r[k] > 0 for k in ("perf/memory_train_end", "perf/memory_before_push",
                                          "perf/memory_after_offload")), r
    assert max(r["train/grad_norm"] for r in rows[:-1]) > 0.1  # the policy did move between the syncs
    def keys(d):
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert keys(run_dir / "hf") == keys(moe_base)  # the base was written by save_pretrained
    trained = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"))
    base = AutoModelForCausalLM.from_pretrained(moe_base)
    assert isinstance(trained, Qwen3MoeForCausalLM)
    name = "model.layers.1.mlp.experts.down_proj"
    assert not torch.equal(trained.get_parameter(name), base.get_parameter(name))  # trained experts were written


# ---------------------------------------------------------------------------------------------------------------
# Rollout routing replay (algorithm.routing_replay)

@pytest.fixture(scope="module")
def routed(moe):
    """An engine with --enable-return-routed-experts on model A, and trainer copies of A: exact, and rounded to
    bfloat16 and back (every weight off by up to 2^-9 relative, as a bf16 trainer's or server's are)."""
    _, paths, _ = moe
    url, handle = engine.launch(paths["A"], dist_timeout=60, wait_timeout=120, enable_return_routed_experts=True)
    exact = AutoModelForCausalLM.from_pretrained(paths["A"], experts_implementation="eager").eval()
    rounded = AutoModelForCausalLM.from_pretrained(paths["A"], experts_implementation="eager").eval()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    yield url, exact, rounded
    alive = handle.proc.poll() is None
    handle.stop()
    assert alive, f"the routed engine died during the tests:\n{handle.log_tail()}"


def sampled_sequences(url, k: int = 16) -> list:
    """Trajectories of PROMPTS (sampled, temperature 1) with the engine's routes, as rollout.py stores them."""
    out = []
    for p in PROMPTS:
        body = {"input_ids": [p] * k, "return_logprob": True, "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}}
        for item in post(url, "/generate", body).json():
            t = buffer.Trajectory(0, 0, 0, torch.tensor(p))
            gen = sglang_client.parse_generate_response(item)
            rollout_fns.extend(t, gen.ids, gen.log_probs, gen.versions, 1)
            fleet_side = object.__new__(rollout.Rollout)
            fleet_side.routes_shape, fleet_side.routes_dtype = (2, 2), torch.uint8
            fleet_side._extend_routes(t, item, 0)
            out.append(t)
    return out


def expert_choices(model, b: dict) -> tuple:
    """(model_lib.token_logprobs of micro-batch b, the top-k ids every MoE block's experts were run with, per layer
    [tokens, k]): read at the experts' input, after any replay."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.experts.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[1].clone())))
    try:
        with torch.no_grad():
            lp, _ = model_lib.token_logprobs(model, b, 1.0, 1024)
    finally:
        for h in hooks:
            h.remove()
    return lp, seen


def batch(trajs: list, packing: bool, replay: bool) -> dict:
    seqs = batching.make_sequences([buffer.Group(None, trajs)], config.Config())
    if not replay:
        seqs = [{k: v for k, v in s.items() if k != "routes"} for s in seqs]  # (then no `routed` either)
    return batching.collate(seqs, packing=packing)


def test_engine_returns_routed_experts_in_sglang_layout(routed):
    """meta_info.routed_experts: int32 [prompt + output - 1 - routed_experts_start_len, layers, top-k] in base64
    (0.5.23: batch_result_processor._maybe_collect_routed_experts, detokenizer_manager._b64_encode_per_request), the
    experts the model's own routers pick at those positions (same weights, fp32)."""
    url, exact, _ = routed
    body = {"input_ids": [PROMPTS[1], PROMPTS[0]], "return_routed_experts": True, "routed_experts_start_len": 2,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    items = post(url, "/generate", body).json()
    for p, item in zip([PROMPTS[1], PROMPTS[0]], items):
        rows = moe_lib.decode(item["meta_info"]["routed_experts"], 2, 2)
        assert rows.dtype == torch.int32 and rows.shape == (len(p) + 5 - 1 - 2, 2, 2)
        ids = torch.tensor([p + item["output_ids"]])
        rec = moe_lib.Recorder(exact)
        with torch.no_grad():
            exact(ids)
        assert torch.equal(rec.take()[2:-1], rows)
        for h in rec.handles:
            h.remove()
    plain = post(url, "/generate", {**body, "return_routed_experts": False}).json()
    assert all("routed_experts" not in it["meta_info"] for it in plain)


@pytest.mark.parametrize("packing", [False, True])
def test_replay_uses_the_engines_experts_for_every_token(routed, packing):
    """With bf16-rounded trainer weights the trainer's own routers pick other experts than the engine's for some
    tokens; with the engine's routes replayed its experts are the engine's at every position the engine ran
    (prompt and response), padded and packed."""
    url, _, rounded = routed
    trajs = sampled_sequences(url)
    for replay in (False, True):
        b = batch(trajs, packing, replay)
        ref = batch(trajs, packing, True)  # routes [rows, L, layers, k], routed where the engine ran them
        _, seen = expert_choices(rounded, b)
        known, ref = ref["routed"].reshape(-1), ref["routes"]
        assert ref.dtype == torch.uint8 and known.dtype == torch.bool  # the trajectories' dtype, to the forward
        differ = sum(int((seen[i].sort(-1).values != ref[:, :, i].reshape(-1, 2).long().sort(-1).values)
                         .any(-1)[known].sum()) for i in seen)
        if replay:
            assert differ == 0
        else:
            assert differ > 0, "bf16 rounding changed no router decision: the test would not see a replay bug"


def test_an_abort_carries_routes_only_for_a_running_request(routed):
    """sglang 0.5.23: a running request's abort is finished by its next forward and collects its routes like any
    finish (managers/scheduler.py abort_request "Abort method 3", batch_result_processor
    ._maybe_collect_routed_experts); a queued one, a retracted one too, is popped and answered by
    tokenizer_manager._handle_abort_req with output_ids and no routed_experts (Req.reset_for_retract dropped them)."""
    url = routed[0]
    body = {"input_ids": PROMPTS[1], "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 3000, "temperature": 1.0, "ignore_eos": True}}
    for retract in (True, False):
        first, lines = first_chunk_stream(url, {**body, "rid": f"ab-{retract}"})  # running: it has decoded
        assert first["meta_info"]["finish_reason"] is None
        if retract:
            assert post(url, "/pause_generation", {"mode": "retract"}).status_code == 200
            assert (loads(url)["num_running_reqs"], loads(url)["num_waiting_reqs"]) == (0, 1)
        assert post(url, "/abort_request", {"rid": f"ab-{retract}"}).status_code == 200
        last = last_chunk(lines)
        assert post(url, "/continue_generation", {}).status_code == 200
        meta, ids = last["meta_info"], last["output_ids"]
        assert meta["finish_reason"]["type"] == "abort" and 0 < len(ids) < 3000
        if retract:  # _handle_abort_req's keys: no routed_experts (and no num_retractions either)
            assert "routed_experts" not in meta and "num_retractions" not in meta
        else:
            rows = moe_lib.decode(meta["routed_experts"], 2, 2)
            assert rows.shape[0] == len(PROMPTS[1]) + len(ids) - 1


def test_replayed_log_probs_equal_the_engines_with_matching_weights(routed):
    """The same weights as the engine (fp32): the replayed forward's log-probs are the engine's within 1e-5 on every
    response token, and the router still gets a gradient (its weights come from the trainer's own logits)."""
    url, exact, _ = routed
    trajs = sampled_sequences(url)
    b = batch(trajs, False, True)
    lp, _ = expert_choices(exact, b)
    assert ((lp - b["rollout_lp"]).abs() * b["mask"]).max() < 1e-5
    exact.zero_grad()
    logp, _ = model_lib.token_logprobs(exact, b, 1.0, 1024)
    (logp * b["mask"]).sum().backward()
    assert exact.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    moe_lib.set_routes(exact, None)


def test_a_restored_trajectory_keeps_its_routes():
    """A partial rollout continued from its restored tokens asks for routes from the fewest any item has
    (routed_experts_start_len) and appends only the positions it had none for."""
    t = buffer.Trajectory(0, 0, 0, torch.tensor([1, 2, 3]), response_ids=torch.tensor([4, 5]))
    t.routed_experts = torch.full((4, 2, 2), 7, dtype=torch.uint8)  # positions 0-3 (5 was never run)
    fresh = buffer.Trajectory(0, 0, 1, torch.tensor([1, 2, 3]))
    assert rollout._routes_start([t, fresh]) == 0
    r = object.__new__(rollout.Rollout)
    r.routes_shape, r.routes_dtype = (2, 2), torch.uint8
    t.response_ids = torch.tensor([4, 5, 6, 8])  # the continuation generated 6 and 8: positions 0-5 were run
    new = torch.arange(6 * 4, dtype=torch.int32).view(6, 2, 2)  # from start 0: its own routes for 0-3 too
    r._extend_routes(t, {"meta_info": {"routed_experts": moe_lib.encode(new)}}, 0)
    assert torch.equal(t.routed_experts[:4], torch.full((4, 2, 2), 7, dtype=torch.uint8))
    assert torch.equal(t.routed_experts[4:], new[4:].to(torch.uint8))
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        r._extend_routes(t, {"meta_info": {}}, 0)


def test_a_retracted_then_aborted_item_without_routes_keeps_its_group_and_gets_its_routes_later():
    """sglang 0.5.23 answers the abort of a queued request, a retracted one too, without routed_experts
    (tokenizer_manager._handle_abort_req; routes are collected only when a running request finishes,
    batch_result_processor._maybe_collect_routed_experts). Such an item keeps its tokens and the routes it had; its
    retry asks from routed_experts_start_len = the fewest positions any item has, and once it finishes its routes
    cover every position. A finished item without routes is still an error."""
    P, L, K = [1, 2, 3], 2, 2
    sent = []

    def item(ids, finish, start=None, total=None):
        meta = {"id": "r", "weight_version": "0", "finish_reason": finish,
                "output_token_logprobs": [[-1.0, t, None] for t in ids]}
        if start is not None:  # the server's routes: rows for positions [start, total - 1), row j = position j
            meta["routed_experts"] = moe_lib.encode(torch.arange(start, total - 1).view(-1, 1, 1).expand(-1, L, K))
        return {"text": "", "output_ids": ids, "meta_info": meta}

    script = [  # (request 1: both items; request 2: the aborted one alone, from position 0)
        lambda start: [item([4, 5], {"type": "abort", "message": "Abort in waiting queue"}),  # retracted, aborted
                       item([6, 7, 8], {"type": "stop", "matched": 8}, start, len(P) + 3)],
        lambda start: [item([9, 10], {"type": "stop", "matched": 10}, start, len(P) + 4)],
        lambda start: [item([11], {"type": "stop", "matched": 11})],  # finished, no routes: an error
    ]

    class Fleet:
        async def generate(self, payload, rid, stop):
            rid()
            sent.append(payload["routed_experts_start_len"])
            return script[len(sent) - 1](payload["routed_experts_start_len"])

    r = object.__new__(rollout.Rollout)
    r.cfg = config.load_config(None, ["rollout.max_retries=1"])
    r.routes_shape, r.routes_dtype, r.fleet, r.run_tag = (L, K), torch.uint8, Fleet(), "t"
    r.max_new_tokens, r.context_len, r.max_input_len, r.version = 16, None, None, None
    r.sampling_params, r.stats = {}, rollout._new_stats()
    trajs = [buffer.Trajectory(0, 0, i, torch.tensor(P)) for i in range(2)]

    async def run(ts):
        return await r._generate(rollout._Active("t-0-0-", ts, asyncio.Event()), ts)

    assert asyncio.run(run(trajs)) == ["stop", "stop"]
    assert sent == [0, 0] and r.stats["aborts_without_routes"] == 1
    for t in trajs:
        assert t.status == buffer.COMPLETED
        assert torch.equal(t.routed_experts[:, 0, 0], torch.arange(t.num_tokens - 1).to(torch.uint8))
    assert trajs[0].response_ids.tolist() == [4, 5, 9, 10]
    with pytest.raises(ValueError, match="returned no meta_info.routed_experts"):
        asyncio.run(run([buffer.Trajectory(0, 1, 0, torch.tensor(P))]))


def test_routing_replay_on_a_dense_model_is_refused(tmp_path):
    dense = make_model(str(tmp_path / "dense"), 0)
    cfg = config.load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [f"model.path={dense}",
                                                                          "algorithm.routing_replay=true"])
    with pytest.raises(ValueError, match="algorithm.routing_replay=true replays a MoE's expert choices"):
        checks.check_launch(cfg, 2)
    cfg.model.path = str(tmp_path / "not-made")  # the tiny model, made at start-up: its config says
    with pytest.raises(ValueError, match="is a dense model"):
        checks.check_launch(cfg, 2)
    cfg.model.tiny_num_experts = 8
    checks.check_launch(cfg, 2)
    cfg.model.path = make_moe(str(tmp_path / "moe"), 0)  # a MoE's config.json (num_local_experts, transformers 5)
    checks.check_launch(cfg, 2)


def _fsdp_gather(path: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(path)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    got = {n: t.clone() for spec in weight_sync.plan_buckets(model, torch.float32, 1)
           for n, t in weight_sync.gather_bucket(model, spec, torch.float32, torch.device("cpu")).named}
    ref = load_file(os.path.join(path, "model.safetensors"))
    if dist.get_rank() == 0 and got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref):
        print("RESULT same")
    # The final export (hf_export.export_hf) under cuda's mixed precision, bf16 unshard: the float32 master bits
    # (issue 36: it was gathered by the unshard, so rounded to bf16, which weight_sync's bucket still is).
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mixed = AutoModelForCausalLM.from_pretrained(path)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in mixed.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(mixed, mp_policy=mp)
    out = os.path.join(os.path.dirname(path), "export")
    hf_export.export_hf(mixed, path, out, torch.float32)
    rounded = {n: t.clone() for spec in weight_sync.plan_buckets(mixed, torch.float32, 1)
               for n, t in weight_sync.gather_bucket(mixed, spec, torch.float32, torch.device("cpu")).named}
    if dist.get_rank() == 0:
        exported = load_file(os.path.join(out, "model.safetensors"))
        if exported.keys() == ref.keys() and all(torch.equal(exported[k], ref[k]) for k in ref):
            print("RESULT export exact")
        if any(not torch.equal(rounded[k], ref[k]) for k in ref):
            print("RESULT unshard rounded")
        hf_export.export_hf(mixed, path, out + "_auto", hf_export.export_dtype("auto", path))
        auto = load_file(os.path.join(out + "_auto", "model.safetensors"))
        print(f"RESULT auto {sorted({str(t.dtype) for t in auto.values()})}")
    else:
        hf_export.export_hf(mixed, path, out + "_auto", hf_export.export_dtype("auto", path))
    # both ranks leave together: a rank that tore gloo down while rank 0 still read its files aborted the other
    # ("terminate called without an active exception", rank 1 SIGABRT) once in a full-suite run
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _fsdp_gather(sys.argv[1])
