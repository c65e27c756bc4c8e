#!/usr/bin/env bash
# H200 calls for issues 21 and 22 (and issue 20's remaining rows), run from a `git archive` of the commit (NOW=.now).
#   tests   tests/gpu (GPU_TESTS: other pytest arguments, evaluated: quote a -k expression inside it)
#   spec    benchmarks/gpu_spec.py: a verify step of 1 + k queries a row against a plain decode step,
#           three shapes, batch 1 and 32; a Llama-3.2-1B-shaped draft for the 8B shape, graphs and eager
#   mask    bench throughput --json-schema at batch 1, 16, 64: the Qwen3-0.6B shape over SmolLM2's tokenizer
#           (49,152 tokens), and the Gemma 3 270M shape over its own (262,144); llguidance from the carried wheel;
#           MASK_SHAPES (config:tokenizer pairs) and MASK_ASYNC ("on off": both engines, interleaved by shape);
#           MASK_FLAGS: more bench flags (e.g. --structured-temperature 1)
#   maskfill benchmarks/mask_fill.py: the host's fill of 64 rows' bitmasks by lanes (a thread each), WALKS random text,
#           and BESIDE (mask_fill.py's)
#   masksteps benchmarks/mask_steps.py: the mask bench under async with the fill's and the host's parts timed
#           (PARTS=1) at MASK_SIZES ("1 16 64"), OMP_NUM_THREADS=MASK_OMP ("16": torch's intra-op threads,
#           which spin beside the lanes), PREFETCH over PREFETCHES ("1"; 0 turns the background fill off);
#           with BASE (another tree) that tree too (as it is), interleaved over ROUNDS (1)
#   workload the 256-prompt workload, bf16 and fp8 KV (no transformers), for kernel_compiles_in_runs
#   decode  batch-1 decode, three shapes, --against hf, no KV budget given (the defaults); DECODE_FLAGS adds flags
#           (e.g. --no-async-scheduling), AGAINST="" drops transformers, SHAPES picks the shapes
#   ab      the 256-prompt workload with --async-scheduling and --no-async-scheduling, interleaved, ROUNDS rounds
#   profile benchmarks/gpu_profile.py (batch 1 on two shapes, and --workload) with ASYNC=0 then ASYNC=1
#   kernels benchmarks/gpu_profile.py's device time by kernel: batch-1 graph replays (KERNELS=1, two shapes) and
#           the 256-prompt workload's steps mid-run (--kernels), bf16 then fp8 KV
#   prefkernels the same for the prompt-heavy row's steps (PREFILL=1: prompt chunks, steps SKIP.. of 10)
#   prefsweep benchmarks/gpu_prefill.py: the multi-query kernel against SDPA's flash kernel, PREFILL_SHAPES
#           (qwen3-0.6b), tile variants PREFILL_VARIANTS ("BM,BN,W,STAGES,HEAVY ...")
#   sweep   benchmarks/gpu_fast.py, the decode kernel alone on SWEEP_SHAPES (qwen3-0.6b) at SWEEP_CASES, one process
#           per tree of SWEEP_TREES ($NOW; e.g. ".now .ab") and --set variant of SWEEP_SETS ("-": as is;
#           NAME=VALUE,NAME=VALUE), KV formats SWEEP_KV
#   trees   batch-1 decode (AB_SHAPE, gemma3-270m; several shapes: each) of this tree ($NOW) against BASE (a
#           `git archive` of another commit), interleaved, ROUNDS rounds
#   workab  the 256-prompt workload (KV formats WORK_KV: "none") in this tree ($NOW) and BASE, interleaved,
#           ROUNDS rounds (output_tok_s, prefill_tok_s)
#   gemv    benchmarks/gemv_sweep.py: the few-row product kernel against cuBLAS, decode shapes (GEMV_ARGS: its flags)
#   prefill the prompt-heavy row: PREFILL_PROMPTS (256) prompts of PREFILL_LENS ("1024 4096": least and most) tokens,
#           one output token each, bf16 KV (prefill_tok_s: the prefill rate)
#   hf      the 256-prompt workload against transformers' continuous batching (HF_PROMPTS of them), bf16 and fp8 KV
# Carried (ignored paths): .now (the tree), .carry (llguidance's wheel; tokenizer.json + tokenizer_config.json
# of SmolLM2 and Gemma 3, from the GGUF conversions in ~/.cache/pagedlm/converted).
# Usage (repository root, GPU machine): OUT=... STEPS="tests spec" bash benchmarks/gpu_spec_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NOW=${NOW:-.now}; CARRY=$(pwd)/.carry
M=benchmarks/configs
WORK256="--random-weights --model $M/qwen3-0.6b --device cuda --num-prompts 256 --min-len 100 --max-len 1024 --seed 0 --stores paged"  # nano-vllm's workload
has() { [[ " ${STEPS:-tests spec mask} " == *" $1 "* ]]; }
bench() {  # output file, limit, bench arguments...
  local file=$1 limit=$2; shift 2
  (cd "$NOW" && PYTHONPATH=.:${LIB:-} timeout "$limit" python3 -m pagedlm.cli bench "$@" --json 2>>"$OUT/bench.err") \
    | grep '^{' | tee -a "$OUT/$file"
}
grammar_lib() {  # llguidance (and gguf, for the tests) from their carried wheels, on LIB
  LIB=/tmp/pylib; [ -d $LIB/llguidance ] || { mkdir -p $LIB && for w in "$CARRY"/*.whl; do python3 -m zipfile -e "$w" $LIB; done; }
}
if has tests; then
  ls "$CARRY"/llguidance-*.whl >/dev/null 2>&1 && grammar_lib  # the grammar tests run where the wheel travels
  (cd "$NOW" && export PYTHONPATH=.:${LIB:-} && eval timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rf "${GPU_TESTS:-tests/gpu}") > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
fi
if has spec; then
  (cd "$NOW" && PYTHONPATH=. timeout "${SPEC_TIMEOUT:-200}" python3 benchmarks/gpu_spec.py) 2>>"$OUT/bench.err" | tee "$OUT/spec.jsonl"
fi
if has mask; then
  grammar_lib
  for pair in ${MASK_SHAPES:-qwen3-0.6b:smollm2-tok gemma3-270m:gemma-tok}; do
    set -- ${pair/:/ }; dir=/tmp/mask-$1; mkdir -p "$dir"
    [ -d "$CARRY/$2" ] || { echo "mask: $1 skipped, .carry/$2 not carried" >>"$OUT/bench.err"; continue; }
    cp "$NOW/$M/$1/config.json" "$CARRY/$2"/tokenizer*.json "$dir/"
    for mode in ${MASK_ASYNC:-on}; do  # on, off: with --async-scheduling, --no-async-scheduling
      bench mask.jsonl 200 throughput --random-weights --model "$dir" --device cuda --$([ $mode = on ] || echo no-)async-scheduling \
        --json-schema "$(pwd)/$NOW/$M/person.schema.json" --structured-batch-sizes 1 16 64 --repeats 3 ${MASK_FLAGS:-}
    done
  done
fi
if has maskfill; then  # the host's fill alone, by lanes (benchmarks/mask_fill.py)
  grammar_lib
  for walk in ${WALKS:-random text}; do
    (cd "$NOW" && PYTHONPATH=.:$LIB LANES="${LANES:-1 2 4 8}" BESIDE="${BESIDE:-0}" WALK=$walk \
      timeout 200 python3 benchmarks/mask_fill.py \
      "$CARRY/smollm2-tok" 151936 64) 2>>"$OUT/bench.err" | tee -a "$OUT/mask_fill.jsonl"
  done
fi
if has masksteps; then  # async grammar steps: the fill by thread and the host's parts, by torch's thread count;
  grammar_lib; dir=/tmp/mask-qwen3-0.6b; mkdir -p $dir  # with BASE, that tree too, interleaved over ROUNDS
  cp "$NOW/$M/qwen3-0.6b/config.json" "$CARRY/smollm2-tok"/tokenizer*.json $dir/
  script=$(cd "$NOW" && pwd)/benchmarks/mask_steps.py
  for round in $(seq "${ROUNDS:-1}"); do for tree in "$NOW" ${BASE:-}; do
    for pre in $([ "$tree" = "$NOW" ] && echo ${PREFETCHES:-1} || echo 1); do
    (cd "$tree" && PARTS=1 PREFETCH=$pre OMP_NUM_THREADS=${MASK_OMP:-16} PYTHONPATH=.:$LIB timeout 150 python3 "$script" \
      bench throughput --random-weights --model $dir --device cuda --async-scheduling \
      --json-schema $M/person.schema.json --structured-batch-sizes ${MASK_SIZES:-1 16 64} --repeats 2 ${MASK_FLAGS:-} \
      --json) \
      2>>"$OUT/bench.err" | grep '^{' | sed "s|^|[$tree prefetch=$pre] |" | tee -a "$OUT/mask_steps.jsonl" | cut -c1-600
  done; done; done
fi
if has decode; then
  for cfg in ${SHAPES:-gemma3-270m qwen3-0.6b llama-3.1-8b}; do
    bench decode.jsonl ${DECODE_LIMIT:-200} decode --random-weights --model $M/$cfg --device cuda --prompt-len 512 \
      --gen-len 128 --repeats 3 ${AGAINST---against hf} ${DECODE_FLAGS:-}
  done
fi
if has ab; then
  for round in $(seq "${ROUNDS:-2}"); do
    for flag in --async-scheduling --no-async-scheduling; do
      bench ab.jsonl 200 throughput $WORK256 $flag ${AB_FLAGS:-}
    done
  done
fi
if has profile; then
  for a in 0 1; do
    (cd "$NOW" && ASYNC=$a PYTHONPATH=. timeout 200 python3 benchmarks/gpu_profile.py qwen3-0.6b gemma3-270m \
      && ASYNC=$a PYTHONPATH=. timeout 200 python3 benchmarks/gpu_profile.py --workload) 2>>"$OUT/bench.err" \
      | tee -a "$OUT/profile.txt"
  done
fi
if has kernels; then
  (cd "$NOW" && KERNELS=1 PYTHONPATH=. timeout 200 python3 benchmarks/gpu_profile.py qwen3-0.6b gemma3-270m \
    && for kv in ${KV_MODES:-none fp8}; do KV=$kv PYTHONPATH=. timeout 150 python3 benchmarks/gpu_profile.py --kernels; done) \
    2>>"$OUT/bench.err" | tee -a "$OUT/kernels.txt"
fi
if has prefkernels; then
  (cd "$NOW" && PREFILL=1 SKIP=${SKIP:-20} PROFILE_STEPS=10 PYTHONPATH=. timeout 200 python3 benchmarks/gpu_profile.py \
    --kernels) 2>>"$OUT/bench.err" | tee -a "$OUT/kernels.txt"
fi
if has prefsweep; then
  (cd "$NOW" && SHAPES="${PREFILL_SHAPES:-qwen3-0.6b}" VARIANTS="${PREFILL_VARIANTS:-}" PYTHONPATH=. timeout 240 \
    python3 benchmarks/gpu_prefill.py) 2>>"$OUT/bench.err" | tee -a "$OUT/prefill_sweep.jsonl"
fi
if has sweep; then
  for tree in ${SWEEP_TREES:-$NOW}; do for set in ${SWEEP_SETS:--}; do
    (cd "$tree" && PYTHONPATH=. timeout 150 python3 benchmarks/gpu_fast.py --skip curve --shapes ${SWEEP_SHAPES:-qwen3-0.6b} \
      --cases ${SWEEP_CASES:-192x1024v 64x2048v} --kv ${SWEEP_KV:-none fp8} $([ "$set" = - ] || echo --set ${set//,/ })) \
      2>>"$OUT/bench.err" | sed "s/^/[$tree $set] /" | tee -a "$OUT/sweep.txt" | grep -E "\] kernel|copy bandwidth|resources"
  done; done
fi
if has trees; then
  for round in $(seq "${ROUNDS:-2}"); do for shape in ${AB_SHAPE:-gemma3-270m}; do
    for tree in "$NOW" "${BASE:?trees: BASE names the other tree}"; do
      (cd "$tree" && PYTHONPATH=. timeout 150 python3 -m pagedlm.cli bench decode --random-weights \
        --model benchmarks/configs/$shape --device cuda --prompt-len 512 --gen-len 128 --repeats 3 \
        --json) 2>>"$OUT/bench.err" | grep '^{' | sed "s|^|[$tree $shape] |" | tee -a "$OUT/trees.txt" | cut -c1-300
    done
  done; done
fi
if has workab; then
  for round in $(seq "${ROUNDS:-2}"); do for quant in ${WORK_KV:-none}; do
    for tree in "$NOW" "${BASE:?workab: BASE names the other tree}"; do
      (cd "$tree" && PYTHONPATH=. timeout 150 python3 -m pagedlm.cli bench throughput $WORK256 \
        --attention-backend triton --kv-quant $quant --json) 2>>"$OUT/bench.err" | grep '^{' \
        | sed "s|^|[$tree $quant] |" | tee -a "$OUT/workab.txt" | cut -c1-300
    done
  done; done
fi
if has gemv; then
  (cd "$NOW" && PYTHONPATH=. timeout "${GEMV_TIMEOUT:-240}" python3 benchmarks/gemv_sweep.py ${GEMV_ARGS:---quick}) \
    2>>"$OUT/bench.err" | tee "$OUT/gemv.jsonl" | grep -v '^{'
fi
if has workload; then
  for quant in none fp8; do
    bench workload.jsonl 200 throughput $WORK256 --attention-backend triton --kv-quant $quant
  done
fi
if has prefill; then
  set -- ${PREFILL_LENS:-1024 4096}
  bench prefill.jsonl 200 throughput --random-weights --model $M/qwen3-0.6b --device cuda --num-prompts \
    "${PREFILL_PROMPTS:-256}" --min-len $1 --max-len $2 --output-len 1 --seed 0 --stores paged --repeats 3
fi
if has hf; then
  for quant in none fp8; do
    bench hf.jsonl 300 throughput $WORK256 --attention-backend triton --kv-quant $quant \
      --against hf --hf-num-prompts "${HF_PROMPTS:-64}"
  done
fi
[ -s "$OUT/bench.err" ] && tail -5 "$OUT/bench.err"
exit 0
