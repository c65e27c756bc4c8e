"""Fused elementwise kernels for CUDA (Triton): RMSNorm (alone, or after the
residual add, or Gemma's norm + add + norm), RMSNorm + RoPE (q's and k's
heads in one launch), gated activation.

A decode step of a small model is a chain of tiny kernels; under a CUDA
graph the launches are free but every kernel still costs its few
microseconds of start and drain. In torch, one RMSNorm is eight kernels
(cast, square, sum, divide, add, rsqrt, multiply, cast) and one RoPE four:
Qwen3-0.6B's 28 layers ran some 1,500 kernels a token. Here each is one.

Each kernel rounds where the torch ops it replaces round (``models.layers``
keeps those ops, and the CPU runs them): products and sums of bf16/fp16
values are taken in float32 and rounded to the input dtype at the same
points, so a fused layer differs from the torch one only where float32
reductions add in another order (the norm's sum of squares).

``enabled(x)`` says whether the layers use them: CUDA tensors with triton
installed (a check on every norm of an eager step, so it reads two
attributes and nothing more). The tests call them directly on the CPU
under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from pagedlm.kernels.launch import launch_options
from pagedlm.kernels.paged_attention import KVTarget, sm_count, scale_strides, triton

if triton is not None:
    import triton.language as tl

    from pagedlm.kernels.launch import await_inputs
    from pagedlm.kernels.paged_attention import write_head

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        """Round float32 ``x`` to the model dtype and back (what a torch op on
        that dtype stores)."""
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _normed(x, w, n, eps, UNIT_OFFSET: tl.constexpr, DTYPE: tl.constexpr):
        """The norm of float32 row ``x`` by weight ``w``, rounded to DTYPE as the module stores it (as float32)."""
        h = x * tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, 0), n * 1.0) + eps)
        if UNIT_OFFSET:  # Gemma: (h * (1 + w)) in float32, then the cast
            return _round(h * (w + 1.0), DTYPE)
        return _round(w * _round(h, DTYPE), DTYPE)  # Llama: w * h.to(dtype), a product of two rounded values

    @triton.jit
    def _rms_norm_kernel(X, R, W0, W, Out, Sum, stride_x, stride_r, stride_o, stride_s, n, eps,
                         PRE: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
        """The norm of row ``x``; with ADD, of ``s = x + r`` (stored, rounded to
        Sum's dtype as torch's add stores it, and normed as rounded); with PRE,
        ``x`` is first normed by W0 (Gemma's norm after a sub-layer, before
        the residual add); without NORM only ``s`` is stored."""
        await_inputs(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        if PRE:
            x = _normed(x, tl.load(W0 + offs, mask=m, other=0.0).to(tl.float32), n, eps, UNIT_OFFSET,
                        Sum.dtype.element_ty)
        if ADD:
            r = tl.load(R + row * stride_r + offs, mask=m, other=0.0).to(tl.float32)
            x = _round(x + r, Sum.dtype.element_ty)
            tl.store(Sum + row * stride_s + offs, x.to(Sum.dtype.element_ty), mask=m)
        if NORM:
            y = _normed(x, tl.load(W + offs, mask=m, other=0.0).to(tl.float32), n, eps, UNIT_OFFSET,
                        Out.dtype.element_ty)
            tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rope_kernel(X, W, W2, Cos, Sin, Out, Out2, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                          stride_o2t, stride_o2h, heads_first, eps,
                          V, KPool, VPool, KScale, VScale, Slots, stride_vt, stride_vh, kv_heads,
                          sk_block, sk_tok, sk_head, sk_dim, sv_block, sv_tok, sv_head, sv_dim,
                          ss_block, ss_tok, ss_head,
                          NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, D: tl.constexpr, WRITE: tl.constexpr,
                          BS: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr, PDL: tl.constexpr):
        """Heads below ``heads_first`` (q) take W and go to Out, the next
        ``kv_heads`` (k) W2 and Out2. With WRITE k's heads go to KPool at the
        token's slot instead, and ``kv_heads`` programs more copy V's heads
        to VPool (`paged_attention.write_head`, which quantizes with QMAX;
        a negative slot writes nothing)."""
        await_inputs(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        is_k = h >= heads_first
        h_out = tl.where(is_k, h - heads_first, h)
        d = tl.arange(0, D)
        if h >= heads_first + kv_heads:  # (WRITE only) a value head, copied into the pool
            hv = h - heads_first - kv_heads
            slot = tl.load(Slots + t).to(tl.int64)
            if slot >= 0:
                block, off = slot // BS, slot % BS
                write_head(tl.load(V + t * stride_vt + hv * stride_vh + d),
                           VPool + block * sv_block + off * sv_tok + hv * sv_head + d * sv_dim,
                           VScale + block * ss_block + off * ss_tok + hv * ss_head, QMAX, INT8)
        else:
            rolled = (d + D // 2) % D  # x.roll(D // 2)[d] = x[d - D/2] = x[(d + D/2) % D]
            base = X + t * stride_xt + h * stride_xh
            x = tl.load(base + d).to(tl.float32)
            xr = tl.load(base + rolled).to(tl.float32)
            if NORM:
                scale = tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, 0), D * 1.0) + eps)
                w = tl.where(is_k, tl.load(W2 + d), tl.load(W + d)).to(tl.float32)
                wr = tl.where(is_k, tl.load(W2 + rolled), tl.load(W + rolled)).to(tl.float32)
                if UNIT_OFFSET:
                    x = _round(x * scale * (w + 1.0), Out.dtype.element_ty)
                    xr = _round(xr * scale * (wr + 1.0), Out.dtype.element_ty)
                else:
                    x = _round(w * _round(x * scale, Out.dtype.element_ty), Out.dtype.element_ty)
                    xr = _round(wr * _round(xr * scale, Out.dtype.element_ty), Out.dtype.element_ty)
            cos = tl.load(Cos + t * stride_ct + d).to(tl.float32)
            sin = tl.load(Sin + t * stride_ct + d).to(tl.float32)
            y = _round(x * cos, Out.dtype.element_ty) + _round(xr * sin, Out.dtype.element_ty)
            y = y.to(Out.dtype.element_ty)
            tl.store(Out + t * stride_ot + h_out * stride_oh + d, y, mask=d < tl.where(is_k, 0, D))
            if not WRITE:
                tl.store(Out2 + t * stride_o2t + h_out * stride_o2h + d, y, mask=d < tl.where(is_k, D, 0))
            elif is_k:
                slot = tl.load(Slots + t).to(tl.int64)
                if slot >= 0:
                    block, off = slot // BS, slot % BS
                    write_head(y, KPool + block * sk_block + off * sk_tok + h_out * sk_head + d * sk_dim,
                               KScale + block * ss_block + off * ss_tok + h_out * ss_head, QMAX, INT8)

    @triton.jit
    def _tanh(x):
        return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0

    @triton.jit
    def act_mul_of(gate, up, GELU: tl.constexpr, DTYPE: tl.constexpr):
        """``act(gate) * up`` of float32 values that hold DTYPE ones, rounded
        to DTYPE as torch's ops on DTYPE round it (the activation, then the product)."""
        if GELU:  # gelu(approximate="tanh")
            act = 0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
        else:  # silu
            act = gate / (1.0 + tl.exp(-gate))
        return (_round(act, DTYPE) * up).to(DTYPE)

    @triton.jit
    def _act_mul_kernel(X, Out, stride_x, stride_o, n, GELU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        gate = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + n + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_o + offs, act_mul_of(gate, up, GELU, Out.dtype.element_ty), mask=m)

    @triton.jit
    def _masked_logits_kernel(Logits, Bits, Out, stride_l, stride_b, stride_o, n, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
        """A row's float32 logits with the tokens its int32 bitmask words
        refuse (bit ``j`` of word ``i``: token ``32 * i + j``) at -inf, a NaN too."""
        await_inputs(PDL)
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(Logits + row * stride_l + offs, mask=m, other=0.0)
        word = tl.load(Bits + row * stride_b + offs // 32, mask=m, other=0)
        keep = ((word >> (offs % 32)) & 1) != 0
        tl.store(Out + row * stride_o + offs, tl.where(keep & (x == x), x, float("-inf")), mask=m)

    @triton.jit
    def _gumbel_split_kernel(Logits, InvT, Part, stride_l, n, chunk, splits, seed, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        """Split ``z`` of row ``row`` (tokens ``z * chunk`` on, ``chunk`` a
        multiple of BLOCK) when its ``inv_t`` > 0: its best token under the
        Gumbel-max rule (``x * inv_t + g``, g a Gumbel draw per token: the
        argmax over the row is a draw from softmax(logits * inv_t)), as one
        int64 key that orders candidates by rank, then score, then token id.
        The rank is the torch sampler's reading of logits: +inf ones (if any)
        are the only candidates, -inf and NaN ones are never drawn unless
        nothing else is (then any token is)."""
        await_inputs(PDL)
        row = tl.program_id(0)
        z = tl.program_id(1)
        inv_t = tl.load(InvT + row)
        if inv_t > 0:
            best = tl.full([], 0, tl.int64)
            for start in range(z * chunk, tl.minimum(n, z * chunk + chunk), BLOCK):
                offs = start + tl.arange(0, BLOCK)
                inside = offs < n
                x = tl.load(Logits + row * stride_l + offs, mask=inside, other=float("-inf"))
                g = -tl.log(-tl.log(tl.rand(seed, row * n + offs)))
                rank = tl.where(x == float("inf"), 2, tl.where(x > float("-inf"), 1, 0))
                score = tl.where(rank == 1, x * inv_t + g, g)
                bits = score.to(tl.int32, bitcast=True)  # as an unsigned key in float order
                ordered = tl.where(bits >= 0, bits.to(tl.int64) + 2147483648, (~bits).to(tl.int64))
                key = (rank.to(tl.int64) << 61) | (ordered << 29) | offs.to(tl.int64)
                best = tl.maximum(best, tl.max(tl.where(inside, key, 0), 0))
            tl.store(Part + row * splits + z, best)

    @triton.jit
    def _gumbel_merge_kernel(InvT, Part, Out, splits, SPLITS: tl.constexpr, PDL: tl.constexpr):
        """Row ``row``'s drawn token, the best of its splits' keys (rows with ``inv_t`` 0 left alone)."""
        await_inputs(PDL)
        row = tl.program_id(0)
        if tl.load(InvT + row) > 0:
            z = tl.arange(0, SPLITS)
            keys = tl.load(Part + row * splits + z, mask=z < splits, other=0)
            tl.store(Out + row, tl.max(keys, 0) & ((1 << 29) - 1))


def enabled(x: torch.Tensor) -> bool:
    """Use the fused kernels for ``x``: on CUDA when triton is installed."""
    return x.is_cuda and triton is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows over its last dimension, that dimension contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, unit_offset: bool,
             residual: torch.Tensor | None = None, pre_weight: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``models.layers.RMSNorm`` over the last dimension, one kernel. With a
    ``residual``: the norm of ``s = x + residual`` and ``s`` itself, each bit
    for bit what the add and the norm alone give (``s`` is rounded to the
    dtype before the norm reads it, as the add stores it). With a
    ``pre_weight`` too, ``x`` is first normed by it (the same ``eps`` and
    offset): ``s = residual + norm(x)``, Gemma's sandwich; and without a
    ``weight``, ``s`` alone is returned. Compiled without fused multiply-adds:
    in float32 the round to the dtype is no op, and the compiler fused the
    norm's last product with the residual add (an H100: the fused sandwich
    then differed from the norm and the add in their last bit)."""
    if (pre_weight is not None or weight is None) and residual is None:
        raise ValueError("rms_norm: a pre_weight, or no weight, needs a residual")
    n = x.shape[-1]
    rows = _rows(x)
    res = rows if residual is None else _rows(residual)
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    total = out if residual is None else torch.empty_like(out)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res, weight if pre_weight is None else pre_weight,
                                           out if weight is None else weight, out, total, rows.stride(0),
                                           res.stride(0), out.stride(0), total.stride(0), n, eps,
                                           PRE=pre_weight is not None, ADD=residual is not None,
                                           NORM=weight is not None, UNIT_OFFSET=unit_offset,
                                           BLOCK=triton.next_power_of_2(n), enable_fp_fusion=False,
                                           **launch_options(x.device))
    if residual is None:
        return out.view(x.shape)
    return total.view(x.shape) if weight is None else (out.view(x.shape), total.view(x.shape))


def qk_norm_rope(x: torch.Tensor, num_q: int, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
                 unit_offset: bool = False, v: torch.Tensor | None = None,
                 target: KVTarget | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``apply_rope(RMSNorm(x), (cos, sin))`` per head (the norm optional) of
    q and k in one launch: ``x`` ``[T, Hq + Hkv, D]`` holds
    q's heads then k's (as the fused q/k/v product lays them out), the first
    ``num_q`` normed by ``q_weight``, the rest by ``k_weight`` (both or
    neither); ``cos`` and ``sin`` ``[T, 1, D]``; new contiguous q ``[T, Hq, D]``
    and k ``[T, Hkv, D]`` (``num_q = H``: every head normed as q, k empty).
    With a ``target`` (a paged layer's pools and the step's slots), k and
    the values ``v`` ``[T, Hkv, D]`` go to its pools in the same launch, the
    bits `paged_attention.write_kv` would store there, and k is None."""
    T, H, D = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.reshape(T, D), sin.reshape(T, D)
    q = torch.empty((T, num_q, D), dtype=x.dtype, device=x.device)
    k = None if target is not None else torch.empty((T, H - num_q, D), dtype=x.dtype, device=x.device)
    if T:
        norm = q_weight is not None
        out2 = q if k is None else k  # (a target's launch stores no k: any tensor fills the slot)
        if target is not None:
            if v is None or v.shape != (T, H - num_q, D) or v.stride(2) != 1:
                raise ValueError(f"qk_norm_rope: a target needs values [{T}, {H - num_q}, {D}], D contiguous")
            kv = (v, target.k_pool, target.v_pool, *(target.scales or (x, x)), target.slots, v.stride(0),
                  v.stride(1), H - num_q, *target.k_pool.stride(), *target.v_pool.stride(),
                  *scale_strides(target.scales))
            write = dict(WRITE=True, BS=target.k_pool.shape[1], QMAX=float(target.qmax),
                         INT8=target.fmt == "int8")
        else:
            kv = (x, x, x, x, x, x, 0, 0, H - num_q, *([0] * 11))
            write = dict(WRITE=False, BS=1, QMAX=0.0, INT8=False)
        grid = (T, H + (H - num_q if target is not None else 0))
        _norm_rope_kernel[grid](x, q_weight if norm else x, k_weight if norm else x, cos, sin, q, out2,
                                x.stride(0), x.stride(1), cos.stride(0), q.stride(0), q.stride(1),
                                out2.stride(0), out2.stride(1), num_q, eps, *kv,
                                NORM=norm, UNIT_OFFSET=unit_offset, D=D, **write, **launch_options(x.device))
    return q, k


def act_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of a fused gate_up product ``[T, 2n]``; ``activation``
    is a ``models.layers.ACTIVATIONS`` name (silu, or gelu_pytorch_tanh)."""
    T, two_n = x.shape
    n = two_n // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((T, n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if T:
        _act_mul_kernel[(T, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n,
                                                    GELU=activation == "gelu_pytorch_tanh", BLOCK=block,
                                                    **launch_options(x.device))
    return out


def gumbel_pick(logits: torch.Tensor, inv_temperature: torch.Tensor, out: torch.Tensor, seed: int) -> torch.Tensor:
    """Draw the token of each row of float ``logits`` ``[rows, V]`` whose
    float32 ``inv_temperature`` (1 / its temperature) is above 0, from
    softmax(logits / temperature), into int64 ``out`` ``[rows]`` (the other
    rows' entries are left as they are: the engine passes its greedy argmax);
    ``seed`` picks the draws. The distribution `sampling._probs` gives a row
    without top-k, top-p or min-p, its ~15 torch ops replaced by two
    launches: a row's splits spread over the SMs, each its best candidate,
    then the best of them (one program a row, reading a row of 151,936
    logits alone, made a batch-1 step on an H100 0.1 ms slower than the
    torch ops did)."""
    rows, n = logits.shape
    if n >= 1 << 29:
        raise ValueError(f"gumbel_pick keys hold token ids below 2^29 (got a vocabulary of {n})")
    logits = _rows(logits)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        blocks = triton.cdiv(n, block)
        splits = min(blocks, max(1, triton.cdiv(4 * sm_count(logits.device), rows)))
        chunk = triton.cdiv(blocks, splits) * block
        splits = triton.cdiv(n, chunk)
        part = torch.empty((rows, splits), dtype=torch.int64, device=logits.device)
        _gumbel_split_kernel[(rows, splits)](logits, inv_temperature, part, logits.stride(0), n, chunk, splits,
                                             seed, BLOCK=block, **launch_options(logits.device))
        _gumbel_merge_kernel[(rows,)](inv_temperature, part, out, splits, SPLITS=triton.next_power_of_2(splits),
                                      **launch_options(logits.device))
    return out


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """float32 ``logits`` ``[rows, V]`` as a new tensor with the tokens int32
    ``bitmask`` ``[rows, >= ceil(V / 32)]`` refuses at -inf, and a NaN at
    -inf: `structured.masked_logits`'s result (there eight torch ops) in one launch."""
    rows, n = logits.shape
    logits, bitmask = _rows(logits), _rows(bitmask)
    out = torch.empty((rows, n), dtype=torch.float32, device=logits.device)
    block = 1024
    if rows:
        _masked_logits_kernel[(rows, triton.cdiv(n, block))](logits, bitmask, out, logits.stride(0),
                                                            bitmask.stride(0), out.stride(0), n, BLOCK=block,
                                                            **launch_options(logits.device))
    return out
