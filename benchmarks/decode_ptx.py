"""The decode kernel compiled for the H200 (sm_90) on any machine, no GPU
needed: counts of the PTX instructions that show how a KV tile travels
(global -> shared copies and their widths, byte loads from shared memory,
synchronous global loads, tensor-core loads), per pool format and memory
order, at the Llama-3.1-8B shape (GQA 4, D 128, blocks of 16).

Usage: python benchmarks/decode_ptx.py [--out DIR]   (needs triton; writes the PTX with --out)
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedlm.kernels import launch
from pagedlm.kernels import paged_attention as pa

CASES = {  # name: (pool type, values' token stride is 1 (head-major), 8-bit)
    "bf16 token-major": ("*bf16", False, False),
    "fp8 token-major": ("*fp8e4nv", False, True),
    "fp8 head-major": ("*fp8e4nv", True, True),
    "int8 token-major": ("*i8", False, True),
    "int8 head-major": ("*i8", True, True),
}
STRIDES = ("stride_qb", "stride_qh", "stride_tb", "stride_os", "stride_oh", "stride_ls", "stride_lh",
           "sk_block", "sk_tok", "sk_head", "sk_dim", "sv_block", "sv_tok", "sv_head", "sv_dim",
           "ss_block", "ss_tok", "ss_head")
PATTERN = re.compile(r"\b(cp\.async\.c[ag]\.shared\.global|ld\.shared\.[a-z0-9.]+|ld\.global\.[a-z0-9.]+|"
                     r"ldmatrix\.[a-z0-9.]+|mma\.[a-z0-9.]+|cvt\.[a-z0-9.]+)[^;]*;")


def compile_case(pool: str, head_major: bool, quant: bool):
    ones = {"sk_dim", "sv_tok", "ss_tok"} if head_major else {"sk_dim", "sv_dim", "ss_head"}
    run = 16 if head_major else 1
    # as paged_decode launches it at batch 1; strides of 1 are constants, as Triton specializes them
    consts = {**pa.decode_constants(torch.bfloat16, 4, 128, 16, quant, run, busy=False), **{n: 1 for n in ones},
              "PDL": bool(launch.PDL)}
    types = {"Q": "*bf16", "KPool": pool, "VPool": pool, "KScale": "*bf16", "VScale": "*bf16", "Tables": "*i32",
             "SeqLens": "*i32", "OutPart": "*fp32", "LsePart": "*fp32", "scale": "fp32", "window": "i32",
             "programs": "i32", **{n: "i32" for n in STRIDES}}
    names = pa._decode_split_kernel.arg_names
    signature = {n: "constexpr" if n in consts else types[n] for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)  # pointers, and strides of 16 or more
               if signature[n].startswith("*") or (signature[n] == "i32" and n in STRIDES and n != "stride_lh")}
    src = ASTSource(fn=pa._decode_split_kernel, signature=signature, attrs=aligned,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": pa.WARPS}).asm["ptx"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    for name, case in CASES.items():
        ptx = compile_case(*case)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / (name.replace(" ", "_") + ".ptx")).write_text(ptx)
        counts = collections.Counter()
        for m in PATTERN.finditer(ptx):
            width = re.search(r", (0x[0-9a-f]+)", m.group(0)) if m.group(1).startswith("cp.async") else None
            counts[m.group(1) + (f" {int(width.group(1), 16)}B" if width else "")] += 1
        print(f"{name} (triton {triton.__version__}, sm_90, static counts in the kernel):")
        for instr, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            if not instr.startswith("cvt"):
                print(f"  {n:5d} {instr}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
