#!/usr/bin/env bash
# setup.sh: create (once) the project's virtual environment in .venv and install what the project needs.
# Idempotent: a second run only checks that the requirements are met. The CPU build of torch is pinned first
# (torch==2.13.0) so that pip never pulls a multi-GB CUDA build on a CPU machine; on a GPU machine set
# TORCH_SPEC (e.g. TORCH_SPEC="torch" with the right index URL) before running this.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup.sh: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat requirements.txt requirements-dev.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "setup.sh: installing requirements into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  "$VENV/bin/python" -m pip install -q -r requirements.txt -r requirements-dev.txt
  touch "$stamp"
fi
