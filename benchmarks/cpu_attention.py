"""The compiled CPU one-row step's attention (``pagedlm::decode_attention``):
alone against SDPA on SmolLM2's heads (9 query, 3 KV, 64 wide; token-major
views of a longer buffer, warm), then in the engine: ``torch.profiler`` over
the decode steps of SmolLM2 int4 compiled after a 64- and a 512-token
prompt (the op's microseconds a call there, keys read from memory).

    PYTHONPATH=. python benchmarks/cpu_attention.py [--no-step] [--avx2 [SOURCE]]

``--avx2``: also the op of the AVX2 build (``-mavx2 -mfma``, as the tests
build it) of ``SOURCE`` (default this tree's ``kernels/cpu_quant.cpp``; give
another tree's to compare), alone, as ``avx2_us``.
"""
import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from pagedlm import options as opt
from pagedlm.bench import decode as D
from pagedlm.bench.common import default_store
from pagedlm.kernels import cpu_quant
from pagedlm.loading import load


def alone(keys: int, calls: int = 2000, avx2=None) -> dict:
    k, v = (torch.randn(keys + 64, 3, 64)[:keys] for _ in range(2))
    q = torch.randn(1, 9, 64)
    runs = {"op": lambda: torch.ops.pagedlm.decode_attention(q, k, v, 0.125),
            **({"avx2": lambda: avx2(q, k, v, 0.125)} if avx2 is not None else {}),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], scale=0.125,
                enable_gqa=True)}
    row = {"keys": keys}
    for name, run in runs.items():
        for _ in range(50):
            run()
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        row[f"{name}_us"] = round((time.perf_counter() - t0) / calls * 1e6, 1)
    return row


def in_step() -> list[dict]:
    model, tok = load("smollm2-135m-instruct", quantization="int4")[:2]
    run = D._ours(model, tok, dataclasses.replace(default_store(opt.EngineOptions()), compile=True), 32)
    rows = []
    for n in (64, 512):
        ids = D.prompt_ids(tok, n)
        run(ids)
        with torch.profiler.profile() as prof:
            run(ids)
        op = next(e for e in prof.key_averages() if e.key == "pagedlm::decode_attention")
        rows.append({"prompt_len": n, "op_us_in_step": round(op.self_cpu_time_total / op.count, 1), "calls": op.count})
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-step", action="store_true")
    parser.add_argument("--avx2", nargs="?", const=str(cpu_quant.SOURCE), default=None)
    args = parser.parse_args()
    assert cpu_quant.library(), "the integer kernel library did not build here"
    avx2 = None
    if args.avx2 is not None:
        cpu_quant.SOURCE = Path(args.avx2)
        torch.ops.load_library(str(cpu_quant.build(("-O3", "-mavx2", "-mfma", "-DPAGEDLM_OPS=bench_avx2"))))
        avx2 = torch.ops.bench_avx2.decode_attention
    for keys in (64, 512, 2048):
        print(json.dumps(alone(keys, avx2=avx2)), flush=True)
    if not args.no_step:
        for row in in_step():
            print(json.dumps(row), flush=True)
