"""The integer CPU quantized products (``kernels.cpu_quant``): against a
float64 reference of the same integer math, against torch's int4 / int8
products within the bound of the activations' 8-bit rounding, on the
AVX-512 VNNI build and the AVX2 one (both where the CPU has them)."""

from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch

from pagedlm.kernels import cpu_quant
from pagedlm.kernels.quant import QuantizedWeight, dequantize, quantize, unpack_int4
from pagedlm.options import OptionError

# Where the kernel can be built (x86-64 with AVX2 and a C++ compiler: CI's machines) it must be:
# a failed build fails these tests instead of skipping them.
CAN_BUILD = (platform.machine().lower() in ("x86_64", "amd64") and "avx2" in cpu_quant._cpu_flags().split()
             and bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")))
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="no integer CPU kernel here (not x86-64, no AVX2 or no compiler)")


def test_the_kernel_builds_and_loads_where_it_can():
    assert cpu_quant.library() and hasattr(torch.ops.pagedlm, "cpu_quant_mm")
AVX2 = ("-O3", "-mavx2", "-mfma", "-DPAGEDLM_OPS=pagedlm_avx2")  # the AVX2 path, under its own op namespace


def _namespaces() -> list[str]:
    """This CPU's build (AVX-512 VNNI here), and the AVX2 build beside it."""
    if "avx2" not in cpu_quant._cpu_flags():
        return ["pagedlm"]
    if not hasattr(torch.ops.pagedlm_avx2, "cpu_quant_mm"):
        torch.ops.load_library(str(cpu_quant.build(AVX2)))
    return ["pagedlm", "pagedlm_avx2"]


def _quantize_acts(x: torch.Tensor):
    """llama.cpp's Q8 scheme as the kernel computes it, in float32: per group of 32,
    ``d = max|x| / 127``, ``a = round_half_even(x * (127 / max|x|))``."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)  # (``127 / amax`` is 127 * (1 / amax))
    a = torch.round(g * inv[..., None])
    return a, amax / 127


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64: the quantized activations times the float64 weight ``w [N, K]``."""
    a, d = _quantize_acts(x)
    return torch.einsum("mgj,ngj,mg->mn", a.double(), w.double().reshape(w.shape[0], -1, 32), d.double())


def _call(namespace: str, x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, threads: int) -> torch.Tensor:
    return _on_threads(threads, getattr(torch.ops, namespace).cpu_quant_mm, x, tiles, scales)


