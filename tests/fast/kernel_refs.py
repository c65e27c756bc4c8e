"""What the paged-attention kernels are checked against, and where their tests run.

The references are plain torch (the decode one in float64); production
code never calls them. Triton is in the test extra on Linux only
(pyproject: ``triton; platform_system == 'Linux'``): there the kernel tests
run (interpreted without CUDA), and a triton that fails to import fails
``test_paged_kernels.py::test_triton_imports_where_the_test_extra_installs_it``
instead of skipping every kernel test; elsewhere they are skipped.
"""

from __future__ import annotations

import platform

import pytest
import torch

TRITON_IN_TEST_EXTRA = platform.system() == "Linux"
requires_triton = pytest.mark.skipif(not TRITON_IN_TEST_EXTRA,
                                     reason="triton is in the test extra on Linux only")


def paged_decode_reference(q, k_pool, v_pool, block_tables, seq_lens, scale, window=None, keys=None) -> torch.Tensor:
    """What ``paged_decode`` computes, row by row in float64; ``keys`` (a
    bool per key of a one-row batch) keeps those keys only: a split's own
    softmax."""
    B, Hq, D = q.shape
    BS, Hkv = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty((B, Hq, D), dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        toks = torch.arange(n, device=q.device)
        slots = block_tables[b, toks // BS].long() * BS + toks % BS
        k = k_pool.reshape(-1, Hkv, D)[slots].double().repeat_interleave(Hq // Hkv, dim=1)
        v = v_pool.reshape(-1, Hkv, D)[slots].double().repeat_interleave(Hq // Hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        if window is not None:
            scores[:, toks < n - window] = float("-inf")
        if keys is not None:
            scores[:, ~keys.to(q.device)] = float("-inf")
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


def paged_prefill_reference(q, k_pool, v_pool, block_tables, query_start, seq_lens, scale,
                            window=None) -> torch.Tensor:
    """What ``paged_prefill`` computes, row by row in float64: row ``r``'s
    queries are its last positions, each sees the keys at or before it
    (and inside ``window``)."""
    T, Hq, D = q.shape
    BS, Hkv = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty((T, Hq, D), dtype=torch.float64, device=q.device)
    for r in range(len(seq_lens)):
        a, b, n = int(query_start[r]), int(query_start[r + 1]), int(seq_lens[r])
        toks = torch.arange(n, device=q.device)
        slots = block_tables[r, toks // BS].long() * BS + toks % BS
        k = k_pool.reshape(-1, Hkv, D)[slots].double().repeat_interleave(Hq // Hkv, dim=1)
        v = v_pool.reshape(-1, Hkv, D)[slots].double().repeat_interleave(Hq // Hkv, dim=1)
        pos = torch.arange(n - (b - a), n, device=q.device)
        scores = torch.einsum("thd,nhd->htn", q[a:b].double(), k) * scale
        seen = toks[None, :] <= pos[:, None]
        if window is not None:
            seen &= pos[:, None] - toks[None, :] < window
        scores = scores.masked_fill(~seen, float("-inf"))
        out[a:b] = torch.einsum("htn,nhd->thd", scores.softmax(-1), v)
    return out


def write_kv_reference(keys, values, k_pool, v_pool, slot_mapping) -> None:
    """What ``write_kv`` does (unquantized), in torch."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_pool.view(-1, *k_pool.shape[2:])[slots] = keys[keep]
    v_pool.view(-1, *v_pool.shape[2:])[slots] = values[keep]
