"""Weight-only quantization on one GPU: correctness, then batch-1 decode weight reads.

    PYTHONPATH=. python3 benchmarks/gpu_quant.py            # H200: ~2-4 minutes
    PYTHONPATH=. python3 benchmarks/gpu_quant.py --device cpu --tiny   # smoke test anywhere

Uses only ``pagedlm.kernels.quant`` (the quantized linear layer), not the
model forward. For the Qwen3-0.6B and Llama-3.1-8B shapes it builds random
weights (normal, std 0.02) of every linear layer of one decoder layer plus
the output head, quantizes them as the engine does, and times one token's
worth of products (every layer's q/k/v, o, gate/up, down, then the head),
in bf16, int8 and int4, interleaved round by round, under a CUDA graph when
on CUDA (so launch overhead is not what is measured). Attention over the KV
cache, norms and sampling are not included: the figure is the weight-read
part of a decode step, which dominates at batch 1.

Roofline: the quantized bytes each configuration reads per token divided by
a device-to-device copy bandwidth measured in the same run.

Correctness: each quantized product against ``x @ dequantize(W)^T`` in
float32, with the bound of tests/fast/test_quant.py (bf16 roundings), on
1 and 16 rows.

Prints one JSON line per (shape, mode) and a summary table.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedlm.kernels.quant import QuantizedWeight, dequantize, quantize

SHAPES = {
    # hidden, intermediate, q heads, kv heads, head dim, layers, vocab, tied
    "qwen3-0.6b": dict(d=1024, ff=3072, hq=16, hkv=8, hd=128, layers=28, vocab=151936, tied=True),
    "llama-3.1-8b": dict(d=4096, ff=14336, hq=32, hkv=8, hd=128, layers=32, vocab=128256, tied=False),
}
TINY = {"tiny": dict(d=256, ff=512, hq=4, hkv=2, hd=64, layers=2, vocab=4096, tied=True)}
KERNEL_REL = 4 * 2.0**-9


def layer_shapes(c: dict) -> list[tuple[str, int, int]]:
    """(name, out, in) of one decoder layer's fused projections."""
    qkv = (c["hq"] + 2 * c["hkv"]) * c["hd"]
    return [("qkv", qkv, c["d"]), ("o", c["d"], c["hq"] * c["hd"]),
            ("gate_up", 2 * c["ff"], c["d"]), ("down", c["d"], c["ff"])]


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (best of 5)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() / best


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(c: dict, mode: str, device: str, gen: torch.Generator):
    """Every layer's products (its own device copy of each weight, so the
    timed reads are the real per-token bytes; the float originals are shared
    across layers to keep setup short) and the head, as callables x -> y,
    plus the bytes they read and the float matrices."""
    mats = {name: torch.randn(n, k, generator=gen) * 0.02 for name, n, k in layer_shapes(c)}
    mats["head"] = torch.randn(c["vocab"], c["d"], generator=gen) * 0.02
    stored = {} if mode == "bf16" else {name: quantize(w, mode) for name, w in mats.items()}  # once
    nbytes = 0

    def make(name: str):
        nonlocal nbytes
        w = mats[name]
        if mode == "bf16":
            wd = w.to(device, torch.bfloat16)
            nbytes += wd.numel() * 2
            return lambda x: torch.nn.functional.linear(x, wd)
        qw = QuantizedWeight.from_stored(stored[name], tuple(w.shape), device)
        nbytes += qw.nbytes()
        return qw.linear

    ops = [[(k, make(name)) for name, _, k in layer_shapes(c)] for _ in range(c["layers"])]
    ops.append([(c["d"], make("head"))])
    return ops, nbytes, mats


def step_fn(ops, inputs: dict):
    """One token's products, in order; each reads a fixed input of its width."""

    def step() -> torch.Tensor:
        y = None
        for layer in ops:
            for k, op in layer:
                y = op(inputs[k])
        return y

    return step


