"""The few-row product kernel (``kernels.gemv``) compiled, in bfloat16, on
the benchmark models' decode shapes, and the layers that route to it.

The oracle is float64: the kernel sums in float32 and rounds once, so it
lands within one bfloat16 rounding of it (plus float32 noise), as cuBLAS does.
"""

import pytest
import torch
import torch.nn.functional as F

from pagedlm.kernels import fused, gemv
from pagedlm.models.layers import GatedMLP, Linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPES = [(4096, 1024), (1024, 3072), (1536, 640), (640, 2048), (6144, 4096), (4096, 14336), (151936, 1024)]


def bf16_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    want = want.double()
    return bool(((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-3).all())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_gemv_bf16_is_the_product_to_one_rounding(n, k, rows):
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    got = gemv.linear(x, w, b)
    assert bf16_close(got, x.double() @ w.double().T + b.double())
    if rows > 2:  # the tensor-core kernel's rows are independent
        assert torch.equal(gemv.linear(x[1:3], w, b), got[1:3])


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_with_the_activation_is_the_product_then_act_mul(activation, rows):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(rows, 1024, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * 3072, 1024, device="cuda", generator=g) * 0.05).bfloat16()
    assert torch.equal(gemv.linear(x, w, act=activation), fused.act_mul(gemv.linear(x, w), activation))


def test_weights_past_max_bytes_stay_with_cublas():
    x = torch.zeros(1, 8192, device="cuda", dtype=torch.bfloat16)
    rows = gemv.max_bytes(x.device) // (8192 * 2)
    assert gemv.usable(x, torch.empty(rows, 8192, device="cuda", dtype=torch.bfloat16))
    assert not gemv.usable(x, torch.empty(rows + 1, 8192, device="cuda", dtype=torch.bfloat16))


def test_layers_take_the_kernel_up_to_16_rows_and_cublas_past_them():
    torch.manual_seed(0)
    lin = Linear(512, 768, bias=True).cuda().bfloat16()
    mlp = GatedMLP(512, 1024, "silu").cuda().bfloat16()
    for rows in (1, 16, 17):
        x = torch.randn(rows, 512, device="cuda").bfloat16()
        if rows <= gemv.ROWS:
            want = gemv.linear(x, lin.weight, lin.bias)
            want_mlp = gemv.linear(gemv.linear(x, mlp.gate_up_proj.weight, act="silu"), mlp.down_proj.weight)
        else:
            want = F.linear(x, lin.weight, lin.bias)
            want_mlp = F.linear(fused.act_mul(F.linear(x, mlp.gate_up_proj.weight), "silu"), mlp.down_proj.weight)
        assert torch.equal(lin(x), want)
        assert torch.equal(mlp(x), want_mlp)
