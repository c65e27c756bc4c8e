#!/usr/bin/env bash
# The GPU session's work in one call (device machine: torch, no gguf/fastapi).
# Usage there: bash benchmarks/gpu.sh   (writes under $OUT)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
python3 -m pytest -q tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
for cfg in qwen3-0.6b llama-3.1-8b; do
  python3 -m pagedlm.cli bench decode --random-weights --model "benchmarks/configs/$cfg" \
    --device cuda --prompt-len 256 1024 4096 --gen-len 64 --repeats 5 \
    --paged-kv --paged-kv-block-size "${BLOCK:-256}" --json 2>&1 | tee -a "$OUT/bench.jsonl"
done
