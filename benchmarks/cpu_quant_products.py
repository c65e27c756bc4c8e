"""Quantized products on the CPU: torch's kernels (bfloat16 activations, as
``QuantizedWeight`` called them before issue 24) against ``kernels.cpu_quant``'s
integer ones, one row and 512 rows, the real models' shapes; median of 5
timed rounds, GB/s of codes. One JSON line per (shape, mode, rows).

    PYTHONPATH=. python benchmarks/cpu_quant_products.py > rows.jsonl
"""
import json
import time

import torch

from pagedlm.kernels import cpu_quant as cq
from pagedlm.kernels.quant import quantize, unpack_int4

assert cq.library(), "no integer CPU kernel here"
mm = torch.ops.pagedlm.cpu_quant_mm.default


def bench(f, budget=0.3):
    for _ in range(5):
        f()
    rounds = []
    for _ in range(5):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < budget / 5:
            f()
            n += 1
        rounds.append((time.perf_counter() - t0) / n)
    return sorted(rounds)[2]


shapes = {"smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
          "smollm2 head": (49152, 576), "gemma qkv": (1536, 640), "gemma o": (640, 1024), "gemma gate_up": (4096, 640),
          "gemma down": (640, 2048), "gemma head": (262144, 640)}
for label, (n, k) in shapes.items():
    w = torch.randn(n, k)
    for mode in ("int4", "int8"):
        if mode == "int4" and label == "gemma head":
            continue  # int8 in both modes (its GGUF tensor is Q8_0)
        st = quantize(w, mode)
        if mode == "int4":
            codes, zeros = unpack_int4(st["qweight"]), st["mins"] + 8 * st["scales"]
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
            sz_torch = torch.stack((st["scales"].t(), zeros.t()), -1).contiguous().bfloat16()
            tiles, sz = cq.pack_int4(codes, torch.stack((st["scales"], zeros), -1).bfloat16())
            old = lambda x: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz_torch).float()
            new = lambda x: mm(x, tiles, sz)
            nbytes = n * k / 2
        else:
            q, s = st["qweight"], st["scales"]
            s_bf16, tiles = s.bfloat16(), cq.pack_int8(q)
            old = lambda x: torch._weight_int8pack_mm(x.bfloat16(), q, s_bf16).float()
            new = lambda x: mm(x, tiles, s)
            nbytes = n * k
        for rows in (1,) if "head" in label else (1, 512):
            x = torch.randn(rows, k)
            to, tn = bench(lambda: old(x)), bench(lambda: new(x))
            print(json.dumps({"shape": label, "n": n, "k": k, "mode": mode, "rows": rows, "threads": torch.get_num_threads(),
                              "torch_us": round(to * 1e6, 1), "cpu_quant_us": round(tn * 1e6, 1),
                              "torch_gb_s": round(nbytes / to / 1e9, 1), "cpu_quant_gb_s": round(nbytes / tn / 1e9, 1),
                              "speedup": round(to / tn, 2)}), flush=True)