def _on_threads(threads: int, op, *args) -> torch.Tensor:
    """``op(*args)`` with torch's intra-op threads (the kernels' OpenMP threads) set to ``threads``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return op(*args)
    finally:
        torch.set_num_threads(before)


def _weights(mode: str, n: int, k: int, seed: int):
    """(tiles, kernel scales, the float64 weight the kernel stands for)."""
    g = torch.Generator().manual_seed(seed)
    if mode == "int4":
        codes = torch.randint(0, 16, (n, k), generator=g)
        scales = (torch.rand(n, k // 32, generator=g) + 0.1).bfloat16()
        zeros = torch.randn(n, k // 32, generator=g).bfloat16()
        tiles, sz = cpu_quant.pack_int4(codes, torch.stack((scales, zeros), -1))
        w = (codes.double() - 8) * scales.double().repeat_interleave(32, 1) + zeros.double().repeat_interleave(32, 1)
        return tiles, sz, w
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[0] = -127  # the extremes: 2 * 127 * 127 is where AVX2's int16 pair sums would saturate
    q[1] = 127
    scale = torch.rand(n, generator=g) + 0.01
    return cpu_quant.pack_int8(q), scale, q.double() * scale.double()[:, None]


def _acts(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :32] = 0  # a group of zeros: d = 0
    x[-1, 32:64] = -x[-1, 32:64].abs() - 1  # a negative group, its max code -127
    return x


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 6, 9])  # one, and passes of 4 rows with tails
def test_kernel_is_the_integer_math_of_its_quantized_activations(mode, rows):
    """Tight enough (1e-6 of the terms' sum) that a wrong nibble order, a wrong
    scale or zero, a wrong sum(a) correction or a dropped tail row fails."""
    n, k = 48, 96  # 3 tiles of 16 rows, 3 groups
    tiles, scales, w = _weights(mode, n, k, seed=rows)
    x = _acts(rows, k, seed=10 + rows)
    ref = _reference(x, w)
    a, d = _quantize_acts(x)
    scale_of_terms = torch.einsum("mgj,ngj,mg->mn", a.abs().double(), w.abs().reshape(n, -1, 32), d.double())
    for namespace in _namespaces():
        for threads in (1, 2):
            y = _call(namespace, x, tiles, scales, threads).double()
            assert ((y - ref).abs() <= 1e-6 * scale_of_terms + 1e-9).all(), (namespace, threads)
    if mode == "int4":  # the bound sees a swapped nibble order
        swapped = (tiles >> 4) | (tiles << 4)
        assert ((_call("pagedlm", x, swapped, scales, 2).double() - ref).abs() > 1e-6 * scale_of_terms + 1e-9).any()


def test_activation_quantization_is_llama_cpp_q8():
    x = _acts(3, 128, seed=5)
    x[1, 5] = 0.5 * (x[1].abs()[:32].max() / 127)  # exactly half a step: rounds to even (0)
    a, d, s = torch.ops.pagedlm.cpu_quant_q8(x)
    want_a, want_d = _quantize_acts(x)
    assert torch.equal(a.reshape(3, 4, 32).float(), want_a) and torch.equal(d, want_d)
    assert torch.equal(s, want_a.sum(-1).int())
    assert a.abs().max() == 127 and d[0, 0] == 0


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_layer_matches_torch_products_within_activation_rounding(mode, monkeypatch):
    """The layer on the kernel against the same stored weight on torch's
    kernels. Per group the kernel's input is off by at most d / 2 (d = max|x| /
    127), torch's by its bfloat16 rounding (2^-9 relative), and torch's int4
    result is bfloat16 (2^-9 of |y|): the bound is the sum of those, and it is
    tight enough that a row scale of the wrong row breaks it."""
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(3))
    stored = quantize(w, mode)
    ours = QuantizedWeight.from_stored(stored, (96, 160), "cpu")
    monkeypatch.setenv("PAGEDLM_CPU_QUANT", "0")
    theirs = QuantizedWeight.from_stored(stored, (96, 160), "cpu")
    assert hasattr(ours, "tiles") and not hasattr(theirs, "tiles")
    w_abs = dequantize(stored).abs()
    x = _acts(5, 160, seed=4)
    _, d = _quantize_acts(x)
    y, t = ours.linear(x), theirs.linear(x)
    bound = (0.5 * d.repeat_interleave(32, 1)) @ w_abs.T + 2**-8 * (x.abs() @ w_abs.T) + 2**-8 * t.abs() + 1e-5
    assert ((y - t).abs() <= bound).all()
    if mode == "int8":
        ours.scales.copy_(ours.scales.roll(1))
        assert ((ours.linear(x) - t).abs() > bound).any()


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_tiles_replace_torch_layout_without_more_memory(mode, monkeypatch):
    w = torch.randn(64, 128)
    stored = quantize(w, mode)
    ours = QuantizedWeight.from_stored(stored, (64, 128), "cpu")
    monkeypatch.setenv("PAGEDLM_CPU_QUANT", "0")
    theirs = QuantizedWeight.from_stored(stored, (64, 128), "cpu")
    assert not any(hasattr(ours, name) for name in ("packed", "scales_and_zeros", "qweight", "kernel_scales"))
    assert ours.nbytes() <= theirs.nbytes()


def test_int8_rows_come_back_from_the_tiles():
    q = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
    ids = torch.tensor([0, 17, 47, 17])
    assert torch.equal(cpu_quant.unpack_int8_rows(cpu_quant.pack_int8(q), ids), q[ids])


def test_int4_tiles_hold_the_stored_codes():
    """pack_int4 of the stored codes: chunk c, row r, byte b holds inputs 4c + b
    (low nibble) and 16 + 4c + b (high) of row r."""
    stored = quantize(torch.randn(32, 64), "int4")
    codes = unpack_int4(stored["qweight"])
    tiles, _ = cpu_quant.pack_int4(codes, torch.zeros(32, 2, 2, dtype=torch.bfloat16))
    tile, group, c, r, b = 1, 1, 2, 5, 3
    byte = int(tiles[tile, group, c, r, b])
    row, col = 16 * tile + r, 32 * group + 4 * c + b
    assert byte & 15 == codes[row, col] and byte >> 4 == codes[row, col + 16]


def test_build_failure_is_one_line_and_falls_back(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_quant._library.__wrapped__() is False  # the uncached build and load
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-compiler" in err and "using torch's" in err


def test_off_switch_keeps_torch_layout(monkeypatch):
    monkeypatch.setenv("PAGEDLM_CPU_QUANT", "0")
    qw = QuantizedWeight.from_stored(quantize(torch.randn(32, 64), "int4"), (32, 64), "cpu")
    assert hasattr(qw, "packed") and not hasattr(qw, "tiles")


@pytest.mark.parametrize("heads, dim, length", [((9, 3), 64, 1), ((9, 3), 64, 200), ((4, 1), 256, 700),
                                                ((8, 8), 64, 64), ((8, 2), 32, 65), ((6, 2), 40, 33),
                                                ((4, 2), 36, 70), ((32, 1), 64, 40)])
@pytest.mark.parametrize("ns", ["pagedlm", "pagedlm_avx2"])
def test_decode_attention_is_attention_over_every_key(heads, dim, length, ns):
    """The compiled one-row step's attention op against float64 softmax
    attention (query head h on KV head h // group), on strided views like the
    store's (token-major rows of a longer buffer), one thread and two: the same
    bits. Both builds: AVX-512's vector splits (16 keys' scores at once, its
    own exp) and AVX2's (8 at once); the plain loops where the head size is
    not a multiple of the vector (40 on AVX-512, 36 on both) or a KV head has
    more than 16 query heads."""
    if ns not in _namespaces():
        pytest.skip("no AVX2 on this CPU")
    hq, hkv = heads
    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, hq, dim, generator=g)
    k, v = (torch.randn(length + 9, hkv, dim, generator=g)[3 : 3 + length] for _ in range(2))
    kv_head = torch.arange(hq) // (hq // hkv)
    scores = torch.einsum("hd,shd->hs", q[0].double(), k[:, kv_head].double()) * 0.125
    ref = torch.einsum("hs,shd->hd", scores.softmax(-1), v[:, kv_head].double())
    assert cpu_quant.library()
    outs = [_on_threads(threads, getattr(torch.ops, ns).decode_attention, q, k, v, 0.125) for threads in (1, 2)]
    assert outs[0].shape == (1, hq, dim) and torch.allclose(outs[0][0].double(), ref, atol=1e-5, rtol=0)
    assert torch.equal(outs[0], outs[1])


def test_the_kernel_switch_reads_every_switch_spelling_and_refuses_others(monkeypatch):
    """(Any value but "0" once left the kernel on: "false", "off", "maybe".)"""
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("PAGEDLM_CPU_QUANT", off)
        assert not cpu_quant.library()
    monkeypatch.setenv("PAGEDLM_CPU_QUANT", "on")
    assert cpu_quant.library()
    monkeypatch.setenv("PAGEDLM_CPU_QUANT", "maybe")
    with pytest.raises(OptionError, match="PAGEDLM_CPU_QUANT must be one of"):
        cpu_quant.library()
    from pagedlm import options as opt  # and before any weight loads (in one, it read as theirs)

    with pytest.raises(OptionError, match="^PAGEDLM_CPU_QUANT must be one of"):
        opt.resolve_quantization("int8")
    with pytest.raises(OptionError, match="^PAGEDLM_CPU_QUANT must be one of"):
        opt.ServerOptions.resolve({"device": "cpu"})
