#!/usr/bin/env bash
# One session's H200 figures for issues 11 (8-bit KV decode) and 12 (int4
# weights), in two device calls (PART=1, PART=2), rows written under $OUT:
#   PART=1  tests/gpu; the decode kernel alone, bf16/fp8/int8 KV, batch 1 at
#           8k-32k and two big batches, as the kernel now is, with kernel
#           constants overridden (VARIANTS) and as another tree's kernel
#           (BASELINE); batch-1 decode at 32k tokens through the engine, bf16
#           against fp8 KV (Llama-3.1-8B shape).
#   PART=2  int4 weights: batch-1 decode (Qwen3-0.6B and Llama-3.1-8B shapes)
#           against bf16 on the same store (kernels + CUDA graphs), with the
#           roofline of each row's own bytes; the 256-prompt workload, int4
#           against bf16 (Qwen3-0.6B shape).
# Usage (repository root, GPU machine): PART=1 OUT=... bash benchmarks/gpu_quant_session.sh
# (GPU_TESTS=path narrows the tests of PART=1; STEPS picks among its steps "tests
# kernel engine"; KV_FORMATS the kernel rows' formats, VARIANT_FORMATS those of the
# VARIANTS other than as-is; BASELINE=dir also times the kernel of the pagedlm
# package under dir (e.g. an older commit's, from git archive) in the same call, as
# [baseline]; KV_PROMPTS, KV_GEN and KV_REPEATS the engine's decode run.)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=benchmarks/configs
STEPS=${STEPS:-tests kernel engine}
sweep() {  # label, PYTHONPATH, gpu_fast arguments...
  local label=$1 path=$2; shift 2
  PYTHONPATH=$path timeout 100 python3 benchmarks/gpu_fast.py --skip curve --shapes llama-3.1-8b \
    --cases 1x8192 1x16384 1x32768 64x2048 256x1024 "$@" 2>&1 \
    | grep '^kernel\|^copy\|Error' | sed "s/^/[$label] /" | tee -a "$OUT/kernel_sweep.txt"
}
if [ "${PART:-1}" = 1 ]; then
  if [[ " $STEPS " == *" tests "* ]]; then
    timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu} > "$OUT/gpu_tests.log" 2>&1
    tail -6 "$OUT/gpu_tests.log"
  fi
  if [[ " $STEPS " == *" kernel "* ]]; then
    IFS=, read -ra variants <<< "${VARIANTS:-as-is}"  # e.g. VARIANTS="as-is,STAGES=1 BLOCK_N=32"
    for variant in "${variants[@]}"; do
      if [ "$variant" = as-is ]; then
        sweep as-is "$PYTHONPATH" --kv ${KV_FORMATS:-none fp8 int8}
      else
        sweep "$variant" "$PYTHONPATH" --kv ${VARIANT_FORMATS:-${KV_FORMATS:-none fp8 int8}} --set $variant
      fi
    done
    [ -z "${BASELINE:-}" ] || sweep baseline "$BASELINE" --kv ${KV_FORMATS:-none fp8 int8}
  fi
  [[ " $STEPS " == *" engine "* ]] || exit 0
  timeout "${KV_TIMEOUT:-150}" python3 -m pagedlm.cli bench decode --random-weights --model $M/llama-3.1-8b \
    --device cuda --prompt-len ${KV_PROMPTS:-8192 32768} --gen-len ${KV_GEN:-64} --repeats ${KV_REPEATS:-2} --paged-kv --kv-quant fp8 --attention-backend triton \
    --kv-budget-bytes 17G --max-num-seqs 1 --max-num-batched-tokens 1024 --json 2>"$OUT/kv_quant_decode.err" | grep '^{' > "$OUT/kv_quant_decode.jsonl"
  [ -s "$OUT/kv_quant_decode.jsonl" ] || tail -5 "$OUT/kv_quant_decode.err"
  python3 - "$OUT/kv_quant_decode.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['prompt_len']:6d} {r['name']:22s} {r['decode_ms_per_token']:8.3f} ms/tok  vs default x{r.get('decode_ratio_vs_default')}  roofline {r.get('roofline_fraction')}")
PY
else
  for cfg in qwen3-0.6b llama-3.1-8b; do
    timeout "${SHAPE_TIMEOUT:-200}" python3 -m pagedlm.cli bench decode --random-weights --model $M/$cfg --device cuda \
      --prompt-len 512 --gen-len 128 --repeats 3 --paged-kv --attention-backend triton --quantization int4 \
      --kv-budget-bytes 8G --json 2>/dev/null | grep '^{' | tee -a "$OUT/int4_decode.jsonl" | cut -c1-300
  done
  python3 - "$OUT/int4_decode.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['model'].split('/')[-1]:14s} {r['name']:16s} {r['decode_ms_per_token']:8.3f} ms/tok  roofline {r['roofline_ms_per_token']:.3f} ms ({r['roofline_fraction']})  prefill {r['prefill_tok_s']:.0f} tok/s")
PY
  timeout "${TP_TIMEOUT:-200}" python3 -m pagedlm.cli bench throughput --random-weights --model $M/qwen3-0.6b --device cuda \
    --paged-kv --attention-backend triton --stores paged --quantization int4 --json 2>/dev/null | grep '^{' \
    | tee "$OUT/int4_throughput.jsonl" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r["name"], r["output_tok_s"], "tok/s", r.get("ratio_vs_unquantized"), "preemptions", r["preemptions"])'
fi
