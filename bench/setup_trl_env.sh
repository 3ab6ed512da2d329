#!/usr/bin/env bash
# Creates .venv-trl, the benchmark-only environment holding TRL for bench/trl_side.py.
# TRL is not a dependency of hybridflow: it lives only here. The CPU torch wheel goes in
# first, and the torch and transformers pins of constraints.txt (only those: TRL brings its own
# dependencies) keep both sides of bench/vs_trl.py on the same torch and transformers.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TRL_VERSION=${TRL_VERSION:-1.16.0}
[ -x .venv-trl/bin/python ] || "$PY" -m venv .venv-trl
.venv-trl/bin/python -m pip install -q --upgrade pip
.venv-trl/bin/pip install -q torch==2.13.0
pins=$(mktemp)
grep -E '^(torch|transformers|peft)==' constraints.txt > "$pins"
# peft: the LoRA row of bench/vs_trl.py (--lora-rank), at hybridflow's pinned version.
.venv-trl/bin/pip install -q -c "$pins" "trl==${TRL_VERSION}" peft
rm -f "$pins"
.venv-trl/bin/python - <<'EOF'
import peft, torch, transformers, trl
assert torch.__version__.endswith("+cpu"), f"expected the CPU torch wheel, got torch {torch.__version__}"
print(f".venv-trl ready: trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
EOF