def check(mats: dict, mode: str, device: str, gen: torch.Generator) -> dict:
    """Max error relative to the bf16 bound, over every matrix, 1 and 16 rows."""
    worst = 0.0
    for name, w in mats.items():
        stored = quantize(w, mode)
        qw = QuantizedWeight.from_stored(stored, tuple(w.shape), device)
        w_deq = dequantize(stored).to(device)
        for rows in (1, 16):
            x = torch.randn(rows, w.shape[1], generator=gen).to(device)
            y = qw.linear(x.to(torch.bfloat16)).float()
            ref = x.to(torch.bfloat16).float() @ w_deq.T
            bound = KERNEL_REL * (x.abs() @ w_deq.abs().T) + 1e-4
            worst = max(worst, ((y - ref).abs() / bound).max().item())
    return {"mode": mode, "worst_error_over_bound": round(worst, 4), "ok": worst <= 1.0}


def timed(step, device: str, iters: int) -> float:
    """Milliseconds per call; under a CUDA graph on CUDA."""
    if device.startswith("cuda"):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    else:
        run = step
        run()
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        run()
    sync(device)
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny shape only (smoke test)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = args.device
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth(device, 1 << 26 if args.tiny else 1 << 31)
    try:  # on CUDA, int8 falls back to dequantize + bf16 GEMM where torch has no int8 kernel
        torch._weight_int8pack_mm(torch.ones(1, 64, device=device, dtype=torch.bfloat16),
                                  torch.ones(64, 64, device=device, dtype=torch.int8),
                                  torch.ones(64, device=device, dtype=torch.bfloat16))
        int8_kernel = "torch._weight_int8pack_mm"
    except (RuntimeError, NotImplementedError):
        int8_kernel = "none on this device: int8 rows time dequantize + bf16 GEMM"
    print(json.dumps({"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                      "torch": torch.__version__, "copy_bandwidth_GBps": round(bw / 1e9, 1),
                      "int8_kernel": int8_kernel}), flush=True)
    summary = []
    for shape, c in (TINY if args.tiny else SHAPES).items():
        modes = {}
        mats = None
        widths = {k for _, _, k in layer_shapes(c)} | {c["d"]}
        inputs = {k: torch.randn(1, k, generator=gen).to(device, torch.bfloat16) for k in widths}
        for mode in ("bf16", "int8", "int4"):
            try:
                ops, nbytes, mats = build(c, mode, device, gen)
            except (RuntimeError, NotImplementedError) as e:
                print(json.dumps({"shape": shape, "mode": mode, "error": str(e).splitlines()[0]}), flush=True)
                continue
            modes[mode] = (step_fn(ops, inputs), nbytes)
        if mats is not None:
            for mode in ("int8", "int4"):
                try:
                    print(json.dumps({"shape": shape, **check(mats, mode, device, gen)}), flush=True)
                except (RuntimeError, NotImplementedError) as e:
                    print(json.dumps({"shape": shape, "mode": mode, "check_error": str(e).splitlines()[0]}), flush=True)
        times = {m: [] for m in modes}
        for _ in range(args.rounds):  # interleaved
            for mode, (step, _) in modes.items():
                times[mode].append(timed(step, device, args.iters))
        for mode, (_, nbytes) in modes.items():
            ms = sorted(times[mode])[len(times[mode]) // 2]
            roofline_ms = nbytes / bw * 1e3
            row = {"shape": shape, "mode": mode, "ms_per_token": round(ms, 4), "weight_bytes": nbytes,
                   "roofline_ms": round(roofline_ms, 4), "fraction_of_roofline": round(roofline_ms / ms, 3),
                   "speedup_vs_bf16": round(sorted(times["bf16"])[len(times["bf16"]) // 2] / ms, 3)
                   if "bf16" in times else None}
            print(json.dumps(row), flush=True)
            summary.append(row)
        del modes
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"\n{'shape':14s} {'mode':5s} {'ms/token':>9s} {'roofline':>9s} {'of roof':>8s} {'vs bf16':>8s}")
    for r in summary:
        print(f"{r['shape']:14s} {r['mode']:5s} {r['ms_per_token']:9.3f} {r['roofline_ms']:9.3f} "
              f"{r['fraction_of_roofline']:8.2f} {r['speedup_vs_bf16'] or 0:8.2f}")


if __name__ == "__main__":
    main()
