#!/usr/bin/env bash
# The GPU session's checks and batch-1 figures in one call (device machine:
# torch, transformers, no gguf/fastapi). Usage there: bash benchmarks/gpu.sh
# (writes under $OUT). The batched workload is benchmarks/gpu_batched.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
for cfg in gemma3-270m qwen3-0.6b llama-3.1-8b; do
  python3 -m pagedlm.cli bench decode --random-weights --model "benchmarks/configs/$cfg" \
    --device cuda --prompt-len 512 4096 --gen-len 64 --repeats 3 \
    --paged-kv --paged-kv-block-size "${BLOCK:-256}" --kv-budget-bytes 24G --json 2>&1 | tee -a "$OUT/bench.jsonl"
done
