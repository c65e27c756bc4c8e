"""The multi-query paged kernel (``paged_prefill``) on the H200, against the
path it replaces (each row's blocks gathered, then SDPA alone, as
``TorchBackend`` does) and against SDPA's flash kernel on the same keys laid
out contiguously (what attention costs without paging: the ceiling), same
run, same inputs. Cases: whole prompts, a chunk after a long cached prefix,
verify-sized rows (5 queries) beside long contexts. Reports ms per layer and
TFLOP/s of the causal work (4 * H_q * D per query-key pair seen). Where
every row is a whole prompt without a window, also SDPA's flash kernel
alone (``flash_sdpa``: keys contiguous, the group's heads repeated, row by
row): what a dense causal kernel reaches on this chip.
Tile variants (``VARIANTS="BM,BN,W[,STAGES[,HEAVY]] ..."``) re-time the kernel
with other ``PREFILL_BLOCK_M``, ``PREFILL_BLOCK_N``, warps, pipeline stages
(``PREFILL_STAGES``) and tile order (``PREFILL_HEAVY_FIRST``: 1 or 0).

Usage (repository root, GPU machine): [SHAPES="qwen3-0.6b ..."] PYTHONPATH=. python3 benchmarks/gpu_prefill.py
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from pagedlm.kernels import paged_attention as pa

SHAPES = {"qwen3-0.6b": (16, 8, 128, None), "llama-3.1-8b": (32, 8, 128, None), "gemma3-270m": (4, 1, 256, 512)}
CASES = {  # name: (keys per row, queries per row)
    "prompts 8 x 1024": ([1024] * 8, [1024] * 8),
    "prompts 2 x 4096": ([4096] * 2, [4096] * 2),
    "chunk 2048 after 6144": ([8192], [2048]),
    "verify 64 x 5 at 1000": ([1000] * 64, [5] * 64),
}
BS = 16


def inputs(lengths, q_lens, hq, hkv, d, g):
    need = [-(-n // BS) for n in lengths]
    blocks = sum(need) + 8
    k_pool = torch.randn(blocks, BS, hkv, d, device="cuda", generator=g).bfloat16()
    v_pool = torch.randn_like(k_pool)
    order = torch.randperm(blocks, device="cuda", generator=g)
    tables = torch.full((len(lengths), max(need)), -1, dtype=torch.int32, device="cuda")
    at = 0
    for r, n in enumerate(need):
        tables[r, :n] = order[at : at + n].int()
        at += n
    q = torch.randn(sum(q_lens), hq, d, device="cuda", generator=g).bfloat16()
    starts = torch.tensor([0, *q_lens], device="cuda").cumsum(0).int()
    return q, k_pool, v_pool, tables, starts, torch.tensor(lengths, device="cuda", dtype=torch.int32)


def gather_sdpa(q, k_pool, v_pool, tables, starts_host, lengths, window, scale, contiguous=None):
    """Per row: its keys gathered from the blocks (or given contiguous), its causal mask, SDPA."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_pool.shape[2]
    for r, n in enumerate(lengths):
        a, b = starts_host[r], starts_host[r + 1]
        if contiguous is None:
            toks = torch.arange(n, device="cuda")
            slots = tables[r, toks // BS].long() * BS + toks % BS
            k = k_pool.view(-1, hkv, k_pool.shape[3])[slots]
            v = v_pool.view(-1, hkv, k_pool.shape[3])[slots]
        else:
            k, v = contiguous[r]
        qr = q[a:b].transpose(0, 1)[None]
        kr, vr = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if b - a == n and window is None:  # a whole prompt: SDPA's own causal flag (flash)
            o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=True)
        else:
            pos = torch.arange(n - (b - a), n, device="cuda")[:, None]
            j = torch.arange(n, device="cuda")[None, :]
            mask = (j <= pos) if window is None else (j <= pos) & (pos - j < window)
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1)
    return out


