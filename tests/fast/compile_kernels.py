"""Compile every Triton kernel of the CUDA path for sm_90 (the H100/H200) on
this machine, no GPU needed, with the argument types the engine launches
them with (int64 block tables, lengths and slots; bf16 and 8-bit pools).
The CPU interpreter the other kernel tests use does not type-check: a
kernel that the GPU's compiler refuses (an int32 loop-carried total given
int64 lengths, 2026-12-04) passes there. `test_kernels_compile.py` runs
this in a process of its own, since the interpreter's setting is read when
the kernels are defined.

Each compiled kernel waits on the kernel before (`kernels.launch.await_inputs`)
before it stores anything or reads what a kernel wrote (`waits_first`).

Usage: TRITON_INTERPRET=0 python -m tests.fast.compile_kernels  (prints one line per kernel; exit 1 on a failure)
"""

from __future__ import annotations

import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedlm.kernels import fused, gemv
from pagedlm.kernels import paged_attention as pa

TARGET = GPUTarget("cuda", 90, 32)
FLOATS = {"scale", "eps"}


def compile_sm90(fn, types: dict[str, str], consts: dict[str, object], num_warps: int = 4) -> str:
    """Compile ``fn`` for sm_90: ``types`` names its pointers' element types;
    other arguments are int32 (floats: ``FLOATS``), ``consts`` its constants,
    and PDL on (a programmatic dependent launch: what the H100/H200 run)."""
    names = fn.arg_names
    consts = {**consts, "PDL": True}
    signature = {n: "constexpr" if n in consts else types.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "launch_pdl": True}).asm["ptx"]


def waits_first(ptx: str, weights_first: bool) -> str | None:
    """What a programmatic dependent launch makes unsafe in ``ptx``: a global
    store or atomic before its first ``griddepcontrol.wait`` (or no wait),
    or a global load before it unless ``weights_first`` (the one-row
    product reads its first weight tile early: no kernel writes weights)."""
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next((i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")), None)
    if wait is None:
        return "no griddepcontrol.wait"
    early = [line for line in lines[:wait] if re.search(r"\b(st|atom|red)\.global", line)
             or (not weights_first and re.search(r"\b(ld|cp\.async)\.\S*global", line))]
    return f"before the wait: {early[0]}" if early else None


def cases():
    """(name, kernel, pointer types, constants, warps) as the engine launches them."""
    i64 = "*i64"
    for pool, quant, run in (("*bf16", False, 1), ("*fp8e4nv", True, 16), ("*i8", True, 16)):
        for busy in (False, True):
            consts = pa.decode_constants(torch.bfloat16, 2, 128, 16, quant, run, busy=busy)
            yield (f"decode split, {pool[1:]} pool, busy={busy}", pa._decode_split_kernel,
                   {"Q": "*bf16", "KPool": pool, "VPool": pool, "KScale": "*bf16", "VScale": "*bf16",
                    "Tables": i64, "SeqLens": i64, "OutPart": "*fp32", "LsePart": "*fp32"}, consts, pa.WARPS)
    yield ("decode merge", pa._decode_merge_kernel,
           {"OutPart": "*fp32", "LsePart": "*fp32", "Out": "*bf16", "SeqLens": i64},
           dict(D=128, **pa.split_constants(), CHUNK=pa.MERGE_CHUNK, ROWS=pa.ROWS_CHUNK), 4)
    for pool, quant in (("*bf16", False), ("*i8", True)):
        for queries, heavy in ((5, False), (1024, False), (1024, True)):
            consts = {**pa.prefill_constants(torch.bfloat16, 2, 128, 16, quant, queries), "HEAVY_FIRST": heavy}
            warps = pa.PREFILL_WARPS if consts["BLOCK_Q"] * consts["G_PAD"] >= 64 else pa.WARPS
            yield (f"prefill, {pool[1:]} pool, {queries} queries, heavy first={heavy}", pa._prefill_kernel,
                   {"Q": "*bf16", "KPool": pool, "VPool": pool, "KScale": "*bf16", "VScale": "*bf16",
                    "Tables": i64, "QueryStart": "*i32", "SeqLens": i64, "Out": "*bf16"}, consts, warps)
    for pool, fmt in (("*bf16", "none"), ("*i8", "int8"), ("*fp8e4nv", "fp8")):
        yield (f"write_kv, {fmt}", pa._write_kv_kernel,
               {"K": "*bf16", "V": "*bf16", "KPool": pool, "VPool": pool, "KScale": "*bf16", "VScale": "*bf16",
                "Slots": i64}, dict(H=8, D=128, BS=16, H_PAD=8, QMAX=127.0 if fmt != "none" else 0.0,
                                    INT8=fmt == "int8"), 4)
    bf16 = "*bf16"
    for unit in (False, True):
        for pre, add, norm in ((False, False, True), (False, True, True), (True, True, True), (True, True, False)):
            yield (f"rms_norm, pre={pre}, add={add}, norm={norm}, unit_offset={unit}", fused._rms_norm_kernel,
                   {"X": bf16, "R": bf16, "W0": bf16, "W": bf16, "Out": bf16, "Sum": bf16},
                   dict(PRE=pre, ADD=add, NORM=norm, UNIT_OFFSET=unit, BLOCK=1024), 4)
    for norm in (False, True):
        for pool, fmt in ((None, "none"), ("*bf16", "none"), ("*i8", "int8"), ("*fp8e4nv", "fp8")):
            tensors = {n: bf16 for n in ("X", "W", "W2", "Cos", "Sin", "Out", "Out2", "V", "KScale", "VScale")}
            yield (f"norm_rope, norm={norm}, pools={pool and pool[1:]}", fused._norm_rope_kernel,
                   {**tensors, "KPool": pool or bf16, "VPool": pool or bf16, "Slots": i64},
                   dict(NORM=norm, UNIT_OFFSET=False, D=128, WRITE=pool is not None, BS=16,
                        QMAX=127.0 if fmt != "none" else 0.0, INT8=fmt == "int8"), 4)
    yield ("act_mul", fused._act_mul_kernel, {"X": bf16, "Out": bf16}, dict(GELU=False, BLOCK=1024), 4)
    for dtype, act, bias, even in (("bf16", 0, False, True), ("bf16", 1, True, False), ("bf16", 2, False, True),
                                   ("fp32", 0, True, True)):
        types = {n: f"*{dtype}" for n in ("X", "W", "B", "Out")}
        for rows in (1, 16):
            block_n, block_k, warps, _ = gemv.config(4096, 1024, rows, torch.float32 if dtype == "fp32" else torch.bfloat16)
            consts = dict(ACT=act, HAS_BIAS=bias, BLOCK_N=block_n, BLOCK_K=block_k, EVEN=even)
            kernel = gemv._row_kernel if rows == 1 else gemv._rows_kernel
            yield (f"gemv, {rows} rows, {dtype}, act={act}, bias={bias}, even={even}", kernel, types,
                   consts if rows == 1 else {**consts, "IEEE": dtype == "fp32", "ROWS": gemv.ROWS}, warps)


def main() -> int:
    failed = 0
    for name, fn, types, consts, warps in cases():
        try:
            unsafe = waits_first(compile_sm90(fn, types, consts, warps), fn is gemv._row_kernel)
            if unsafe:
                raise RuntimeError(f"PDL: {unsafe}")
            print(f"ok {name}")
        except Exception as e:  # the compiler's error, reported by kernel
            failed += 1
            cause = e.__cause__ or e
            print(f"FAILED {name}: {type(cause).__name__}: {str(cause).strip()[-300:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
