#!/usr/bin/env bash
# Nsight Compute on the decode kernel (issue 20: why fp8 tiles read at ~60% of bf16's rate), one
# launch per pool format at the 256-prompt workload's decode shape (benchmarks/gpu_decode_ncu.py:
# ROWS rows around MEAN keys). From a `git archive` (NOW=.now); the device's ncu is in /usr/local/cuda/bin.
# Usage (repository root, GPU machine): OUT=... bash benchmarks/gpu_ncu.sh     (KV_FORMATS="none fp8")
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; NOW=${NOW:-.now}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
for kv in ${KV_FORMATS:-none fp8}; do
  (cd "$NOW" && KV=$kv PYTHONPATH=. timeout 240 "$NCU" --kernel-name regex:_decode_split_kernel \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
    --section SourceCounters python3 benchmarks/gpu_decode_ncu.py) > "$OUT/ncu-$kv.txt" 2>&1
  grep -E "decode kernel:|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issue Slots|Block Limit" \
    "$OUT/ncu-$kv.txt" | head -40
done
