#!/usr/bin/env bash
# bench/gpu_smoke.sh: the GPU paths that CPU CI cannot run, in under 8 minutes on one GPU, without a network.
#   1. engine.py on cuda generates what transformers generates (tests/test_engine.py's gpu test);
#   2. packed rows on cuda: sdpa (and flash_attention_2 when flash_attn is installed) keep packed sequences apart
#      given position_ids alone, as tests/test_packing.py checks on CPU;
#   3. train.py device=cuda (nccl, one rank), colocate with weight_sync.method=tensor (CUDA IPC handles through
#      /update_weights_from_tensor), packing on, trainer offload/onload and the staged resume, 4 steps of the tiny
#      task; then per step the engine's vs the trainer's log-probs after each sync (bf16 compute on both sides, so
#      a few 1e-2 at most, against >= 1 when a push is lost), weight-sync GB/s, memory peaks, and the HF export.
# Needs the project's environment with a CUDA torch (README "GPU set-up"); writes to $OUT_DIR (default: a temp dir).
# Run: bash bench/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "[gpu_smoke] output in $OUT_DIR"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print('[gpu_smoke]', torch.__version__, torch.cuda.get_device_name(0))"

echo "[gpu_smoke] 1/3 engine.py on cuda vs transformers"
timeout 180 $PY -m pytest -q tests/test_engine.py -k test_engine_on_gpu_matches_transformers

echo "[gpu_smoke] 2/3 packed rows on cuda"
timeout 120 $PY - "$OUT_DIR" <<'EOF'
import importlib.util, os, sys
import torch
sys.path.insert(0, os.getcwd())
import tasks
from transformers import AutoModelForCausalLM
path = tasks.make_tiny_model(os.path.join(sys.argv[1], "packing_model"))
impls = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
for impl in impls:
    m = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.bfloat16).cuda().eval()
    a, b = torch.randint(3, 90, (1, 9), device="cuda"), torch.randint(3, 90, (1, 6), device="cuda")
    with torch.no_grad():
        alone = [m(input_ids=x, use_cache=False).logits[0].float() for x in (a, b)]
        pos = torch.cat([torch.arange(9), torch.arange(6)]).cuda()[None]
        packed = m(input_ids=torch.cat([a, b], 1), position_ids=pos, use_cache=False).logits[0].float()
    gap = max(float((packed[:9] - alone[0]).abs().max()), float((packed[9:] - alone[1]).abs().max()))
    print(f"[gpu_smoke] {impl}: packed vs alone max |logit diff| {gap:.4f} (bf16)")
    assert gap < 0.1, f"{impl} does not keep packed sequences apart"
if len(impls) == 1:
    print("[gpu_smoke] flash_attn is not installed: flash_attention_2 not checked")
EOF

echo "[gpu_smoke] 3/3 train.py device=cuda, colocate, weight_sync.method=tensor, packing"
timeout 360 $PY -m torch.distributed.run --standalone --nproc_per_node 1 train.py --config configs/tiny.yaml \
    device=cuda colocate=true fully_async.enable=false rollout.partial=false \
    rollout.mask_offpolicy_in_partial_rollout=false weight_sync.method=tensor trainer.packing=true \
    trainer.num_gpus_per_node=1 "model.path=$OUT_DIR/base" model.tiny_pretrain_steps=30 "run_dir=$OUT_DIR/run" \
    data_source.num_prompts=256 data_source.num_prompts_per_step=4 data_source.num_trajectories_per_prompt=8 \
    trainer.mini_batch_size=32 trainer.total_steps=4 trainer.eval_freq=0 trainer.save_freq=2 trainer.lr=0.01 \
    "rollout.filter=[failed]" rollout.base_port=23510 buffer.get_timeout_s=120 rollout.startup_timeout_s=120
$PY - "$OUT_DIR" <<'EOF'
import json, math, os, sys
rows = [json.loads(l) for l in open(os.path.join(sys.argv[1], "run", "metrics.jsonl")) if l.strip()]
assert [r["step"] for r in rows] == [1, 2, 3, 4], [r["step"] for r in rows]
for r in rows:
    print(f"[gpu_smoke] step {r['step']}: engine vs trainer log-prob |diff| max {r['train/rollout_logprob_diff_max']:.4f}"
          f" mean {r['train/rollout_logprob_diff_mean']:.5f}, grad_norm {r['train/grad_norm']:.3f}, weight sync "
          f"{r['perf/weight_sync_gbps']:.3f} GB/s, release {r['timing/release_rollout']:.2f} s, onload "
          f"{r['timing/onload_train']:.2f} s, resume weights {r['timing/resume_rollout']:.2f} s + kv "
          f"{r['timing/resume_kv_cache']:.2f} s, memory peak {r['perf/train_memory_allocated_max']:.2f} GiB")
    assert r["train/rollout_logprob_diff_mean"] < 0.05 and r["train/rollout_logprob_diff_max"] < 1.0, r
    assert math.isfinite(r["train/grad_norm"]) and r["perf/weight_sync_gbps"] > 0, r
assert os.path.exists(os.path.join(sys.argv[1], "run", "hf", "config.json")), "no HF export"
print("[gpu_smoke] ok")
EOF
