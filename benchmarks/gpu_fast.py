"""GPU fast path on the H200 (issue 9), in one process: the decode kernel's
achieved bandwidth against the copy bandwidth, and the decode throughput
curve over batch sizes, paged-fused (kernels + CUDA graphs) against the
default store, on the same random weights.

Usage (repository root, GPU machine):  PYTHONPATH=. python3 benchmarks/gpu_fast.py [--out DIR]
Needs torch and triton only. Prints a table last; JSON rows under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

from pagedlm.bench.common import load_random
from pagedlm.bench.decode import copy_bandwidth
from pagedlm.batch.engine import LLMEngine
from pagedlm.cache import kv_quant as kvq
from pagedlm.kernels import launch
from pagedlm.kernels import paged_attention as pa
from pagedlm.options import KV_QUANT_MODES, EngineOptions, PagedKvOptions
from pagedlm.params import SamplingParams

ROOT = Path(__file__).resolve().parent
SHAPES = {"llama-3.1-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "gemma3-270m": (4, 1, 256)}
TUNABLE = ("SPLIT", "SPLIT_MIN", "SHORT_SPLITS", "PROGRAMS_PER_SM", "MAX_PROGRAMS", "BLOCK_N", "STAGES", "STAGES_BUSY", "WARPS", "PAIRED_SCALES")  # --set NAME=VALUE overrides (a sweep)


TOKEN_MAJOR_SUFFIX = "-token-major"  # --kv fp8-token-major: 8-bit pools in the bf16 pools' layout
L2_PASS_BYTES = 512 << 20  # pools streamed per timed pass: ten times the H200's L2
CASES = ((1, 512), (1, 4096), (1, 32768), (8, 4096), (64, 2048), (256, 1024))


def kernel_rows(bandwidth: float, shapes=tuple(SHAPES), cases=CASES, formats=("none",)) -> list[dict]:
    """The decode kernel alone per shape, (batch, context) and KV format,
    replayed as a CUDA graph (as the engine runs it: no launch overhead) over
    enough copies of the pools that each pass streams them from HBM rather
    than the L2 (median of ``do_bench_cudagraph``, per call). Bytes are what
    a call must read: keys and values (8-bit codes plus a bf16 scale per
    token and head when quantized). A case ``(batch, context, True)`` gives
    its rows lengths spread evenly over [context / 8, 2 context - context /
    8] (mean ``context``, as the serving workload's rows are), in random order."""
    rows = []
    for shape in shapes:
        hq, hkv, d = SHAPES[shape]
        for batch, context, *varied in cases:
            bs = 16
            if varied and varied[0]:
                lo = context // 8
                lengths = torch.linspace(lo, 2 * context - lo, batch).long()[torch.randperm(batch)]
            else:
                lengths = torch.full((batch,), context)
            blocks_per_row = -(-int(lengths.max()) // bs)
            num_blocks = batch * blocks_per_row
            for fmt in formats:
                per_head = d * 2 if fmt == "none" else d + 2
                kv_bytes = 2 * int(lengths.sum()) * hkv * per_head
                calls = []
                for _ in range(max(1, -(-L2_PASS_BYTES // kv_bytes))):
                    k_pool = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
                    v_pool = torch.randn_like(k_pool)
                    if fmt == "none":
                        pools, scales = (k_pool, v_pool), None
                    elif fmt.endswith(TOKEN_MAJOR_SUFFIX):  # the 8-bit layout before head-major pools, for comparison
                        mode = fmt.removesuffix(TOKEN_MAJOR_SUFFIX)
                        (kq, ks), (vq, vs) = kvq.quantize(k_pool, mode), kvq.quantize(v_pool, mode)
                        pools, scales = (kq, vq), (ks, vs)
                    else:
                        (kq, ks), (vq, vs) = kvq.quantize_pools(k_pool, v_pool, fmt)
                        pools, scales = (kq, vq), (ks, vs)
                    del k_pool, v_pool
                    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_row)
                    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
                    calls.append((q, *pools, tables, lengths.cuda(), d**-0.5, None, scales))

                def run_all():
                    for args in calls:
                        pa.paged_decode(*args)

                torch.cuda.synchronize()  # the bench replays on its own stream: the pools must be written
                ms = triton.testing.do_bench_cudagraph(run_all, rep=200, return_mode="median") / len(calls)
                nbytes = kv_bytes + 2 * batch * hq * d * 2
                rows.append({"kind": "kernel", "shape": shape, "batch": batch, "context": context,
                             "lengths": "varied" if varied and varied[0] else "equal",
                             "block_size": bs, "kv": fmt, "ms": round(ms, 4), "gb_s": round(nbytes / ms / 1e6, 1),
                             "fraction_of_copy": round(nbytes / ms / 1e6 / (bandwidth / 1e9), 3),
                             "pool_copies": len(calls), "constants": {k: getattr(pa, k) for k in TUNABLE},
                             "pdl": launch.PDL})
                print(json.dumps(rows[-1]), flush=True)
                del calls
    for kernel in (pa._decode_split_kernel, pa._decode_merge_kernel):
        print(json.dumps({"kind": "resources", "kernel": kernel.fn.__name__, "compiled": resources(kernel)}),
              flush=True)
    return rows


def resources(kernel) -> list[dict]:
    """Registers, spills and shared memory of each variant of a Triton kernel compiled in this process."""
    out = []
    for cache in kernel.device_caches.values():
        for compiled in cache[0].values():
            meta = compiled.metadata
            out.append({"regs": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
                        "shared": getattr(meta, "shared", None), "warps": getattr(meta, "num_warps", None),
                        "stages": getattr(meta, "num_stages", None)})
    return out


def decode_tok_s(engine: LLMEngine, batch: int, prompt: int, gen: int, vocab: int) -> float:
    """Output tokens per second of ``batch`` rows decoding together (the
    prefill steps are not timed)."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    seqs = [s for _ in range(batch)
            for s in engine.add_request(torch.randint(0, vocab, (prompt,), generator=g).tolist(), params)]
    while any(len(s.output_ids) == 0 for s in seqs):
        engine.step()
    torch.cuda.synchronize()
    t0, before = time.perf_counter(), sum(len(s.output_ids) for s in seqs)
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return (sum(len(s.output_ids) for s in seqs) - before) / (time.perf_counter() - t0)


def curve_rows(config: str) -> list[dict]:
    model, tok = load_random(str(ROOT / "configs" / config), "cuda", torch.bfloat16)
    vocab = model.args.vocab_size
    stores = {
        "default": EngineOptions(kv_budget_bytes=16 << 30, max_model_len=4096),
        "paged-fused": EngineOptions(paged_kv=PagedKvOptions(16), kv_budget_bytes=16 << 30, max_model_len=4096,
                                     attention_backend="triton"),
    }
    engines = {name: LLMEngine(model, tok, o) for name, o in stores.items()}
    rows = []
    for batch in (1, 2, 8, 32, 128, 256):
        row = {"kind": "curve", "model": config, "batch": batch, "prompt": 256, "gen": 64}
        for name, engine in engines.items():
            decode_tok_s(engine, batch, 32, 4, vocab)  # warm-up
            row[f"{name}_tok_s"] = round(decode_tok_s(engine, batch, 256, 64, vocab), 1)
        row["fused_vs_default"] = round(row["paged-fused_tok_s"] / row["default_tok_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--skip", nargs="*", default=[], choices=["kernel", "curve"])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--cases", nargs="*", default=None, metavar="BATCHxCONTEXT",
                   help="e.g. 1x32768; 192x1024v: lengths varied around 1024 (default: CASES)")
    p.add_argument("--kv", nargs="*", default=["none"], help="KV formats of the kernel rows",
                   choices=[*KV_QUANT_MODES, *(m + TOKEN_MAJOR_SUFFIX for m in kvq.QMAX)])
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help=f"kernel constants: {', '.join(TUNABLE)}")
    p.add_argument("--no-pdl", action="store_true", help="plain launches (kernels.launch.PDL off)")
    args = p.parse_args()
    launch.PDL = not args.no_pdl
    for item in args.set:
        name, value = item.split("=")
        if name not in TUNABLE:
            p.error(f"--set: {name} is not one of {', '.join(TUNABLE)}")
        setattr(pa, name, int(value))
    cases = [(*(int(x) for x in c.removesuffix("v").split("x")), c.endswith("v")) for c in args.cases] \
        if args.cases else CASES
    bandwidth = copy_bandwidth("cuda")
    print(json.dumps({"kind": "copy", "gb_s": round(bandwidth / 1e9, 1),
                      "gpu": torch.cuda.get_device_name(0)}), flush=True)
    rows = []
    if "kernel" not in args.skip:
        rows += kernel_rows(bandwidth, args.shapes, cases, args.kv)
    if "curve" not in args.skip:
        rows += curve_rows("qwen3-0.6b")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "gpu_fast.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print("\ncopy bandwidth %.0f GB/s" % (bandwidth / 1e9))
    for r in rows:
        if r["kind"] == "kernel":
            print(f"kernel {r['shape']:14s} {r['kv']:16s} B={r['batch']:3d} ctx={r['context']:6d} {r['lengths']:6s} "
                  f"{r['ms']:8.4f} ms "
                  f"{r['gb_s']:7.0f} GB/s ({100 * r['fraction_of_copy']:.0f}% of copy)")
        else:
            print(f"curve B={r['batch']:3d} default {r['default_tok_s']:9.1f} tok/s  fused "
                  f"{r['paged-fused_tok_s']:9.1f} tok/s  x{r['fused_vs_default']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
