"""The decode kernel launched a few times eagerly, for Nsight Compute: the
Qwen3-0.6B shape (16 query heads on 8 KV heads of 128), ROWS rows whose
lengths spread evenly around MEAN keys (as the 256-prompt workload's
decode steps), blocks of 16, one pool format (KV: none or fp8 or int8).

Usage (GPU machine; ncu is /usr/local/cuda/bin/ncu there):
    ncu --kernel-name regex:_decode_split_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats --section SchedulerStats \\
        env KV=fp8 PYTHONPATH=. python3 benchmarks/gpu_decode_ncu.py
"""

from __future__ import annotations

import os

import torch

from pagedlm.cache import kv_quant as kvq
from pagedlm.kernels import paged_attention as pa

HQ, HKV, D, BS = 16, 8, 128, 16
ROWS, MEAN = int(os.environ.get("ROWS", 192)), int(os.environ.get("MEAN", 1024))
KV = os.environ.get("KV", "none")
DEVICE = os.environ.get("DEVICE", "cuda")  # cpu with TRITON_INTERPRET=1: a check that it runs


def main() -> None:
    torch.manual_seed(0)
    lo = MEAN // 8
    lengths = torch.linspace(lo, 2 * MEAN - lo, ROWS).long()[torch.randperm(ROWS)]
    width = -(-int(lengths.max()) // BS)
    blocks = ROWS * width
    k_pool = torch.randn(blocks, BS, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    scales = None
    if KV != "none":
        (k_pool, k_scale), (v_pool, v_scale) = kvq.quantize_pools(k_pool, v_pool, KV)
        scales = (k_scale, v_scale)
    tables = torch.randperm(blocks, device=DEVICE).view(ROWS, width)
    q = torch.randn(ROWS, HQ, D, device=DEVICE, dtype=torch.bfloat16)
    seq_lens = lengths.to(DEVICE)
    for _ in range(4):
        pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, D**-0.5, None, scales)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    keys = int(lengths.sum())
    print(f"decode kernel: {ROWS} rows, {keys} keys, KV {KV}: "
          f"{2 * keys * HKV * D * (2 if KV == 'none' else 1) / 1e6:.1f} MB of keys and values a launch")


if __name__ == "__main__":
    main()
