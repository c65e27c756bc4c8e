#!/usr/bin/env bash
# One device call of the 2026-12-06 session (issues 20 and 22), from a `git archive` in .now:
# the async tests; the grammar step's host parts at batch 64; the workload's kernels with the step's KV bytes; the decode
# kernel alone at the workload's batch sizes, bf16 and fp8; batch-1 decode of Gemma 3 270M, this tree
# against the one in ../.ab (rounds interleaved).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; CARRY=$(pwd)/.carry
LIB=/tmp/pylib; [ -d $LIB/llguidance ] || { mkdir -p $LIB && for w in "$CARRY"/*.whl; do python3 -m zipfile -e "$w" $LIB; done; }
cd .now
has() { [[ " ${NOW_STEPS:-stops profile kernels fast} " == *" $1 "* ]]; }
if has stops; then
  which ncu nsys 2>&1 | head -2; PYTHONPATH=.:$LIB timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_async_scheduling_gpu.py \
    > "$OUT/stops.log" 2>&1; tail -2 "$OUT/stops.log"
fi
if has profile; then  # the host's parts of grammar steps at 64 rows (mask_steps.py PARTS=1)
  dir=/tmp/mask-qwen3-0.6b; mkdir -p $dir; cp benchmarks/configs/qwen3-0.6b/config.json "$CARRY/smollm2-tok"/tokenizer*.json $dir/
  PARTS=1 OMP_NUM_THREADS=16 PYTHONPATH=.:$LIB timeout 150 python3 benchmarks/mask_steps.py \
    bench throughput --random-weights --model $dir --device cuda --async-scheduling \
    --json-schema benchmarks/configs/person.schema.json --structured-batch-sizes 64 --repeats 2 --json \
    2>>"$OUT/err.txt" | tee -a "$OUT/mask_profile.txt" | grep -E '^\{"steps'
fi
if has kernels; then
  for kv in none fp8; do
    KV=$kv PYTHONPATH=. timeout 150 python3 benchmarks/gpu_profile.py --kernels 2>>"$OUT/err.txt" | tee -a "$OUT/kernels.txt" | head -4
  done
fi
if has fast; then  # the decode kernel alone; FAST_SETS: --set variants, one process each ("-": as is)
  for set in ${FAST_SETS:--}; do
    PYTHONPATH=. timeout 150 python3 benchmarks/gpu_fast.py --skip curve --shapes qwen3-0.6b \
      --cases ${FAST_CASES:-128x1024 192x1024 192x1024v 64x2048v} --kv ${FAST_KV:-none fp8} $([ "$set" = - ] || echo --set ${set//,/ }) \
      2>>"$OUT/err.txt" | sed "s/^/[$set] /" | tee -a "$OUT/fast.txt" | grep -E "\] kernel|copy bandwidth|resources"
  done
fi
if has gemma; then  # batch-1 decode, this tree (.now) against ../.ab, interleaved
  for round in 1 2; do
    for tree in .now .ab; do
      (cd ../$tree && PYTHONPATH=. timeout 120 python3 -m pagedlm.cli bench decode --random-weights \
        --model benchmarks/configs/${AB_SHAPE:-gemma3-270m} --device cuda --prompt-len 512 --gen-len 128 --repeats 3 --json) \
        2>>"$OUT/err.txt" | grep '^{' | sed "s/^/[$tree] /" | tee -a "$OUT/ab.txt" | cut -c1-300
    done
  done
fi
tail -3 "$OUT/err.txt" 2>/dev/null; nvidia-smi --query-gpu=name --format=csv,noheader
