#!/usr/bin/env bash
# Batched engine on the H200 (issue 7): Qwen3-0.6B shape, random weights,
# nano-vllm's 256-prompt workload (input and output lengths uniform in
# 100..1024, EOS ignored): the default store, the paged store and transformers'
# continuous batching on the same weights and prompts, in one process.
#
# Usage (repository root, on the GPU machine):  PYTHONPATH=. bash benchmarks/gpu_batched.sh
# Needs only torch, transformers, numpy, safetensors and tqdm (no gguf or
# fastapi). Prints JSON rows; copies them under $OUT when set.
#
# Time: ours is eager and launch-bound (~15-25 ms a step; ~1,000+ steps at
# up to 256 rows: about a minute per store with prefill). transformers runs
# last with its own limit (HF_TIMEOUT s, default 240); if it is slower than
# that on all 256 prompts, rerun with HF_NUM_PROMPTS=64 (the rows then say
# hf_num_prompts, and its tok/s is over those prompts only). The whole run is
# capped at LIMIT s (default 470).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-}
LIMIT=${LIMIT:-470}
HF_TIMEOUT=${HF_TIMEOUT:-240}
NUM_PROMPTS=${NUM_PROMPTS:-256}
BLOCK=${BLOCK:-16}
STORES=${STORES:-both}  # "paged": skip the default store (its per-row caches are slow on the GPU)
BACKEND=${BACKEND:-auto}  # paged attention: auto runs paged-gather and paged-fused; triton only the fused

DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
cat > "$DIR/config.json" <<'EOF'
{
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",
  "hidden_size": 1024,
  "intermediate_size": 3072,
  "num_hidden_layers": 28,
  "num_attention_heads": 16,
  "num_key_value_heads": 8,
  "head_dim": 128,
  "vocab_size": 151936,
  "max_position_embeddings": 40960,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000,
  "tie_word_embeddings": true,
  "attention_bias": false,
  "hidden_act": "silu",
  "torch_dtype": "bfloat16"
}
EOF

python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))' >&2

HF_ARGS=(--against hf --hf-timeout "$HF_TIMEOUT")
if [ -n "${HF_NUM_PROMPTS:-}" ]; then HF_ARGS+=(--hf-num-prompts "$HF_NUM_PROMPTS"); fi

timeout --signal=INT --kill-after=20 "$LIMIT" \
  python3 -m pagedlm.cli bench throughput --model "$DIR" --random-weights --device cuda \
    --num-prompts "$NUM_PROMPTS" --min-len 100 --max-len 1024 --seed 0 \
    --paged-kv --paged-kv-block-size "$BLOCK" --stores "$STORES" --attention-backend "$BACKEND" \
    "${HF_ARGS[@]}" --json \
  | tee "$DIR/rows.jsonl"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  echo "{\"name\": \"gpu_batched\", \"error\": \"bench throughput exited $rc (124/130: over LIMIT=$LIMIT s)\"}"
fi
if [ -n "$OUT" ]; then mkdir -p "$OUT" && cp "$DIR/rows.jsonl" "$OUT/gpu_batched.jsonl"; fi
exit "$rc"
