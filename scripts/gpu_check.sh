#!/usr/bin/env bash
# The GPU checks to run first whenever a GPU is lent (the GPU path has never run end to end).
# Written 2026-11-29 and not yet run: no GPU has been lent since. `--fetch` was run here (1.2 MB of wheels, 32 MB of tiny models).
#
#   ./scripts/gpu_check.sh --fetch   here, on the CPU machine: downloads into .whl/ the Python 3.12 manylinux wheels
#                                    hybridflow needs beyond what the GPU image holds (torch, transformers, peft,
#                                    pandas, pyarrow, safetensors are there; Ray is not carried: the checks use the
#                                    in-process backend, trainer.backend=local), and builds the tiny test models into
#                                    .gpu_cache/ (a HYBRIDFLOW_CACHE: SmolLM2's GGUF package is too large to carry)
#   bash scripts/gpu_check.sh        on the GPU machine (device tool: carry [".whl", ".gpu_cache"]); writes
#                                    $OUT/gpu_check.log
#
# What it runs, each step's verdict on one line of the log:
#   1. the engine on cuda and the main job's loop in process: tests/test_gpu_job.py and the other `gpu` tests
#      (GRPO with sampler log-probs and a checkpoint, GAE with a critic, the hf rollout)
#   2. the native rollout on cuda with its weight sync from the engine: tests/test_rollout_native.py on cuda
#   3. the vLLM CUDA rollout with weight sync, where vllm imports there (its wheel is too large to carry)
#   4. three steps of the main job's GRPO on a tiny model: hybridflow train on cuda, local backend
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 gguf==0.19.0)

if [ "${1:-}" = "--fetch" ]; then
  grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
  grep -qx '/.gpu_cache/' .git/info/exclude || echo /.gpu_cache/ >> .git/info/exclude
  HYBRIDFLOW_CACHE=$PWD/.gpu_cache .venv/bin/python -c \
    'from hybridflow.models import tiny_model_dir; [print(tiny_model_dir(a)) for a in ("llama", "qwen2")]'
  rm -rf .gpu_cache/models/SmolLM2-135M-Instruct  # built only for its tokenizer; the tiny models hold a copy
  du -sh .whl .gpu_cache
  exit 0
fi

OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
step() {  # step NAME COMMAND...: run it, log its output and one verdict line
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$LOG"
  if timeout 240 "$@" >> "$LOG" 2>&1; then echo "PASS $name" | tee -a "$LOG"; else echo "FAIL $name (rc $?)" | tee -a "$LOG"; fi
}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HYBRIDFLOW_CACHE=$PWD/.gpu_cache
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'; } >> "$LOG" 2>&1
step gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_job.py tests/test_rollout_hf.py
step native-rollout-cuda python3 -m pytest -q -p no:cacheprovider -k "cuda or device" tests/test_rollout_native.py tests/test_device.py
if python3 -c 'import vllm' 2>/dev/null; then
  step vllm-cuda-sync python3 -m pytest -q -p no:cacheprovider -m vllm tests/test_rollout_vllm.py tests/test_parity_vllm.py
else
  echo "SKIP vllm-cuda-sync (vllm is not installed on this machine)" | tee -a "$LOG"
fi
TINY=$(python3 -c 'from hybridflow.models import tiny_model_dir; print(tiny_model_dir("llama"))')
step main-job-3-steps python3 -m hybridflow.cli.main train model.path="$TINY" trainer.device=cuda trainer.backend=local \
  trainer.n_workers_per_node=1 trainer.total_training_steps=3 trainer.test_freq=3 data.gen_val_size=16 \
  trainer.logger=[console,jsonl] trainer.log_dir="$OUT/run"
grep -E "^(PASS|FAIL|SKIP)" "$LOG"
