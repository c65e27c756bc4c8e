"""Triton kernels over the paged pools.

    write_kv(keys, values, k_pool, v_pool, slot_mapping)            # one launch per layer
    paged_decode(q, k_pool, v_pool, block_tables, seq_lens, scale)  # one query per row

Their float64 and torch references are the tests' (``tests/fast/kernel_refs.py``).

The pools are ``[num_blocks, block_size, H_kv, D]`` (``cache.paged``); a
row's token ``j`` lives at block ``table[j // block_size]``, offset ``j %
block_size``. The kernels compute that address per token (by slot for
token-major pools, whose keys and values share strides; by element strides
for head-major 8-bit ones, values tokens innermost: ``cache.kv_quant``), so
the block size only changes where rows come from, never the tiling.

Decode is split-K ("flash-decoding"): a row's keys are cut into splits at
fixed boundaries (0, size, 2*size, ...), the size picked from the row's own
length (``split_len``: the shortest of SPLIT_MIN, 2*SPLIT_MIN, ..., SPLIT
that cuts it into at most SHORT_SPLITS; SPLIT past that), so a short row
is shared out over as many programs as a long one, and each
split's softmax-weighted sum is computed on its own, for every query head
of the KV group at once (the keys are read once per group, not once per
query head), and written as its own partial with its log-sum-exp; a second
kernel merges a row's partials in split order. The partials lie in one flat
buffer, row after row (a row's first split after every split of the rows
before it, ``splits_before``), so the buffer holds the step's splits, not
rows x the longest context: ``decode_partials`` sizes it. The grid is (row, KV head,
programs): program ``z`` takes splits ``z, z + programs, ...``. Nothing a
split computes depends on which program took it, so the program count can
follow the batch size (many per row when the batch is small, one when the
GPU is full: ``decode_programs``) while a row's output stays the same,
bit for bit, whatever its neighbours in the batch; and the grid depends on
the batch size and the heads only, so one CUDA graph serves every length.
Scores and the running softmax are float32; the probabilities meet the
values in the values' dtype, as flash attention does.
A sliding-window layer passes ``window``: keys older than ``seq_len -
window`` are skipped (the query at position ``p`` sees ``p - j < window``).

Every kernel here launches as ``kernels.launch`` says (on Hopper, as a
programmatic dependent of the kernel before it).

Triton is optional: without it (a CPU-only install) the module still
imports, ``available()`` is False and the engine uses the torch path.
Under ``TRITON_INTERPRET=1`` the kernels run on the CPU (the tests do this).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from pagedlm.kernels.launch import launch_options

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the reference path serves
    triton = None

SPLIT = 256  # keys per decode split at most, each its own partial (a row's length alone sets its splits,
SPLIT_MIN = 64  # ... at least (a tile, BLOCK_N)                   so a row's result ignores its neighbours)
SHORT_SPLITS = 8  # a row is cut into at most this many splits while they can be shorter than SPLIT
PROGRAMS_PER_SM = 4  # decode_programs: how full the grid is made
MAX_PROGRAMS = 128  # programs per (row, KV head) at most; program z takes splits z, z + programs, ...
MERGE_CHUNK = 32  # splits the merge reads at a time
ROWS_CHUNK = 256  # rows' lengths a program sums at a time to find its row's first partial
BLOCK_N = 64  # keys per tile inside a split
STAGES = 3  # pipeline stages of the tile loop: 8-bit pools, and bf16 ones while rows x KV heads < SMs
STAGES_BUSY = 2  # bf16 pools otherwise (stages change timing, never results)
WARPS = 4  # warps per decode program
PAIRED_SCALES = 1  # 8-bit head-major pools: scales load as 32-bit pairs (asynchronously)
NO_WINDOW = 2**31 - 1  # int32: seq_len - NO_WINDOW never overflows
MIN_DOT = 16  # tl.dot's smallest operand side: query heads of a group pad up to it
PREFILL_BLOCK_M = 128  # multi-query kernel: queries x group heads a tile, at most, for 256-byte query rows
PREFILL_BLOCK_N = 128  # ... and keys a tile (both halved per doubling of a row's bytes: shared memory)
PREFILL_WARPS = 8  # warps of a multi-query program whose tile has 64 rows or more
PREFILL_STAGES = 3  # pipeline stages of its key-tile loops (Triton's default)
PREFILL_HEAVY_FIRST = False  # programs take the tiles last to first: a row's last tiles (the most keys) start first
SHORT_QUERIES = 16  # a step whose rows have at most this many queries (verify rows) takes short tiles


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run for tensors on ``device``."""
    if triton is None:
        return False
    if torch.device(device).type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


# -- the key/value write -----------------------------------------------------

