"""The fused elementwise kernels (CUDA's RMSNorm, norm + RoPE, gated
activation) against the torch ops they replace, which the CPU runs.

Interpreted here (``TRITON_INTERPRET=1``, float32 and float16: the
interpreter cannot hold bfloat16); on CUDA they run compiled. They round
where the torch ops round, so on float16 they agree to within one rounding
step, and to float32 noise on float32.
"""

from __future__ import annotations

import pytest
import torch

from pagedlm.kernels import fused
from pagedlm.models.layers import ACTIVATIONS, RMSNorm, RoPE, apply_rope
from tests.fast.kernel_refs import requires_triton
from tests.helpers import DEVICE

pytestmark = requires_triton  # a triton that fails to import fails these (and test_paged_kernels says why)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal within one float16 rounding (or float32 noise)."""
    tol = 1e-6 if dtype == torch.float32 else 2 ** -10
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype).to(DEVICE)


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [64, 640, 1000])
def test_rms_norm_matches_the_module(unit_offset, dtype, dim):
    norm = RMSNorm(dim, 1e-6, unit_offset=unit_offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(1)))
    norm = norm.to(dtype)
    x = randn(5, 3, dim, dtype=dtype)
    want = norm.to("cpu")(x.cpu())
    got = fused.rms_norm(x, norm.weight.to(DEVICE), norm.eps, unit_offset)
    assert got.shape == x.shape and close(got.cpu(), want, dtype)
    assert not close(got.cpu(), x.cpu(), dtype)  # it did normalise


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_rope_matches_norm_then_rope(with_norm, unit_offset, dtype):
    T, Hq, Hkv, D = 7, 4, 2, 64
    fused_qkv = randn(T, Hq + 2 * Hkv, D, dtype=dtype)  # k as a strided slice, as the model has it
    k = fused_qkv[:, Hq : Hq + Hkv]
    norm = RMSNorm(D, 1e-6, unit_offset=unit_offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=torch.Generator().manual_seed(2)))
    norm = norm.to(dtype)
    positions = torch.tensor([0, 1, 2, 50, 51, 300, 1000])
    cos, sin = RoPE(D, 10000.0).rows(positions, 1000, dtype)
    want = apply_rope(norm(k.cpu()) if with_norm else k.cpu(), (cos, sin))
    weights = (norm.weight.to(DEVICE),) * 2 if with_norm else (None, None)
    got = fused.qk_norm_rope(k, Hkv, cos.to(DEVICE), sin.to(DEVICE), *weights, norm.eps, unit_offset)[0]
    assert got.is_contiguous() and close(got.cpu(), want, dtype)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_act_mul_matches_act_times_up(activation, dtype):
    x = randn(6, 2 * 1500, dtype=dtype)  # two column blocks, the second ragged
    gate, up = x.cpu().chunk(2, dim=-1)
    act = ACTIVATIONS[activation]
    want = act(gate) * up
    assert close(fused.act_mul(x, activation).cpu(), want, dtype)


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_with_a_residual_is_the_add_then_the_norm_bit_for_bit(unit_offset, dtype):
    """One kernel for ``x + residual`` and the norm of it: the sum and the norm
    are exactly what the add and `rms_norm` give (the sum rounded to the dtype
    before the norm reads it), and match the module's torch ops."""
    dim = 640
    weight = torch.randn(dim, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    x, residual = randn(5, dim, dtype=dtype, seed=1), randn(5, dim, dtype=dtype, seed=2)
    normed, total = fused.rms_norm(x, weight, 1e-6, unit_offset, residual)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, fused.rms_norm(x + residual, weight, 1e-6, unit_offset))
    norm = RMSNorm(dim, 1e-6, unit_offset=unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight.cpu())
    want_normed, want_total = norm.add(x.cpu(), residual.cpu())  # the CPU's ops
    assert torch.equal(total.cpu(), want_total) and close(normed.cpu(), want_normed, dtype)


