"""The few-row product kernel (``kernels.gemv``) against float64, the
activation folded in against ``fused.act_mul`` then the product, and a
row's result independent of the rows beside it.

Interpreted here (``TRITON_INTERPRET=1``: float32 and float16); on CUDA
it runs compiled (``tests/gpu/test_gemv_gpu.py`` in bfloat16, and every
model test of ``tests/gpu`` at batch sizes up to 16).
"""

from __future__ import annotations

import pytest
import torch

from pagedlm.kernels import fused, gemv
from tests.fast.kernel_refs import requires_triton
from tests.helpers import DEVICE

pytestmark = requires_triton


def randn(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def within_rounding(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype, k: int) -> bool:
    """``got`` is ``want64`` to within the output's one rounding plus float32 sums of ``k`` terms."""
    want = want64.double()
    ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -23
    tol = ulp * want.abs() + 1e-6 * k ** 0.5 * (1.0 + want.abs())
    return bool(((got.double().cpu() - want.cpu()).abs() <= tol.cpu()).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(1, 64, 256), (3, 100, 300), (16, 48, 40), (5, 33, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_is_the_product_to_its_rounding(dtype, rows, n, k, bias):
    x = randn(rows, k, dtype=dtype, seed=1)
    w = randn(n, k, dtype=dtype, seed=2, scale=0.1)
    b = randn(n, dtype=dtype, seed=3) if bias else None
    got = gemv.linear(x, w, b)
    want = x.double() @ w.double().T + (b.double() if bias else 0.0)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert within_rounding(got, want, dtype, k)
    if bias:  # the bias is in it
        assert not within_rounding(got, want - b.double(), dtype, k)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,k", [(1, 96), (1, 1024), (4, 96), (4, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_activation_inside_is_the_product_then_act_mul_bit_for_bit(activation, dtype, rows, k, bias):
    x = randn(rows, k, dtype=dtype, seed=4)
    w = randn(2 * 72, k, dtype=dtype, seed=5, scale=0.5)
    b = randn(2 * 72, dtype=dtype, seed=6) if bias else None
    got = gemv.linear(x, w, b, act=activation)
    gate_up = gemv.linear(x, w, b)
    assert got.shape == (rows, 72)
    assert torch.equal(got, fused.act_mul(gate_up, activation))
    assert not torch.equal(got, gate_up[:, :72] * gate_up[:, 72:])  # it did apply the activation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_rows_result_ignores_the_rows_beside_it(dtype):
    """From 2 to 16 rows (the tensor-core kernel); one row alone takes the other kernel."""
    x = randn(16, 320, dtype=dtype, seed=6)
    w = randn(200, 320, dtype=dtype, seed=7, scale=0.1)
    together = gemv.linear(x, w)
    other = randn(16, 320, dtype=dtype, seed=8)
    other[9] = x[9]
    assert torch.equal(gemv.linear(other, w)[9], together[9])
    assert torch.equal(gemv.linear(x[:7], w), together[:7])
    assert torch.equal(gemv.linear(x[8:10], w), together[8:10])


def test_gemv_keeps_leading_dims_and_refuses_what_it_cannot_take():
    x = randn(2, 3, 64, dtype=torch.float32)
    w = randn(40, 64, dtype=torch.float32, seed=1)
    assert gemv.linear(x, w).shape == (2, 3, 40)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv.linear(randn(17, 64, dtype=torch.float32), w)
    with pytest.raises(ValueError, match="at most 16 rows of 64"):
        gemv.linear(randn(1, 32, dtype=torch.float32), w)
    with pytest.raises(ValueError, match="an even number of output rows for silu"):
        gemv.linear(x, randn(41, 64, dtype=torch.float32), act="silu")


def test_usable_takes_few_rows_of_float_weights_on_cuda_only():
    w = torch.zeros(8, 4)
    assert not gemv.usable(torch.zeros(1, 4), w)  # the CPU keeps its own products
    if torch.cuda.is_available():
        wc = w.cuda()
        assert gemv.usable(torch.zeros(16, 4, device="cuda"), wc)
        assert not gemv.usable(torch.zeros(17, 4, device="cuda"), wc)
        assert not gemv.usable(torch.zeros(1, 4, device="cuda", dtype=torch.float16), wc)
        assert not gemv.usable(torch.zeros(1, 4, device="cuda"), None)  # quantized: no float weight
