"""Weight-only quantization: the stored format, the kernels, the cache, the flag.

Bounds are derived, not fitted:
- stored format: round-to-nearest on a grid of step ``s`` is off by at most
  ``s / 2`` per weight (int8: ``s = max|row| / 127``; int4: ``s = (max - min)
  / 15`` per group of 32);
- kernels: torch's weight-only products take bfloat16 activations, scales
  and zeros, and return bfloat16 on the CPU; each rounding is a relative
  ``2**-9`` at most, so the product is within ``4 * 2**-9 * (|x| @ |W|^T)``
  (plus float32 accumulation noise) of ``x @ W_deq^T`` in float32. A wrong
  nibble order, zero point or scale row moves it by the order of
  ``|x| @ |W|^T`` itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedlm import options as opt
from pagedlm.batch.solo import Solo
from pagedlm.cli import main
from pagedlm.options import cache_dir
from pagedlm.kernels.quant import ALIGN, GROUP_SIZE, QuantizedWeight, dequantize, quantize
from pagedlm.loading import load, load_model
from pagedlm.loading import quant as lq
from pagedlm.loading.errors import LoadError
from pagedlm.models import build_model

KERNEL_REL = 4 * 2.0**-9


def _weight(n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] *= 40  # an outlier row: per-row scales must not leak across rows
    w[5, :GROUP_SIZE] = 0.125  # a constant group (zero range)
    return w


def test_int8_round_trip_is_within_half_a_step_per_row():
    w = _weight()
    t = quantize(w, "int8")
    assert t["qweight"].dtype == torch.int8 and t["scales"].shape == (w.shape[0],)
    err = (dequantize(t) - w).abs()
    assert (err <= t["scales"][:, None] / 2 * (1 + 1e-5)).all()


def test_int8_scales_are_the_bfloat16_values_the_kernel_reads():
    """The kernel rounds scales to bfloat16; codes are rounded against that scale,
    the smallest bfloat16 at or above max|w_row| / 127, so no code overflows."""
    w = _weight()
    scales = quantize(w, "int8")["scales"]
    assert torch.equal(scales.to(torch.bfloat16).float(), scales)
    exact = w.abs().amax(1) / 127
    below = (scales.to(torch.bfloat16).view(torch.int16) - 1).view(torch.bfloat16).float()
    assert (scales >= exact).all() and (below < exact).all()


def test_int4_round_trip_is_within_half_a_step_per_group():
    w = _weight()
    t = quantize(w, "int4")
    assert t["qweight"].shape == (w.shape[0], w.shape[1] // 2) and t["qweight"].dtype == torch.uint8
    step = t["scales"].repeat_interleave(GROUP_SIZE, 1)
    err = (dequantize(t) - w).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert torch.equal(dequantize(t)[5, :GROUP_SIZE], w[5, :GROUP_SIZE])  # constant group exact


def test_int4_keeps_weights_already_on_a_4bit_grid():
    """GGUF Q4_K / Q4_1 blocks are ``q * scale + min`` over 32 weights: they come back."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (32, 64), generator=g).float()
    q[:, ::GROUP_SIZE] = 0
    q[:, 1::GROUP_SIZE] = 15  # every group spans the full range
    scale = torch.rand(32, 64 // GROUP_SIZE, generator=g) + 0.1
    low = torch.randn(32, 64 // GROUP_SIZE, generator=g)
    w = q * scale.repeat_interleave(GROUP_SIZE, 1) + low.repeat_interleave(GROUP_SIZE, 1)
    torch.testing.assert_close(dequantize(quantize(w, "int4")), w, rtol=1e-6, atol=1e-6)


def test_int4_falls_back_to_int8_for_shapes_the_kernel_refuses():
    assert "mins" not in quantize(torch.randn(24, 64), "int4")  # 24 rows: not a multiple of 16
    assert "mins" not in quantize(torch.randn(32, 48), "int4")  # 48 inputs: not a multiple of 32


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5])
def test_quantized_linear_matches_float_reference_within_bfloat16_bound(mode, rows):
    w = _weight()
    stored = quantize(w, mode)
    qw = QuantizedWeight.from_stored(stored, tuple(w.shape), "cpu")
    x = torch.randn(2, rows, w.shape[1], generator=torch.Generator().manual_seed(2))
    bias = torch.randn(w.shape[0])
    y = qw.linear(x, bias)
    w_deq = dequantize(stored)
    ref = x @ w_deq.T + bias
    bound = KERNEL_REL * (x.abs() @ w_deq.abs().T) + 1e-5
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert ((y - ref).abs() <= bound).all()
    # and the bound is tight enough to see a real mistake: a swapped nibble order
    swapped = dict(stored)
    if mode == "int4":
        swapped["qweight"] = (stored["qweight"] >> 4) | (stored["qweight"] << 4)
    else:
        swapped["scales"] = stored["scales"].roll(1)
    wrong = QuantizedWeight.from_stored(swapped, tuple(w.shape), "cpu").linear(x, bias)
    assert ((wrong - ref).abs() > bound).any()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_embedding_rows_are_the_dequantized_rows(mode):
    w = _weight()
    stored = quantize(w, mode)
    qw = QuantizedWeight.from_stored(stored, tuple(w.shape), "cpu", rows=True)
    ids = torch.tensor([[0, 3, 5], [95, 3, 1]])
    assert torch.equal(qw.rows(ids, torch.float32), dequantize(stored)[ids])


