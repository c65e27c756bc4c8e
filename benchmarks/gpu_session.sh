#!/usr/bin/env bash
# One device call for the last figures of a session (issues 9-11), each stage
# under its own time limit: tests/gpu; long-context batch-1 decode with bf16
# against fp8 KV (Llama-3.1-8B shape); the 256-prompt workload (paged-fused)
# against transformers' continuous batching on the first HF_NUM_PROMPTS.
# Usage (repository root, GPU machine): OUT=... bash benchmarks/gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
timeout "${KV_TIMEOUT:-170}" python3 -m pagedlm.cli bench decode --random-weights --model benchmarks/configs/llama-3.1-8b \
  --device cuda --prompt-len 8192 32768 --gen-len 64 --repeats 2 --paged-kv --kv-quant fp8 \
  --kv-budget-bytes 17G --json 2>&1 | grep '^{' | tee "$OUT/kv_quant_decode.jsonl"
STORES=paged BACKEND=triton HF_NUM_PROMPTS=${HF_NUM_PROMPTS:-64} HF_TIMEOUT=${HF_TIMEOUT:-120} LIMIT=${LIMIT:-200} \
  OUT="$OUT" bash benchmarks/gpu_batched.sh 2>&1 | grep '^{' | tail -3
python3 - "$OUT/kv_quant_decode.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['prompt_len']:6d} {r['name']:22s} {r['decode_ms_per_token']:8.3f} ms/tok  vs default x{r.get('decode_ratio_vs_default')}")
PY
