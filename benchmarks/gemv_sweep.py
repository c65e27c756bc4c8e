"""The few-row product kernel (``kernels.gemv``) against cuBLAS (``F.linear``)
on the decode shapes of the three benchmark models, and over a grid of tile
sizes, so that ``gemv.config`` can be chosen from measurements.

Each product is timed as a decode step runs it: inside a CUDA graph, back
to back over enough copies of its weight that they cannot stay in L2 (200
MB or more in all), so every weight streams from memory. With ``--grid``,
one row tries the one-row kernel's tiles (columns a program, K a tile,
warps) and more rows the tensor-core kernel's (and pipeline stages).

Each gate/up product is also timed with its activation: cuBLAS then
``fused.act_mul`` against the kernel with the activation inside.

Usage (a CUDA machine): PYTHONPATH=. python3 benchmarks/gemv_sweep.py [--grid | --quick] [--rows 1 8 16]
Prints one JSON line per (shape, rows): cuBLAS, the kernel with ``gemv.config``'s tiles, the best of
the grid's; a line per tile that failed to launch; then a table.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from pagedlm.kernels import fused, gemv

SHAPES = {  # model: (name, N, K) of each product a decode step runs
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
                   ("head", 151936, 1024)],
    "gemma3-270m": [("qkv", 1536, 640), ("o", 640, 1024), ("gate_up", 4096, 640), ("down", 640, 2048),
                    ("head", 262144, 640)],
    "llama-3.1-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                     ("head", 128256, 4096)],
}


def graph_time(fn, copies: int, replays: int = 20) -> float:
    """Microseconds a call of ``fn(i)`` (i over the copies) inside one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * copies))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--grid", action="store_true", help="also try a grid of tiles")
    ap.add_argument("--quick", action="store_true", help="a smaller grid of tiles (with --grid)")
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    a = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_us = graph_time(lambda i: big[: 1 << 29].copy_(big[1 << 29:]), 4, 5)
    print(json.dumps({"copy_GBps": round(2 * (1 << 29) / copy_us / 1e3, 1), "device": torch.cuda.get_device_name()}))
    del big
    block_ns = (16, 32, 64) if a.quick else (16, 32, 64, 128)
    block_ks = (128, 256, 512) if a.quick else (64, 128, 256, 512)
    grids = {"rows": list(itertools.product(block_ns, block_ks, (4, 8), (2, 3, 4) if not a.quick else (3, 4))),
             "row": list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (1,)))}
    best_rows = []
    for model in a.models:
        for name, n, k in SHAPES[model]:
            nbytes = n * k * 2
            copies = max(2, min(64, -(-(200 << 20) // nbytes)))
            ws = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
            for rows in a.rows:
                x = torch.randn(rows, k, device="cuda", dtype=dtype)
                out = torch.empty(rows, n, device="cuda", dtype=dtype)
                res = {"model": model, "product": name, "N": n, "K": k, "rows": rows, "MB": round(nbytes / 2**20, 1)}
                tiles = gemv.config(n, k, rows, dtype)
                cublas = graph_time(lambda i: torch.mm(x, ws[i].T, out=out), copies)
                default = graph_time(lambda i: gemv.launch(x, ws[i], None, out, None, *tiles), copies)
                ref = F.linear(x, ws[0]).float()
                gemv.launch(x, ws[0], None, out, None, *tiles)
                err = (out.float() - ref).abs().max().item()
                if name == "gate_up":
                    act = "gelu_pytorch_tanh" if model.startswith("gemma") else "silu"
                    half = out[:, : n // 2]
                    res["cublas_act_us"] = round(graph_time(
                        lambda i: fused.act_mul(torch.mm(x, ws[i].T, out=out), act), copies), 2)
                    res["gemv_act_us"] = round(graph_time(lambda i: gemv.launch(
                        x, ws[i], None, half, act, *gemv.config(n // 2, k, rows, dtype)), copies), 2)
                tried = [(default, tiles)]
                for bn, bk, warps, stages in grids["row" if rows == 1 else "rows"] if a.grid else []:
                    if bk > max(16, triton.next_power_of_2(k)):
                        continue
                    try:
                        us = graph_time(lambda i: gemv.launch(x, ws[i], None, out, None, bn, bk, warps, stages), copies)
                    except Exception as e:  # out of shared memory, say
                        print(json.dumps({**res, "tiles": [bn, bk, warps, stages], "error": str(e)[:120]}))
                        continue
                    tried.append((us, (bn, bk, warps, stages)))
                tried.sort()
                best_us, best = tried[0]
                line = {**res, "cublas_us": round(cublas, 2), "gemv_us": round(default, 2),
                        "gemv_tiles": list(tiles), "gemv_max_err": err,
                        "best_us": round(best_us, 2), "best_tiles": list(best),
                        "top5": [[round(u, 2), list(t)] for u, t in tried[:5]],
                        "cublas_GBps": round(nbytes / cublas / 1e3, 1), "best_GBps": round(nbytes / best_us / 1e3, 1)}
                print(json.dumps(line), flush=True)
                best_rows.append(line)
            del ws
    print(f"{'model':13} {'product':8} {'rows':>4} {'MB':>7} {'cuBLAS us':>9} {'gemv us':>8} {'best us':>8}  "
          f"{'+act: cuBLAS':>12} {'gemv':>6}  best tiles")
    for r in best_rows:
        print(f"{r['model']:13} {r['product']:8} {r['rows']:4} {r['MB']:7} {r['cublas_us']:9} {r['gemv_us']:8} "
              f"{r['best_us']:8}  {r.get('cublas_act_us', ''):>12} {r.get('gemv_act_us', ''):>6}  {r['best_tiles']}")


if __name__ == "__main__":
    main()