def test_model_to_dtype_leaves_kernel_layout_alone():
    w = _weight()
    qw = QuantizedWeight.from_stored(quantize(w, "int4"), tuple(w.shape), "cpu")
    scales = qw.linear_buffers()[-1]  # the kernel's bfloat16 scales and zeros (torch's or cpu_quant's)
    before = scales.clone()
    torch.nn.Sequential(qw).to(torch.float32)
    assert scales.dtype == torch.bfloat16 and torch.equal(qw.linear_buffers()[-1], before)


# ---------------------------------------------------------------- whole models

CONFIGS = {
    "llama-tied": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=True),
    "qwen2-untied-bias": dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                              rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False),
    "gemma3": dict(model_type="gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=2,
                   layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                   query_pre_attn_scalar=32, max_position_embeddings=128),
}


def _folder(tmp_path, name):
    """A tiny model folder (config.json + model.safetensors) with random weights."""
    config = CONFIGS[name]
    torch.manual_seed(0)
    model = build_model(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(0.0, 0.05 if p.dim() == 2 else 0.3)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    return folder


def _logits(model, ids):
    return Solo(model)(ids)


PROMPT = [1, 7, 42, 99, 3, 200, 17, 5, 64, 128, 11]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cached_conversion_round_trips_and_matches_in_memory_quantization(name, mode, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = _folder(tmp_path, name)
    model = lq.load_quantized(folder, mode, "cpu", torch.float32)
    path = lq.quantized_path(folder, mode)
    assert path.is_file()
    # every Linear / Embedding holds quantized bytes and no float weight
    layers = lq.quantizable(model)
    assert layers and all(m.weight is None and m.quant is not None for m in layers.values())
    assert {m.quant.mode for m in layers.values()} == {mode}
    # the second load reads the cache and converts nothing
    monkeypatch.setattr(lq, "convert", lambda *a, **k: pytest.fail("converted twice"))
    again = lq.load_quantized(folder, mode, "cpu", torch.float32)
    # same bits as quantizing the float model in memory
    float_model = load_model(folder, "cpu", torch.float32)
    reference = lq.quantize_model(load_model(folder, "cpu", torch.float32), mode)
    assert torch.equal(_logits(model, PROMPT), _logits(reference, PROMPT))
    assert torch.equal(_logits(again, PROMPT), _logits(model, PROMPT))
    assert lq.weight_bytes(model) < lq.weight_bytes(float_model) / (3 if mode == "int8" else 5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cached_tensors_start_aligned_whatever_the_length_of_the_source_path(mode, tmp_path, monkeypatch):
    """The cache's header names the source folder, so the folder path's length
    moves every tensor's offset (issue 27: an int8 weight 8 or 40 bytes past a
    64-byte boundary crashed torch's CPU int8 product). Eight folder names 8
    bytes apart in length give the header every length mod 64 that
    safetensors' own 8-byte padding leaves."""
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    source = _folder(tmp_path, "llama-tied")
    reference = _logits(lq.quantize_model(load_model(source, "cpu", torch.float32), mode), PROMPT)
    for i in range(8):
        folder = tmp_path / ("m" * (1 + 8 * i))
        shutil.copytree(source, folder)
        model = lq.load_quantized(folder, mode, "cpu", torch.float32)
        with safe_open(lq.quantized_path(folder, mode), "pt") as f:
            misaligned = {k: f.get_tensor(k).data_ptr() % ALIGN for k in f.keys() if not k.startswith(lq.PAD)}
        assert misaligned == dict.fromkeys(misaligned, 0), folder.name
        assert all(b.data_ptr() % ALIGN == 0 for m in lq.quantizable(model).values() for b in m.quant.buffers())
        assert torch.equal(_logits(model, PROMPT), reference)  # the kernels ran on the mapped weights


def test_aligned_file_reads_back_every_dtype_and_odd_size(tmp_path):
    g = torch.Generator().manual_seed(5)
    tensors = {"a": torch.randn(3, generator=g).to(torch.bfloat16), "b": torch.tensor(True),
               "c": torch.randint(-9, 9, (5, 7), generator=g, dtype=torch.int8), "d": torch.zeros(0, 4),
               "e": torch.randn(2, 3, generator=g).half(), "f": torch.arange(3, dtype=torch.int64)}
    path = tmp_path / "x.safetensors"
    lq.save_aligned(tensors, path, {"source": "/a/path"})
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"source": "/a/path"}
        back = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(lq.PAD)}
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
        assert back[name].numel() == 0 or back[name].data_ptr() % ALIGN == 0, name


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernel_buffers_are_aligned_copies_of_misaligned_stored_tensors(mode):
    """A cache file written before the aligned layout (or any misaligned view)
    is copied at load, never handed to a kernel as it is."""
    w = _weight()
    stored = quantize(w, mode)
    shifted = {}
    for name, t in stored.items():
        raw = torch.empty(t.numel() * t.element_size() + 8, dtype=torch.uint8)
        shifted[name] = raw[8:].view(t.dtype).view(t.shape).copy_(t)  # 8 bytes past an aligned allocation
    assert all(t.data_ptr() % ALIGN for t in shifted.values())
    qw = QuantizedWeight.from_stored(shifted, tuple(w.shape), "cpu", rows=True)
    assert all(b.data_ptr() % ALIGN == 0 for b in qw.buffers())
    x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(3))
    assert torch.equal(qw.linear(x), QuantizedWeight.from_stored(stored, tuple(w.shape), "cpu").linear(x))


