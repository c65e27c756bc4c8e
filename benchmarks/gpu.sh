#!/usr/bin/env bash
# The GPU session's checks and batch-1 figures in one call (device machine:
# torch, triton, transformers; no gguf/fastapi). Usage there, from the
# repository root: bash benchmarks/gpu.sh   (JSON rows under $OUT)
#   1. tests/gpu: the kernels at full size, the parity gates;
#   2. batch-1 decode on three real shapes, random weights, one process per
#      shape: the default store, paged-gather, paged-fused (kernels + CUDA
#      graphs) and transformers' static-cache compiled generate on the same
#      weights, with the HBM roofline measured in the same run.
# GEN (default 128) new tokens after a PROMPT (default 512)-token prompt.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
fi
for cfg in ${CONFIGS:-gemma3-270m qwen3-0.6b llama-3.1-8b}; do
  timeout "${SHAPE_TIMEOUT:-200}" python3 -m pagedlm.cli bench decode --random-weights --model "benchmarks/configs/$cfg" \
    --device cuda --prompt-len "${PROMPT:-512}" --gen-len "${GEN:-128}" --repeats 3 \
    --paged-kv --paged-kv-block-size "${BLOCK:-16}" --kv-budget-bytes 24G --against hf --json 2>&1 \
    | grep -v Warning | tee -a "$OUT/bench.jsonl"
done
python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    print(f"{r['model'].split('/')[-1]:14s} {r['name']:20s} {r['decode_ms_per_token']:8.3f} ms/tok "
          f"roofline {r.get('roofline_fraction')}  hf {r.get('hf_decode_ms_per_token')} ms/tok "
          f"(roofline {r.get('hf_roofline_fraction')})  x{r.get('decode_ratio_vs_hf')} vs hf")
PY
