#!/usr/bin/env bash
# H200 calls for issue 20 (the multi-query paged kernel, paging on by default on CUDA).
# Each tree runs from its own folder (a `git archive`), so that an unfinished
# working tree never runs: NOW=.now (this commit) and BASELINE=.ab (the commit
# before the kernel), interleaved round by round.
#   tests     tests/gpu on NOW (GPU_TESTS: other pytest arguments)
#   kernel    benchmarks/gpu_prefill.py (the kernel against gather + SDPA and contiguous flash SDPA)
#   workload  the 256-prompt workload (Qwen3-0.6B shape), NOW and BASELINE; NOW also with --kv-quant fp8
#   prefill   256 prompts of 1024 tokens, one output token each (total_tok_s ~ prefill tok/s), NOW:
#             paged-fused (the kernels) against paged-gather (gather + SDPA) in the same process
#   profile   benchmarks/gpu_profile.py --workload on NOW (graph vs eager steps)
#   decode    batch-1 decode, three shapes, --against hf, no KV budget given (the defaults)
#   hf        the 256-prompt workload on NOW against transformers' continuous batching (HF_PROMPTS of them)
# Usage (repository root, GPU machine): OUT=... STEPS="tests kernel" bash benchmarks/gpu_prefill_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NOW=${NOW:-.now}; BASELINE=${BASELINE:-.ab}
M=benchmarks/configs
has() { [[ " ${STEPS:-tests kernel workload prefill profile} " == *" $1 "* ]]; }
bench() {  # label, tree, output file, limit, bench arguments...
  local label=$1 tree=$2 file=$3 limit=$4; shift 4
  (cd "$tree" && PYTHONPATH=. timeout "$limit" python3 -m pagedlm.cli bench "$@" --json 2>>"$OUT/bench.err") \
    | grep '^{' | sed "s/^{/{\"tree\": \"$label\", /" | tee -a "$OUT/$file"
}
if has tests; then
  (cd "$NOW" && timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rf ${GPU_TESTS:-tests/gpu}) > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
fi
if has kernel; then
  (cd "$NOW" && PYTHONPATH=. timeout 150 python3 benchmarks/gpu_prefill.py) 2>>"$OUT/bench.err" | tee "$OUT/kernel.jsonl"
fi
for round in $(seq "${ROUNDS:-2}"); do
  for tree in now baseline; do
    dir=$NOW; [ $tree = now ] || dir=$BASELINE
    quant=(); [ $tree = now ] && [ "$round" = 1 ] && quant=(--kv-quant fp8)
    has workload && bench $tree "$dir" workload.jsonl 200 throughput --random-weights --model $M/qwen3-0.6b \
      --device cuda --num-prompts 256 --min-len 100 --max-len 1024 --seed 0 --paged-kv --stores paged \
      --attention-backend triton "${quant[@]}"
  done
done
if has prefill; then  # the kernels (paged-fused) against the gather + SDPA path (paged-gather), same process
  bench now "$NOW" prefill.jsonl 200 throughput --random-weights --model $M/qwen3-0.6b --device cuda \
    --num-prompts 256 --min-len 1024 --max-len 1024 --output-len 1 --seed 0 --paged-kv --stores paged --repeats 3
fi
if has profile; then
  (cd "$NOW" && PYTHONPATH=. timeout 120 python3 benchmarks/gpu_profile.py --workload) 2>>"$OUT/bench.err" | tee "$OUT/profile.txt"
fi
if has decode; then
  for cfg in gemma3-270m qwen3-0.6b llama-3.1-8b; do
    bench now "$NOW" decode.jsonl 200 decode --random-weights --model $M/$cfg --device cuda --prompt-len 512 \
      --gen-len 128 --repeats 3 --against hf
  done
fi
if has hf; then
  bench now "$NOW" hf.jsonl 300 throughput --random-weights --model $M/qwen3-0.6b --device cuda --num-prompts 256 \
    --min-len 100 --max-len 1024 --seed 0 --stores paged --attention-backend triton --against hf \
    --hf-num-prompts "${HF_PROMPTS:-64}"
fi
[ -s "$OUT/bench.err" ] && tail -5 "$OUT/bench.err"
exit 0