@pytest.mark.parametrize("then", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_add_norm_is_the_three_kernels_bit_for_bit(then, dtype):
    """Gemma's norm after a sub-layer, the residual add and the next norm in
    one kernel: the sum and the norm are exactly what the norm alone and then
    the fused add + norm give, and match the module's torch ops."""
    dim = 640
    post, pre = (torch.randn(dim, generator=torch.Generator().manual_seed(s)).to(dtype).to(DEVICE) for s in (4, 5))
    y, residual = randn(5, dim, dtype=dtype, seed=6), randn(5, dim, dtype=dtype, seed=7)
    got = fused.rms_norm(y, pre if then else None, 1e-6, True, residual, pre_weight=post)
    normed_y = fused.rms_norm(y, post, 1e-6, True)
    if then:
        want_normed, want_total = fused.rms_norm(normed_y, pre, 1e-6, True, residual)
        assert torch.equal(got[0], want_normed) and torch.equal(got[1], want_total)
        assert not torch.equal(got[0], got[1])
    else:
        assert torch.equal(got, normed_y + residual)
    modules = [RMSNorm(dim, 1e-6, unit_offset=True).to(dtype) for _ in range(2)]
    with torch.no_grad():
        for module, weight in zip(modules, (post, pre)):
            module.weight.copy_(weight.cpu())
    want = modules[0].norm_add(y.cpu(), residual.cpu(), then=modules[1] if then else None)  # the CPU's ops
    for a, b in zip(got if then else [got], want if then else [want]):
        assert close(a.cpu(), b, dtype)


def test_norm_add_refuses_norms_that_differ_and_a_missing_residual():
    with pytest.raises(ValueError, match="share eps and offset"):
        RMSNorm(8, 1e-6, unit_offset=True).norm_add(torch.ones(2, 8), torch.ones(2, 8), then=RMSNorm(8, 1e-5, True))
    with pytest.raises(ValueError, match="needs a residual"):
        fused.rms_norm(torch.ones(2, 8, device=DEVICE), None, 1e-6, True)


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_norm_rope_is_two_norm_ropes_bit_for_bit(with_norm, dtype):
    """q's and k's heads in one launch, each with its own norm weights: the
    same bits as each alone (all its heads as q; k not normed by q's weights)."""
    T, Hq, Hkv, D = 5, 4, 2, 64
    qkv = randn(T, Hq + 2 * Hkv, D, dtype=dtype, seed=4)
    qk = qkv[:, : Hq + Hkv]
    wq, wk = (torch.randn(D, generator=torch.Generator().manual_seed(s)).to(dtype).to(DEVICE) for s in (5, 6))
    cos, sin = (t.to(DEVICE) for t in RoPE(D, 10000.0).rows(torch.tensor([0, 3, 17, 400, 401]), 401, dtype))
    norms = (wq, wk, 1e-6, False) if with_norm else ()
    q, k = fused.qk_norm_rope(qk, Hq, cos, sin, *norms)
    assert q.shape == (T, Hq, D) and k.shape == (T, Hkv, D) and q.is_contiguous() and k.is_contiguous()
    def alone(x, w):
        return fused.qk_norm_rope(x, x.shape[1], cos, sin, *((w, w, 1e-6, False) if with_norm else ()))[0]
    assert torch.equal(q, alone(qk[:, :Hq], wq)) and torch.equal(k, alone(qk[:, Hq:], wk))
    if with_norm:
        assert not torch.equal(k, alone(qk[:, Hq:], wq))


def test_masked_logits_keeps_exactly_the_tokens_the_bits_allow():
    """A row's logits where bit ``t % 32`` of word ``t // 32`` is set (the
    sign bit too), -inf elsewhere and for a NaN, +inf and -inf kept where
    allowed: read bit by bit in Python, over two programs a row, strided
    logits and bitmask rows wider than the logits need."""
    rows, n = 3, 1500
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, n + 7, generator=g)[:, :n]  # (a row stride that is not the width)
    logits[0, 5], logits[1, 40], logits[2, 1499] = float("nan"), float("inf"), float("-inf")
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, (n + 31) // 32 + 3), generator=g, dtype=torch.int32)
    words[1, 1] |= 1 << 8  # token 40 (+inf) allowed
    bits = words.tolist()
    want = torch.tensor([[float("-inf") if not (bits[r][t // 32] >> (t % 32)) & 1 or logits[r, t] != logits[r, t]
                          else float(logits[r, t]) for t in range(n)] for r in range(rows)])
    got = fused.masked_logits(logits.to(DEVICE), words.to(DEVICE)).cpu()
    assert torch.equal(got, want) and got[1, 40] == float("inf") and bool(torch.isinf(got).any(-1).all())
    assert 0.3 < float(torch.isfinite(got).float().mean()) < 0.7


@pytest.mark.parametrize("fmt", ["none", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_norm_rope_stores_the_keys_and_values_write_kv_stores(fmt, dtype):
    """With a target (a layer's pools and the step's slots) the launch also
    stores k and v: the pools (8-bit codes and scales too, head-major for
    the 8-bit formats) hold the bits `write_kv` stores for the k the launch
    gives without one, q is the same, and a negative slot writes nothing."""
    from pagedlm.cache import kv_quant as kvq
    from pagedlm.cache.paged import PagedPools

    T, Hq, Hkv, D, BS = 5, 4, 2, 64, 4
    qkv = randn(T, Hq + 2 * Hkv, D, dtype=dtype, seed=7)
    qk, v = qkv[:, : Hq + Hkv], qkv[:, Hq + Hkv :]
    norms = tuple(torch.randn(D, generator=torch.Generator().manual_seed(s)).to(dtype).to(DEVICE) for s in (8, 9))
    cos, sin = (t.to(DEVICE) for t in RoPE(D, 10000.0).rows(torch.tensor([0, 3, 17, 400, 401]), 401, dtype))
    slots = torch.tensor([3, 9, -1, 0, 14], device=DEVICE)
    want, got = (PagedPools([0], 4, BS, Hkv, D, dtype, DEVICE, kv_quant=fmt, fused=True) for _ in range(2))
    q, k = fused.qk_norm_rope(qk, Hq, cos, sin, *norms, 1e-6, False)
    want.write(0, k, v, slots)
    q_too, none = fused.qk_norm_rope(qk, Hq, cos, sin, *norms, 1e-6, False, v=v, target=got.target(0, slots))
    assert none is None and torch.equal(q_too, q)
    pools = [(want.k[0], got.k[0]), (want.v[0], got.v[0])]
    if fmt != "none":
        assert got.orders == kvq.HEAD_MAJOR
        pools += [(want.k_scale[0], got.k_scale[0]), (want.v_scale[0], got.v_scale[0])]
    for a, b in pools:
        assert torch.equal(kvq.as_bytes(a.contiguous()), kvq.as_bytes(b.contiguous()))
    written = kvq.as_bytes(got.k[0][[0, 2, 0, 3], [3, 1, 0, 2]].contiguous()).reshape(4, -1)
    assert bool((written != 0).any(-1).all())  # the four real slots hold keys


def test_a_kv_target_needs_the_values():
    from pagedlm.cache.paged import PagedPools

    pools = PagedPools([0], 2, 4, 1, 64, torch.float32, DEVICE, fused=True)
    x = randn(2, 3, 64, dtype=torch.float32)
    cos = sin = torch.ones(2, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="needs values"):
        fused.qk_norm_rope(x, 2, cos, sin, target=pools.target(0, torch.tensor([0, 1], device=DEVICE)))


def test_gumbel_pick_reads_special_logits_as_the_torch_sampler_does():
    """`fused.gumbel_pick` (rows drawn from softmax(logits / T) in one
    launch): a row's +inf tokens are its only candidates; -inf and NaN ones
    are never drawn unless no other is (then any token is); rows with
    inverse temperature 0 keep what ``out`` held; a vocabulary over one
    block reaches its last token; rows draw independently."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[-inf, nan, 1.0, -inf, 0.5],
                           [0.0, inf, 3.0, inf, nan],
                           [-inf, nan, -inf, -inf, nan],
                           [1.0, 2.0, 3.0, 4.0, 5.0]]).repeat(60, 1).to(DEVICE)
    inverse = torch.tensor([1.0, 1.0, 1.0, 0.0] * 60, device=DEVICE)
    out = torch.full((240,), 7, dtype=torch.long, device=DEVICE)
    drawn = fused.gumbel_pick(logits, inverse, out, seed=3).view(60, 4).cpu()
    assert set(drawn[:, 0].tolist()) == {2, 4}  # the finite ones (softmax: 0.62 / 0.38)
    assert set(drawn[:, 1].tolist()) == {1, 3}  # the +inf ones, both drawn
    assert len(set(drawn[:, 2].tolist())) >= 4  # nothing finite: any of the 5
    assert set(drawn[:, 3].tolist()) == {7}  # greedy rows: left alone
    wide = torch.zeros(2, 5000, device=DEVICE)
    wide[0, 4999] = 60.0  # the last token of a vocabulary of two blocks and a bit: always drawn
    picked = fused.gumbel_pick(wide, torch.ones(2, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE), 5)
    assert picked[0] == 4999 and 0 <= picked[1] < 5000
    spread = fused.gumbel_pick(torch.zeros(200, 5000, device=DEVICE), torch.ones(200, device=DEVICE),
                               torch.zeros(200, dtype=torch.long, device=DEVICE), 11)
    assert len(set(spread.tolist())) > 150 and spread.max() >= 4096  # flat rows: draws all over, past block one
