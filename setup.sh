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
# The Python tool's sandbox (sandbox.py) runs each call in bubblewrap (bwrap): installed here when it is missing and
# this is root with apt-get; otherwise one line says how. Nothing else needs it, so its absence fails nothing here.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: installing bubblewrap (apt-get install -y bubblewrap) for the Python tool's sandbox" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
      || echo "setup.sh: apt-get could not install bubblewrap; the sandboxed Python tool (task calc_py) will refuse" \
              "to run until it is installed" >&2
  else
    echo "setup.sh: bubblewrap (bwrap) is missing; the sandboxed Python tool (task calc_py) needs it:" \
         "apt-get install bubblewrap (as root)" >&2
  fi
fi
