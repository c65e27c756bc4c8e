#!/usr/bin/env bash
# One H200 call for issue 19 (the engine's seams reshaped, behaviour unchanged):
#   tests/gpu (the paged == default gate with the kernels and CUDA graphs among them);
#   batch-1 decode on the Qwen3-0.6B and Gemma 3 270M shapes (`bench decode`, paged
#   store with the kernels and CUDA graphs) and the 256-prompt workload (`bench
#   throughput`), this tree against the pagedlm package under BASELINE (a `git
#   archive` of the commit before the reshaping), interleaved, in the same call.
# Usage (repository root, GPU machine): OUT=... BASELINE=.ab bash benchmarks/gpu_seams_session.sh
# (TESTS=0 skips tests/gpu; ROUNDS sets the pairs of each bench; SHAPES the decode shapes.)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=benchmarks/configs
[ "${TESTS:-1}" = 0 ] || timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.log" 2>&1
[ "${TESTS:-1}" = 0 ] || tail -3 "$OUT/gpu_tests.log"
run() {  # label, PYTHONPATH, output file, bench arguments...
  local label=$1 path=$2 file=$3; shift 3
  PYTHONPATH=$path timeout 200 python3 -m pagedlm.cli bench "$@" --json 2>>"$OUT/bench.err" | grep '^{' \
    | sed "s/^{/{\"tree\": \"$label\", /" | tee -a "$OUT/$file"
}
for round in $(seq "${ROUNDS:-2}"); do
  for tree in now baseline; do
    path=.; [ $tree = now ] || path=${BASELINE:-}
    [ -n "$path" ] || continue
    for cfg in ${SHAPES:-qwen3-0.6b gemma3-270m}; do
      run $tree "$path" decode.jsonl decode --random-weights --model $M/$cfg --device cuda --prompt-len 512 \
        --gen-len 128 --repeats 3 --paged-kv --attention-backend triton
    done
    run $tree "$path" throughput.jsonl throughput --random-weights --model $M/qwen3-0.6b --device cuda \
      --num-prompts 256 --min-len 100 --max-len 1024 --seed 0 --paged-kv --stores paged --attention-backend triton
  done
done
[ -s "$OUT/throughput.jsonl" ] || tail -5 "$OUT/bench.err"