def test_a_changed_source_is_converted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = _folder(tmp_path, "llama-tied")
    first = lq.quantized_path(folder, "int8")
    save_file({"x": torch.zeros(1)}, folder / "model.safetensors")
    assert lq.quantized_path(folder, "int8") != first


def test_an_unwritable_cache_is_a_load_error_naming_it(tmp_path, monkeypatch):
    """(Was NotADirectoryError's traceback.) An empty PAGEDLM_CACHE_DIR is unset, as everywhere."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(blocker))
    folder = _folder(tmp_path, "llama-tied")
    with pytest.raises(LoadError, match=r"cannot write the quantized weights' cache .*set PAGEDLM_CACHE_DIR"):
        lq.convert(folder, "int8", lq.quantized_path(folder, "int8"))
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", "")
    assert cache_dir() == Path.home() / ".cache" / "pagedlm"


# ---------------------------------------------------------------- flag and environment


def test_quantization_is_none_by_default_and_flag_beats_env():
    assert opt.resolve_quantization(None, {}) == "none"
    assert opt.resolve_quantization(None, {opt.QUANTIZATION_ENV: "int4"}) == "int4"
    assert opt.resolve_quantization("int8", {opt.QUANTIZATION_ENV: "int4"}) == "int8"
    assert opt.resolve_quantization("none", {opt.QUANTIZATION_ENV: "int4"}) == "none"


def test_bad_quantization_values_are_option_errors():
    with pytest.raises(opt.OptionError, match="--quantization must be none, int8, int4"):
        opt.resolve_quantization("int3", {})
    with pytest.raises(opt.OptionError, match=opt.QUANTIZATION_ENV):
        opt.resolve_quantization(None, {opt.QUANTIZATION_ENV: "fp8"})
    with pytest.raises(opt.OptionError):
        load("gemma3-270m", quantization="q4")  # checked before anything is resolved or read


def test_server_takes_quantization_from_flag_or_env():
    assert opt.ServerOptions.resolve({}, {}).quantization == "none"
    assert opt.ServerOptions.resolve({}, {opt.QUANTIZATION_ENV: "int8"}).quantization == "int8"
    assert opt.ServerOptions.resolve({"quantization": "int4"}, {opt.QUANTIZATION_ENV: "int8"}).quantization == "int4"


@pytest.mark.parametrize("argv", [
    ["generate", "--quantization", "int3", "hi"],
    ["bench", "ppl", "--quantization", "int8,q4"],
    ["bench", "decode", "--quantization", "fp4"],
])
def test_cli_rejects_bad_quantization_in_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "quantization must be" in err and err.count("\n") == 1


def test_int8_prompt_chunks_on_the_cpu_multiply_in_float32(monkeypatch):
    """Torch's products (no integer kernel here): from CPU_GEMM_ROWS rows the
    weight is dequantized and the product is MKL's float32 one (the kernel's
    bf16 activations would be ~1e-3 off)."""
    from pagedlm.kernels.quant import CPU_GEMM_ROWS

    monkeypatch.setenv("PAGEDLM_CPU_QUANT", "0")

    w = _weight()
    stored = quantize(w, "int8")
    qw = QuantizedWeight.from_stored(stored, tuple(w.shape), "cpu")
    x = torch.randn(CPU_GEMM_ROWS, w.shape[1], generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(qw.linear(x), x @ dequantize(stored).T, rtol=0, atol=1e-5)
    one_row = qw.linear(x[:1])  # decode: the kernel, bf16 activations
    assert (one_row - x[:1] @ dequantize(stored).T).abs().max() > 1e-5
