#!/usr/bin/env bash
# bench/gpu_smoke.sh: the GPU paths that CPU CI cannot run (issues 27, 36), inside one 10-minute call (560 s for
# the stages) on the one H200 this project can borrow, with no network. The stages are bench/gpu_smoke.py's (its
# docstring says what each shows): preflight, packing, single_rank, moe, colocate; each in its own subprocess with
# its own timeout, a failing one does not stop the others, results in $OUT/smoke.json (per-stage logs in
# $OUT/logs/), one line per stage with its figures. Every stage must pass: a skipped one fails the smoke.
#
# The machine: python3 with torch 2.11 + cu130 and transformers 5.17 preinstalled, no sglang, no flash_attn (the
# project's .venv is CPU-only: not used there). Of the project's runtime requirements that image already holds
# aiohttp, numpy, pyyaml, requests, safetensors, tokenizers and pyarrow (see the preflight's "modules"); the one it
# lacks travels as a wheel in .whl/ (git-ignored), installed with --no-index into /tmp/gpu_smoke_site:
#   orjson 3.13.0 (cp312, manylinux_2_17_x86_64; standins/engine.py and rollout.py, so the colocate stage).
# Not needed by any stage: wandb (off), math-verify (math rewards only), matplotlib (plots), sglang, sglang-router.
#
#   bash bench/gpu_smoke.sh --fetch-wheels     # here, with the registry: download the wheels into .whl/ (~130 KB)
#   bash bench/gpu_smoke.sh                    # on the GPU machine (OUT=dir for the results, default runs/gpu_smoke)
#   SMOKE_DEVICE=cpu bash bench/gpu_smoke.sh   # the dry run (also --dry-run): every stage's code, tiny sizes, on CPU
#   ... --only packing,moe                     # some stages (the preflight always runs)
# Exit status 0 when every stage ran and passed.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(orjson==3.13.0)
if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
  ls -l .whl
  exit 0
fi
if [ "${1:-}" = "--dry-run" ]; then
  export SMOKE_DEVICE=cpu
  shift
fi
export SMOKE_DEVICE=${SMOKE_DEVICE:-cuda}
if [ "$SMOKE_DEVICE" = cpu ] && [ -x .venv/bin/python ]; then
  PY=${PY:-.venv/bin/python}  # the project's CPU environment (it has every requirement)
fi
PY=${PY:-python3}
export OUT=${OUT:-runs/gpu_smoke}
mkdir -p "$OUT"
if [ "$SMOKE_DEVICE" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "[gpu_smoke] installing $(ls .whl | tr '\n' ' ')into /tmp/gpu_smoke_site (--no-index)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_smoke_site \
    .whl/*.whl || echo "[gpu_smoke] warning: the wheels did not install; the preflight says which stages can run"
  export PYTHONPATH=/tmp/gpu_smoke_site${PYTHONPATH:+:$PYTHONPATH}
elif [ "$SMOKE_DEVICE" = cuda ]; then
  echo "[gpu_smoke] no .whl/*.whl: nothing installed (bash bench/gpu_smoke.sh --fetch-wheels makes them)"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "[gpu_smoke] $PY on $SMOKE_DEVICE, results in $OUT/smoke.json"
exec "$PY" bench/gpu_smoke.py --out "$OUT" --device "$SMOKE_DEVICE" "$@"