if triton is not None:
    from pagedlm.kernels.launch import await_inputs

    @triton.jit
    def _write_kv_kernel(K, V, KPool, VPool, KScale, VScale, Slots, stride_k, stride_v,
                         sk_block, sk_tok, sk_head, sk_dim, sv_block, sv_tok, sv_head, sv_dim, ss_block, ss_tok, ss_head,
                         H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, H_PAD: tl.constexpr, QMAX: tl.constexpr,
                         INT8: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        t = tl.program_id(0)
        slot = tl.load(Slots + t).to(tl.int64)
        if slot >= 0:  # -1: a padded row under a CUDA graph writes nothing
            block, off = slot // BS, slot % BS
            h = tl.arange(0, H_PAD)
            d = tl.arange(0, D)
            src = h[:, None] * D + d[None, :]
            hm = h < H
            s_at = block * ss_block + off * ss_tok + h * ss_head
            k_at = block * sk_block + off * sk_tok + h[:, None] * sk_head + d[None, :] * sk_dim
            v_at = block * sv_block + off * sv_tok + h[:, None] * sv_head + d[None, :] * sv_dim
            _write_rows(K + t * stride_k + src, KPool + k_at, KScale + s_at, hm, QMAX, INT8)
            _write_rows(V + t * stride_v + src, VPool + v_at, VScale + s_at, hm, QMAX, INT8)

    @triton.jit
    def _to_bfloat16(x):
        """float32 rounded to the nearest bfloat16 (ties to even), as float32.
        By bits: Triton's interpreter truncates in ``.to(tl.bfloat16)``."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _write_rows(src, dst, scale_dst, hm, QMAX: tl.constexpr, INT8: tl.constexpr):
        """One token's heads ``[H, D]``: copied, or (QMAX > 0) quantized as
        ``cache.kv_quant.quantize`` does (`_kv_scale`, `_kv_codes`)."""
        m = hm[:, None]
        x = tl.load(src, mask=m, other=0.0)
        if QMAX == 0:
            tl.store(dst, x, mask=m)
        else:
            x = x.to(tl.float32)
            scale = _kv_scale(tl.max(tl.abs(x), 1), QMAX)
            tl.store(dst, _kv_codes(x, scale[:, None], QMAX, INT8).to(dst.dtype.element_ty), mask=m)
            tl.store(scale_dst, scale.to(scale_dst.dtype.element_ty), mask=hm)

    @triton.jit
    def write_head(x, dst, scale_dst, QMAX: tl.constexpr, INT8: tl.constexpr):
        """One head's ``[D]`` values ``x`` (in the pool's dtype when QMAX is 0)
        stored at ``dst``, or quantized as `_write_rows` quantizes a head,
        its scale at ``scale_dst``: a fused kernel's write of a key or value."""
        if QMAX == 0:
            tl.store(dst, x)
        else:
            x = x.to(tl.float32)
            scale = _kv_scale(tl.max(tl.abs(x), 0), QMAX)
            tl.store(dst, _kv_codes(x, scale, QMAX, INT8).to(dst.dtype.element_ty))
            tl.store(scale_dst, scale.to(scale_dst.dtype.element_ty))

    @triton.jit
    def _kv_scale(amax, QMAX: tl.constexpr):
        """A head's scale from its largest magnitude: bfloat16, 1 for an all-zero head."""
        scale = _to_bfloat16(tl.math.div_rn(amax, QMAX))
        return tl.where(scale > 0, scale, 1.0)

    @triton.jit
    def _kv_codes(x, scale, QMAX: tl.constexpr, INT8: tl.constexpr):
        """float32 ``x`` over its head's ``scale``, clamped to +-QMAX (INT8:
        rounded half to even; else left for the e4m3 cast to round)."""
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        if INT8:
            r = tl.floor(y + 0.5)
            tie_to_odd = ((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
            return tl.where(tie_to_odd, r - 1.0, r)
        return y

    @triton.jit
    def _split_len(seq_len, SPLIT: tl.constexpr, SPLIT_MIN: tl.constexpr, SHORT: tl.constexpr):
        """Keys per split of a row of ``seq_len`` keys (elementwise): ``split_len``'s rule."""
        size = seq_len * 0 + SPLIT_MIN
        for _ in tl.static_range(8):  # doublings: SPLIT // SPLIT_MIN is at most 2^8
            size = tl.where((size < SPLIT) & (seq_len > size * SHORT), size * 2, size)
        return size

    @triton.jit
    def _splits_before(SeqLens, b, SPLIT: tl.constexpr, SPLIT_MIN: tl.constexpr, SHORT: tl.constexpr,
                       ROWS: tl.constexpr):
        """Splits of the rows before row ``b``: where its partials start."""
        total = 0
        for c in range(0, b, ROWS):
            rows = c + tl.arange(0, ROWS)
            lens = tl.load(SeqLens + rows, mask=rows < b, other=0).to(tl.int32)  # int64 lengths: keep int32
            total += tl.sum(tl.cdiv(lens, _split_len(lens, SPLIT, SPLIT_MIN, SHORT)))
        return total

    # Not specialized on what changes between eager steps (the table's width, the program
    # count: 1 or more), so that a run compiles the kernel once per layout, never mid-run.
    @triton.jit(do_not_specialize=["stride_tb", "scale", "window", "programs"])
    def _decode_split_kernel(
        Q, KPool, VPool, KScale, VScale, Tables, SeqLens, OutPart, LsePart,
        stride_qb, stride_qh, stride_tb, stride_os, stride_oh, stride_ls, stride_lh,
        sk_block, sk_tok, sk_head, sk_dim, sv_block, sv_tok, sv_head, sv_dim, ss_block, ss_tok, ss_head,
        scale, window, programs,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
        SPLIT: tl.constexpr, SPLIT_MIN: tl.constexpr, SHORT: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr, QUANT: tl.constexpr, STAGES: tl.constexpr, F16_DOT: tl.constexpr,
        F16_SHIFT: tl.constexpr, RUN: tl.constexpr, PAIRED_SCALES: tl.constexpr, ROWS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        z = tl.program_id(2)
        # int32: int64 lengths (the engine's) make every token index and mask
        # int64 (168 registers a thread for 8-bit pools instead of 128)
        seq_len = tl.load(SeqLens + b).to(tl.int32)
        base = _splits_before(SeqLens, b, SPLIT, SPLIT_MIN, SHORT, ROWS)
        size = _split_len(seq_len, SPLIT, SPLIT_MIN, SHORT)
        lo = tl.maximum(seq_len - window, 0)
        # This program's splits: z, z + programs, ... from the first in the window.
        s_begin = z + tl.cdiv(tl.maximum(lo // size - z, 0), programs) * programs

        g = tl.arange(0, G_PAD)
        gmask = g < G
        heads = kvh * G + g
        d = tl.arange(0, D)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        # 8-bit codes become the products' operands: float16 ones for a bf16
        # query (e4m3 -> f16 is one instruction, -> bf16 several), the query
        # scaled by 2^-8 into float16's range and the scores by 2^8 back.
        DOT_T = tl.float16 if F16_DOT else Q.dtype.element_ty
        if F16_DOT:
            q = (q.to(tl.float32) * (1.0 / F16_SHIFT)).to(tl.float16)
            scale = scale * F16_SHIFT
        for s in range(s_begin, tl.cdiv(seq_len, size), programs):
            # Each split its own softmax, written as its own partial: no
            # state crosses splits, so the program count never shows.
            m_i = tl.full([G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D], tl.float32)
            if QUANT:
                # 8-bit pools: the split's block numbers read before its tiles.
                # A key address waiting on a load inside the tile loop leaves
                # the pipeliner one buffer (no tile's copy overlaps another's
                # math); read ahead, tiles are double-buffered. bf16 pools keep
                # the in-loop read: one buffer, but fewer registers, which
                # measured faster for them when the GPU is full.
                first_block = (s * size) // BS
                blocks = first_block + tl.arange(0, (SPLIT + BS - 1) // BS)
                inside = (blocks * BS < tl.minimum(seq_len, (s + 1) * size)) & ((blocks + 1) * BS > lo)
                split_table = tl.load(Tables + b * stride_tb + blocks, mask=inside, other=0)
            for t in tl.range(0, size // BLOCK_N, num_stages=STAGES):
                toks = s * size + t * BLOCK_N + tl.arange(0, BLOCK_N)
                tmask = (toks < seq_len) & (toks >= lo)
                if RUN > 1:
                    # Head-major (8-bit): loads masked by whole blocks (a block
                    # holding any key of the row is read whole; its other
                    # slots hold finite values whose scores are masked), so a
                    # block's run of tokens stays one wide load.
                    first = (toks // BS) * BS
                    bmask = (first < seq_len) & (first + BS > lo)
                else:
                    bmask = tmask
                if QUANT:
                    block = tl.gather(split_table, toks // BS - first_block, 0).to(tl.int64)
                else:
                    block = tl.load(Tables + b * stride_tb + toks // BS, mask=bmask, other=0).to(tl.int64)
                off = toks % BS
                if RUN > 1:  # element strides; a block's tokens lie next to each other (sv_tok == 1)
                    k_at = (block * sk_block + off * sk_tok + kvh * sk_head)[:, None] + d[None, :] * sk_dim
                    v_rows = tl.max_contiguous(tl.multiple_of(block * sv_block + off + kvh * sv_head, RUN), RUN)
                    v_at = v_rows[:, None] + d[None, :] * sv_dim
                else:  # token-major: one slot address serves keys and values (their strides are equal)
                    k_at = (block * BS + off)[:, None] * sk_tok + kvh * sk_head + d[None, :]
                    v_at = k_at
                k = tl.load(KPool + k_at, mask=bmask[:, None], other=0.0).to(DOT_T)
                qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                if QUANT:  # 8-bit codes are exact in float16; a key's scale multiplies its scores
                    s_at = block * ss_block + off * ss_tok + kvh * ss_head
                    if PAIRED_SCALES:
                        k_scale, v_scale = _scale_pairs(KScale, VScale, s_at, bmask, BLOCK_N, RUN)
                    else:
                        k_scale = tl.load(KScale + s_at, mask=bmask, other=0.0).to(tl.float32)
                        v_scale = tl.load(VScale + s_at, mask=bmask, other=0.0).to(tl.float32)
                    qk = qk * k_scale
                qk = tl.where(tmask[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                # A tile wholly past the row or before the window (m_new still -inf) adds nothing.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(qk - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(VPool + v_at, mask=bmask[:, None], other=0.0).to(DOT_T)
                pv = p
                if QUANT:  # ... and a value's scale its probability
                    pv = p * v_scale
                acc = acc * alpha[:, None] + tl.dot(pv.to(DOT_T), v, input_precision=PRECISION)
                m_i = m_new
            # A split in [lo // size, cdiv(seq_len, size)) holds a key: l_i > 0.
            tl.store(OutPart + (base + s) * stride_os + heads[:, None] * stride_oh + d[None, :],
                     acc / l_i[:, None], mask=gmask[:, None])
            tl.store(LsePart + (base + s) * stride_ls + heads * stride_lh, m_i + tl.log(l_i), mask=gmask)

    @triton.jit
    def _scale_pairs(KScale, VScale, s_at, bmask, BLOCK_N: tl.constexpr, RUN: tl.constexpr):
        """A tile's bfloat16 key and value scales (adjacent in runs of RUN, a
        run starting at an even element), loaded as 32-bit words of two: a
        word is the narrowest load the pipeliner copies asynchronously."""
        even, _ = tl.split(tl.reshape(s_at, [BLOCK_N // 2, 2]))
        keep, _ = tl.split(tl.reshape(bmask, [BLOCK_N // 2, 2]))
        words = tl.max_contiguous(tl.multiple_of(even // 2, RUN // 2), RUN // 2)
        kw = tl.load(KScale.to(tl.pointer_type(tl.int32)) + words, mask=keep, other=0)
        vw = tl.load(VScale.to(tl.pointer_type(tl.int32)) + words, mask=keep, other=0)
        # bfloat16 is float32's upper half: the low element shifted up, the high one masked.
        k = tl.interleave((kw << 16).to(tl.float32, bitcast=True), (kw & -65536).to(tl.float32, bitcast=True))
        v = tl.interleave((vw << 16).to(tl.float32, bitcast=True), (vw & -65536).to(tl.float32, bitcast=True))
        return k, v

    @triton.jit
    def _decode_merge_kernel(
        OutPart, LsePart, Out, SeqLens,
        stride_ps, stride_ph, stride_ls, stride_lh, stride_ob, stride_oh, window,
        D: tl.constexpr, SPLIT: tl.constexpr, SPLIT_MIN: tl.constexpr, SHORT: tl.constexpr,
        CHUNK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
    ):
        """A row's split partials, merged in split order, CHUNK at a time."""
        await_inputs(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        seq_len = tl.load(SeqLens + b).to(tl.int32)
        base = _splits_before(SeqLens, b, SPLIT, SPLIT_MIN, SHORT, ROWS)
        size = _split_len(seq_len, SPLIT, SPLIT_MIN, SHORT)
        first = tl.maximum(seq_len - window, 0) // size
        d = tl.arange(0, D)
        m = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for c in range(first, tl.cdiv(seq_len, size), CHUNK):
            splits = c + tl.arange(0, CHUNK)
            smask = splits < tl.cdiv(seq_len, size)
            lse = tl.load(LsePart + (base + splits) * stride_ls + h * stride_lh, mask=smask, other=float("-inf"))
            part = tl.load(OutPart + (base + splits)[:, None] * stride_ps + h * stride_ph + d[None, :],
                           mask=smask[:, None], other=0.0)
            m_new = tl.maximum(m, tl.max(lse, 0))  # finite: the first chunk holds a split
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            total = total * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(part * w[:, None], 0)
            m = m_new
        tl.store(Out + b * stride_ob + h * stride_oh + d, (acc / total).to(Out.dtype.element_ty))


    @triton.jit
    def _row_of_tile(QueryStart, num_rows, tile, BLOCK_Q: tl.constexpr):
        """The row whose query tiles hold ``tile``: row ``r``'s tiles start at
        ``QueryStart[r] // BLOCK_Q + r`` (at least as many as it needs), so
        the last row whose start is at most ``tile``, by bisection."""
        lo = 0
        hi = num_rows
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(QueryStart + mid) // BLOCK_Q + mid <= tile:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    # What changes from step to step (the table's width, the row count, ...)
    # is not specialized on, so that a run compiles the kernel once per tile size.
    @triton.jit(do_not_specialize=["stride_tb", "scale", "window", "num_rows", "min_queries"])
    def _prefill_kernel(
        Q, KPool, VPool, KScale, VScale, Tables, QueryStart, SeqLens, Out,
        stride_qt, stride_qh, stride_tb, stride_ot, stride_oh,
        sk_block, sk_tok, sk_head, sk_dim, sv_block, sv_tok, sv_head, sv_dim, ss_block, ss_tok, ss_head,
        scale, window, num_rows, min_queries,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr, HEAVY_FIRST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        tile = tl.num_programs(0) - 1 - tl.program_id(0) if HEAVY_FIRST else tl.program_id(0)
        kvh = tl.program_id(1)
        r = _row_of_tile(QueryStart, num_rows, tile, BLOCK_Q)
        q_begin = tl.load(QueryStart + r)
        q_len = tl.load(QueryStart + r + 1) - q_begin
        q0 = (tile - (q_begin // BLOCK_Q + r)) * BLOCK_Q  # this tile's first query in its row
        if q0 < q_len and q_len >= min_queries:
            seq_len = tl.load(SeqLens + r).to(tl.int32)
            ctx = seq_len - q_len  # keys before the row's first query
            # M = BLOCK_Q queries x G_PAD heads of the group: row m is query m // G_PAD, head m % G_PAD.
            m = tl.arange(0, BLOCK_Q * G_PAD)
            qi = q0 + m // G_PAD
            g = m % G_PAD
            mmask = (qi < q_len) & (g < G)
            pos = ctx + qi
            d = tl.arange(0, D)
            heads = kvh * G + g
            q_at = (q_begin + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
            q = tl.load(Q + q_at, mask=mmask[:, None], other=0.0)
            last = ctx + tl.minimum(q0 + BLOCK_Q, q_len)  # one past the tile's last query position
            lo = tl.maximum(ctx + q0 - window + 1, 0)  # the first key any of its queries sees
            # Key tiles every query of the tile sees whole (past the window's
            # edge for the last query, before the first query's diagonal)
            # skip the mask; the tiles before and after them apply it.
            full_lo = tl.cdiv(tl.maximum(last - window, 0), BLOCK_N) * BLOCK_N
            full_hi = tl.maximum((ctx + q0 + 1) // BLOCK_N * BLOCK_N, full_lo)
            first = lo // BLOCK_N * BLOCK_N
            m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
            acc = tl.zeros([BLOCK_Q * G_PAD, D], tl.float32)
            row_table = Tables + r * stride_tb
            for start in range(first, tl.minimum(full_lo, last), BLOCK_N):
                m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, start, lo, last, pos, window, row_table, KPool, VPool,
                                              KScale, VScale, kvh, d, scale, sk_block, sk_tok, sk_head, sk_dim,
                                              sv_block, sv_tok, sv_head, sv_dim, ss_block, ss_tok, ss_head,
                                              BS, BLOCK_N, PRECISION, QUANT, True)
            for start in range(tl.maximum(full_lo, first), full_hi, BLOCK_N):
                m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, start, lo, last, pos, window, row_table, KPool, VPool,
                                              KScale, VScale, kvh, d, scale, sk_block, sk_tok, sk_head, sk_dim,
                                              sv_block, sv_tok, sv_head, sv_dim, ss_block, ss_tok, ss_head,
                                              BS, BLOCK_N, PRECISION, QUANT, False)
            for start in range(tl.maximum(full_hi, first), last, BLOCK_N):
                m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, start, lo, last, pos, window, row_table, KPool, VPool,
                                              KScale, VScale, kvh, d, scale, sk_block, sk_tok, sk_head, sk_dim,
                                              sv_block, sv_tok, sv_head, sv_dim, ss_block, ss_tok, ss_head,
                                              BS, BLOCK_N, PRECISION, QUANT, True)
            # Every query sees its own key: l_i > 0 on the rows stored.
            out = acc / tl.where(mmask, l_i, 1.0)[:, None]
            o_at = (q_begin + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
            tl.store(Out + o_at, out.to(Out.dtype.element_ty), mask=mmask[:, None])

    @triton.jit
    def _prefill_tile(q, m_i, l_i, acc, start, lo, last, pos, window, row_table, KPool, VPool, KScale, VScale,
                      kvh, d, scale, sk_block, sk_tok, sk_head, sk_dim, sv_block, sv_tok, sv_head, sv_dim,
                      ss_block, ss_tok, ss_head, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr, QUANT: tl.constexpr, MASKED: tl.constexpr):
        """One tile of BLOCK_N keys from ``start`` into the running softmax of
        the tile's queries; ``MASKED``: some query does not see some key."""
        toks = start + tl.arange(0, BLOCK_N)
        if MASKED:
            kmask = (toks < last) & (toks >= lo)
        else:
            kmask = toks < last  # always true here: lets the loads stay unmasked in effect
        block = tl.load(row_table + toks // BS, mask=kmask, other=0).to(tl.int64)
        off = toks % BS
        k_at = (block * sk_block + off * sk_tok + kvh * sk_head)[:, None] + d[None, :] * sk_dim
        v_at = (block * sv_block + off * sv_tok + kvh * sv_head)[:, None] + d[None, :] * sv_dim
        k = tl.load(KPool + k_at, mask=kmask[:, None], other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if QUANT:  # 8-bit codes are exact in the query's dtype; a key's scale multiplies its scores
            s_at = block * ss_block + off * ss_tok + kvh * ss_head
            qk = qk * tl.load(KScale + s_at, mask=kmask, other=0.0).to(tl.float32)[None, :]
        if MASKED:
            seen = (toks[None, :] <= pos[:, None]) & (pos[:, None] - toks[None, :] < window) & kmask[None, :]
            qk = tl.where(seen, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that sees no key of this tile
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = m_new
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:  # ... and a value's scale its probability
            p = p * tl.load(VScale + s_at, mask=kmask, other=0.0).to(tl.float32)[None, :]
        v = tl.load(VPool + v_at, mask=kmask[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc


class KVTarget(NamedTuple):
    """Where one layer's new keys and values go, for a kernel that writes
    them itself (``fused.qk_norm_rope``): its pools, the step's slots (``[T]``,
    negative: nothing), and for 8-bit pools their scales, format and QMAX."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    slots: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None = None
    fmt: str = "none"
    qmax: float = 0.0


def write_kv(keys: torch.Tensor, values: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None, *,
             fmt: str = "none", qmax: float = 0.0) -> None:
    """Store ``[T, H_kv, D]`` keys and values at ``slot_mapping`` ``[T]`` (a
    negative slot is skipped): one launch for both. With ``scales`` (the
    pools' ``[blocks, block_size, H_kv]`` scales) the pools hold 8-bit codes
    of ``fmt`` (``"int8"`` or ``"fp8"``): each token's heads are quantized to
    +-``qmax`` as ``cache.kv_quant`` does, in the same launch. Pools and
    scales are addressed through their strides (token-major or head-major
    alike)."""
    if fmt not in ("none", "int8", "fp8") or (fmt == "none") != (scales is None):
        raise ValueError(f"write_kv: format {fmt!r} with{'out' if scales is None else ''} scales "
                         "(8-bit formats write scales, 'none' does not)")
    T, H, D = keys.shape
    if T == 0:
        return
    keys, values = _rows_flat(keys), _rows_flat(values)
    k_scale, v_scale = scales if scales is not None else (k_pool, v_pool)
    _write_kv_kernel[(T,)](keys, values, k_pool, v_pool, k_scale, v_scale, slot_mapping,
                           keys.stride(0), values.stride(0), *k_pool.stride(), *v_pool.stride(), *scale_strides(scales),
                           H=H, D=D, BS=k_pool.shape[1], H_PAD=triton.next_power_of_2(H),
                           QMAX=float(qmax if scales is not None else 0.0), INT8=fmt == "int8",
                           **launch_options(keys.device))


def scale_strides(scales: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[int, int, int]:
    """The scales' element strides (keys' and values' scales are laid out alike)."""
    if scales is None:
        return (0, 0, 0)
    assert scales[0].stride() == scales[1].stride(), "key and value scales share a layout"
    return scales[0].stride()


def _rows_flat(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` whose heads and dims are contiguous within a token (a
    slice of the fused qkv projection is); anything else is copied."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (what sizes a grid to fill it); 1 for the interpreter."""
    if device.type != "cuda":
        return 1  # the interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


def _window(window: int | None) -> int:
    """The kernels' window: no window is one wider than any sequence."""
    return window if window is not None else NO_WINDOW


def _token_run(k_pool: torch.Tensor, v_pool: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None) -> int:
    """How many of a block's tokens the decode kernel may treat as one run of
    adjacent values (and scales): up to 16 when the values are stored token
    innermost (``cache.kv_quant``'s 8-bit layout), else 1. Wide runs let the
    values' tile load as 16-byte rows, asynchronously, and meet the tensor
    cores untransposed."""
    tensors = [v_pool, *(scales or ())]
    if any(t.stride(1) != 1 for t in tensors):
        # token-major: the kernel addresses keys and values by slot, as one
        assert k_pool.stride() == v_pool.stride() and k_pool.stride(0) == k_pool.shape[1] * k_pool.stride(1) \
            and k_pool.stride(3) == 1, "token-major pools are slot-addressed: equal, contiguous strides"
        return 1
    run = min(v_pool.shape[1], 16)
    assert all(t.stride(i) % run == 0 for t in tensors for i in (0, 2) if t.shape[i] > 1), "runs start at multiples of their length"
    return run


def decode_constants(q_dtype: torch.dtype, group: int, head_dim: int, block_size: int, quant: bool, run: int,
                     busy: bool) -> dict:
    """The decode kernel's compile-time constants for a launch: query
    dtype, GQA group, head dim, block size, 8-bit pools or not, their token
    run (``_token_run``) and whether rows x KV heads fill the SMs
    (``benchmarks/decode_ptx.py`` compiles with these too)."""
    return dict(
        G=group, G_PAD=max(MIN_DOT, triton.next_power_of_2(group)), D=head_dim, BS=block_size, **split_constants(),
        BLOCK_N=BLOCK_N, PRECISION="ieee" if q_dtype == torch.float32 else "tf32", QUANT=quant,
        STAGES=STAGES if quant or not busy else STAGES_BUSY,
        F16_DOT=quant and q_dtype == torch.bfloat16, F16_SHIFT=256.0, RUN=run,
        PAIRED_SCALES=bool(PAIRED_SCALES) and run > 1, ROWS=ROWS_CHUNK,
    )


def decode_programs(batch: int, kv_heads: int, device: torch.device) -> int:
    """Programs per (row, KV head): enough that the grid is about PROGRAMS_PER_SM
    programs per SM (a row's splits are shared out), at most MAX_PROGRAMS.
    Any count gives the same result (each split is its own partial)."""
    want = -(-PROGRAMS_PER_SM * sm_count(device) // (batch * kv_heads))
    return max(1, min(MAX_PROGRAMS, triton.next_power_of_2(want)))


def split_constants() -> dict:
    """The split rule's constants, as both decode kernels take them."""
    assert SPLIT_MIN % BLOCK_N == 0 and SPLIT // SPLIT_MIN in [2**i for i in range(9)], \
        "splits are whole tiles, their sizes SPLIT_MIN doubled at most 8 times"
    return dict(SPLIT=SPLIT, SPLIT_MIN=SPLIT_MIN, SHORT=SHORT_SPLITS)


def split_len(seq_len: int) -> int:
    """Keys per decode split of a row of ``seq_len`` keys: the shortest of
    SPLIT_MIN, 2 * SPLIT_MIN, ... that cuts the row into at most SHORT_SPLITS,
    SPLIT past that (the kernels' ``_split_len``)."""
    size = SPLIT_MIN
    while size < SPLIT and seq_len > size * SHORT_SPLITS:
        size *= 2
    return size


def row_splits(seq_len: int) -> int:
    """A row of ``seq_len`` keys' decode splits (its partials)."""
    return -(-seq_len // split_len(seq_len))


def decode_partials(rows: int, table_width: int, block_size: int) -> int:
    """Partials of any ``rows`` rows of a table ``table_width`` blocks wide:
    each row's most over every length the table holds, SHORT_SPLITS once a
    row can be SPLIT_MIN * SHORT_SPLITS long, else the widest row's."""
    longest = table_width * block_size
    return rows * max(row_splits(longest), SHORT_SPLITS if longest >= SPLIT_MIN * SHORT_SPLITS else 0)


def pool_partials(rows: int, pool_tokens: int) -> int:
    """Partials of any ``rows`` rows whose keys are distinct slots of a pool
    of ``pool_tokens`` (no block shared between two rows): a row holds at
    most SHORT_SPLITS splits shorter than SPLIT, or its keys // SPLIT plus a
    partial last one. Rows that share prefix blocks can hold more."""
    return pool_tokens // SPLIT + rows * SHORT_SPLITS


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    programs: int | None = None,
    partials: int | None = None,
) -> torch.Tensor:
    """Attention of one query per row over its paged keys: ``q`` ``[B, H_q,
    D]``, ``block_tables`` ``[B, W]``, ``seq_lens`` ``[B]`` (keys per row, the
    query's own included). Returns ``[B, H_q, D]``. With ``scales`` the
    pools hold 8-bit codes, read as float16 (exactly: int8 and e4m3 codes
    fit it; a float32 query keeps float32); a token's scale multiplies its
    scores (keys) and its probability (values) in float32, so no element is
    multiplied or rounded on its own. ``programs`` per (row, KV head):
    ``decode_programs`` unless given (tests); it changes the speed only.
    ``partials``: splits the buffer of partials holds, at least the rows'
    ``row_splits`` together (the caller's promise); ``decode_partials`` for
    the table unless given.
    The launch's shape depends on ``B``, the heads and ``partials``, never
    on lengths: a CUDA graph captured once serves every length."""
    B, Hq, D = q.shape
    partials = partials or decode_partials(B, block_tables.shape[1], k_pool.shape[1])
    part = torch.empty((partials, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((partials, Hq), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if B == 0:
        return out
    decode_splits(q, k_pool, v_pool, block_tables, seq_lens, scale, window, scales, programs, part, lse)
    _decode_merge_kernel[(B, Hq)](
        part, lse, out, seq_lens,
        part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), _window(window), D=D, **split_constants(), CHUNK=MERGE_CHUNK, ROWS=ROWS_CHUNK,
        **launch_options(q.device),
    )
    return out


def decode_splits(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, window: int | None,
                  scales: tuple[torch.Tensor, torch.Tensor] | None, programs: int | None,
                  part: torch.Tensor, lse: torch.Tensor) -> None:
    """``paged_decode``'s first launch: each split's partial ``part[i]`` and
    log-sum-exp ``lse[i]``, row after row in split order."""
    B, Hq, D = q.shape
    _, BS, Hkv, _ = k_pool.shape
    programs = programs or decode_programs(B, Hkv, q.device)
    k_scale, v_scale = scales if scales is not None else (k_pool, v_pool)
    run = _token_run(k_pool, v_pool, scales)
    _decode_split_kernel[(B, Hkv, programs)](
        q, k_pool, v_pool, k_scale, v_scale, block_tables, seq_lens, part, lse,
        q.stride(0), q.stride(1), block_tables.stride(0),
        part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
        *k_pool.stride(), *v_pool.stride(), *scale_strides(scales),
        scale, _window(window), programs,
        **decode_constants(q.dtype, Hq // Hkv, D, BS, scales is not None, run, busy=B * Hkv >= sm_count(q.device)),
        num_warps=WARPS, **launch_options(q.device),
    )


@functools.cache  # once per layer shape and tile class, not per layer and step
def prefill_constants(q_dtype: torch.dtype, group: int, head_dim: int, block_size: int, quant: bool,
                      max_query_len: int) -> dict:
    """The multi-query kernel's compile-time constants: a tile is BLOCK_Q
    queries times the group's heads (padded to a power of two), at most
    PREFILL_BLOCK_M rows by PREFILL_BLOCK_N keys for 256-byte query rows
    (bf16 at head dim 128; measured on the H200, ``benchmarks/gpu_prefill.py``),
    both halved for each doubling of the row's bytes (shared memory holds
    the tiles). Two sizes of tile only, so that a run compiles each once: a
    step whose rows have at most SHORT_QUERIES queries (verify rows) takes
    tiles of that many queries, any other the full tile."""
    g_pad = triton.next_power_of_2(group)
    shrink = max(1, head_dim * q_dtype.itemsize // 256)
    block_m, block_n = max(MIN_DOT, PREFILL_BLOCK_M // shrink), max(MIN_DOT, PREFILL_BLOCK_N // shrink)
    block_q = max(1, block_m // g_pad)
    if max_query_len <= SHORT_QUERIES:
        block_q = min(block_q, SHORT_QUERIES)
    block_q = max(block_q, -(-MIN_DOT // g_pad))  # tl.dot wants 16 rows at least
    return dict(G=group, G_PAD=g_pad, D=head_dim, BS=block_size, BLOCK_Q=block_q, BLOCK_N=block_n,
                PRECISION="ieee" if q_dtype == torch.float32 else "tf32", QUANT=quant,
                HEAVY_FIRST=PREFILL_HEAVY_FIRST)


def paged_prefill(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    window: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    min_queries: int = 1,
) -> torch.Tensor:
    """Causal attention of rows with any number of queries over their paged
    keys, varlen: ``q`` ``[T, H_q, D]`` is the rows' queries one row after
    another, row ``r``'s from ``query_start[r]`` to ``query_start[r + 1]``
    (``[B + 1]``, on the device), ``seq_lens`` ``[B]`` its keys after this
    step (its queries are its last ``q_len`` positions, so a chunk after a
    cached prefix starts mid-sequence), ``block_tables`` ``[B, W]``. The
    query at position ``p`` sees keys ``j <= p`` with ``p - j < window``.
    ``max_query_len`` (from the host) picks the tile size, never the
    grid's meaning. Rows with fewer than ``min_queries`` queries are left alone in
    ``out`` (the decode kernel takes them). 8-bit pools with ``scales`` as
    in ``paged_decode``. One launch: the grid is ``T // BLOCK_Q + B`` tiles
    (each row's tiles found in the kernel) by KV heads, computed from shapes,
    never from a device read."""
    T, Hq, D = q.shape
    _, BS, Hkv, _ = k_pool.shape
    B = block_tables.shape[0]
    out = torch.empty_like(q) if out is None else out
    if T == 0:
        return out
    consts = prefill_constants(q.dtype, Hq // Hkv, D, BS, scales is not None,
                               min(max_query_len, SHORT_QUERIES + 1))  # the cache keys on the tile class
    k_scale, v_scale = scales if scales is not None else (k_pool, v_pool)
    grid = (T // consts["BLOCK_Q"] + B, Hkv)
    _prefill_kernel[grid](
        q, k_pool, v_pool, k_scale, v_scale, block_tables, query_start, seq_lens, out,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        *k_pool.stride(), *v_pool.stride(), *scale_strides(scales),
        scale, _window(window), B, min_queries, **consts,
        num_warps=PREFILL_WARPS if consts["BLOCK_Q"] * consts["G_PAD"] >= 64 else WARPS,
        num_stages=PREFILL_STAGES, **launch_options(q.device),
    )
    return out