def flash_sdpa(q, contiguous, starts_host):
    """Each row (a whole prompt) through SDPA's flash kernel, its keys' heads repeated for the group."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = torch.empty_like(q)
    group = q.shape[1] // contiguous[0][0].shape[1]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        for r, (k, v) in enumerate(contiguous):
            a, b = starts_host[r], starts_host[r + 1]
            qr = q[a:b].transpose(0, 1)[None]
            kr, vr = (x.repeat_interleave(group, dim=1).transpose(0, 1)[None] for x in (k, v))
            out[a:b] = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)[0].transpose(0, 1)
    return out


def pairs(lengths, q_lens, window):
    total = 0
    for n, m in zip(lengths, q_lens):
        for i in range(m):
            p = n - m + i
            total += min(p + 1, window or p + 1)
    return total


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    variants = [tuple(int(x) for x in v.split(",")) for v in os.environ.get("VARIANTS", "").split()]
    knobs = ("PREFILL_BLOCK_M", "PREFILL_BLOCK_N", "PREFILL_WARPS", "PREFILL_STAGES", "PREFILL_HEAVY_FIRST")
    for shape, (hq, hkv, d, window) in SHAPES.items():
        if shape not in os.environ.get("SHAPES", shape).split():
            continue
        scale = d**-0.5
        for case, (lengths, q_lens) in CASES.items():
            q, kp, vp, tables, starts, seq_lens = inputs(lengths, q_lens, hq, hkv, d, g)
            starts_host = starts.tolist()
            contiguous = []
            for r, n in enumerate(lengths):
                toks = torch.arange(n, device="cuda")
                slots = tables[r, toks // BS].long() * BS + toks % BS
                contiguous.append((kp.view(-1, hkv, d)[slots].contiguous(), vp.view(-1, hkv, d)[slots].contiguous()))
            ref = gather_sdpa(q, kp, vp, tables, starts_host, lengths, window, scale)
            kernel = lambda: pa.paged_prefill(q, kp, vp, tables, starts, seq_lens, scale, max(q_lens), window)  # noqa: E731
            err = ((kernel().float() - ref.float()).norm() / ref.float().norm()).item()
            flops = 4 * hq * d * pairs(lengths, q_lens, window)
            row = {"shape": shape, "case": case, "tokens": sum(q_lens), "rel_err_vs_sdpa": round(err, 5)}
            timings = {"kernel": do_bench(kernel, warmup=10, rep=50),
                       "gather_sdpa": do_bench(lambda: gather_sdpa(q, kp, vp, tables, starts_host, lengths, window,
                                                                   scale), warmup=5, rep=30),
                       "contiguous_sdpa": do_bench(lambda: gather_sdpa(q, kp, vp, tables, starts_host, lengths,
                                                                       window, scale, contiguous), warmup=5, rep=30)}
            if window is None and lengths == q_lens:
                timings["flash_sdpa"] = do_bench(lambda: flash_sdpa(q, contiguous, starts_host), warmup=5, rep=30)
            saved = {k: getattr(pa, k) for k in knobs}
            row["defaults"] = ",".join(str(int(v)) for v in saved.values())
            for variant in variants:
                name = "kernel " + ",".join(map(str, variant))
                for knob, value in zip(knobs, variant):
                    setattr(pa, knob, bool(value) if knob == "PREFILL_HEAVY_FIRST" else value)
                pa.prefill_constants.cache_clear()  # the tile sizes are read there, and cached
                try:
                    err_v = ((kernel().float() - ref.float()).norm() / ref.float().norm()).item()
                    if err_v > 10 * max(err, 1e-3):
                        raise RuntimeError(f"relative error {err_v:.2e}")
                    timings[name] = do_bench(kernel, warmup=10, rep=50)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                    row[name] = f"{type(e).__name__}: {str(e)[:80]}"
                finally:
                    for knob, value in saved.items():
                        setattr(pa, knob, value)
                    pa.prefill_constants.cache_clear()
            for name, ms in timings.items():
                row[f"{name}_ms"] = round(ms, 4)
                row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
            row["kernel_vs_gather_sdpa"] = round(timings["gather_sdpa"] / timings["kernel"], 2)
            row["kernel_vs_contiguous_sdpa"] = round(timings["contiguous_sdpa"] / timings["kernel"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
