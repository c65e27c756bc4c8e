#!/usr/bin/env bash
# One device call for the last figures of a session (issues 9-11), each stage
# under its own time limit, rows written under $OUT as they come:
#   1. tests/gpu (kernels, 8-bit kernels, parity gates);
#   2. batch-1 decode at 32k tokens of context, bf16 against fp8 KV
#      (Llama-3.1-8B shape): default, paged-gather, paged-fused, paged-fp8;
#   3. prefix caching on the H200 (bench prefix, Qwen3-0.6B shape);
#   4. the 256-prompt workload split into graph / eager steps and host parts
#      (gpu_profile.py --workload).
# Usage (repository root, GPU machine): OUT=... bash benchmarks/gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"
timeout "${KV_TIMEOUT:-110}" python3 -m pagedlm.cli bench decode --random-weights --model benchmarks/configs/llama-3.1-8b \
  --device cuda --prompt-len ${KV_PROMPT:-32768} --gen-len 64 --repeats 2 --paged-kv --kv-quant fp8 \
  --kv-budget-bytes 17G --json 2>/dev/null | grep '^{' > "$OUT/kv_quant_decode.jsonl"
python3 - "$OUT/kv_quant_decode.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['prompt_len']:6d} {r['name']:22s} {r['decode_ms_per_token']:8.3f} ms/tok  vs default x{r.get('decode_ratio_vs_default')}")
PY
timeout "${PREFIX_TIMEOUT:-70}" python3 -m pagedlm.cli bench prefix --random-weights --model benchmarks/configs/qwen3-0.6b \
  --device cuda --paged-kv --json 2>/dev/null | grep '^{' > "$OUT/prefix.jsonl"
cut -c1-400 "$OUT/prefix.jsonl"
timeout "${PROFILE_TIMEOUT:-80}" python3 benchmarks/gpu_profile.py --workload 2>/dev/null | tee "$OUT/workload_profile.txt"
