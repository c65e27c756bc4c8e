"""Weight-only quantization: int8 per output channel, int4 in groups of 32.

Batch-1 decode reads every weight once per token, so it runs at the speed
of the bytes read: an int4 weight is an eighth of float32. torch ships the
products that read them (``torch._weight_int8pack_mm``,
``torch._weight_int4pack_mm_for_cpu`` on the CPU, ``torch._weight_int4pack_mm``
on CUDA); on an x86 CPU with AVX2 and a C++ compiler the products are
``kernels.cpu_quant``'s integer ones instead (2-4x torch's CPU kernels at
one row, on the same weight numbers). This file holds the one storage
format the conversion cache keeps and turns it into what each kernel wants.

Stored ("portable") format, per ``[N, K]`` weight (``N`` outputs, ``K`` inputs):

- int8: ``qweight`` int8 ``[N, K]``, ``scales`` float32 ``[N]``:
  ``w = qweight * scale``, symmetric, ``scale`` the smallest bfloat16 value
  ``>= max|w_row| / 127`` (the kernel reads its scales in bfloat16, so the
  codes are rounded against the scale it will use).
- int4: ``qweight`` uint8 ``[N, K / 2]``, two 4-bit codes ``q`` in 0..15 per
  byte, the even ``k`` in the high nibble (what ``_convert_weight_to_int4pack``
  takes on CUDA); ``scales``, ``mins`` float32 ``[N, K / 32]``:
  ``w = q * scale + min``. ``quantize`` takes min/max of each group of 32;
  a GGUF's Q4_0 / Q4_1 / Q4_K blocks are 32 weights of exactly this form, and
  ``loading.quant`` stores their own codes, scales and mins (``pack_int4``).

The kernels' form of the same numbers: ``w = (q - 8) * scale + zero`` with
``zero = min + 8 * scale``, scales and zeros interleaved as ``[K/32, N, 2]``.
The CPU kernels take bfloat16 activations only at speed (float32 and float16
ones run a slow path, 5-10x slower here), and scales and zeros in the
activations' dtype: the product rounds ``x``, the int8 scales and the int4
scales and zeros to bfloat16 and returns ``x``'s dtype. The stored int4
numbers stay float32 (embedding rows are dequantized from them exactly).

Every buffer built from stored tensors starts at a multiple of ``ALIGN``
bytes (``aligned``): stored tensors are views into a memory-mapped file,
and torch's CPU int8 product can crash (a segmentation fault, issue 27)
on an int8 weight whose data does not start 64-byte aligned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlm.kernels import cpu_quant
from pagedlm.options import QUANTIZATIONS

GROUP_SIZE = 32  # int4 group; GGUF Q4_K / Q4_1 use 32-weight blocks too
CPU_GEMM_ROWS = 64  # int8 on the CPU: from this many rows (a prompt chunk) dequantize + MKL's GEMM
_PACK_CHUNK = 8192  # rows unpacked at a time when laying int4 out for a kernel
ALIGN = 64  # bytes: where a kernel's buffer may start (torch's CPU allocator aligns to this too)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous, copied if its data does not start at a multiple of ``ALIGN`` bytes."""
    t = t.contiguous()
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def int4_fits(shape: tuple[int, int]) -> bool:
    """Whether torch's int4 kernels take a weight of this shape; others get int8."""
    n, k = shape
    return n % 16 == 0 and k % GROUP_SIZE == 0 and k % 2 == 0


def bfloat16_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value ``>= x``, as float32 (``x`` positive, finite)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)  # bfloat16 is float32's top 16 bits


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> dict[str, torch.Tensor]:
    """Codes ``[N, K]`` (0..15), scales and mins ``[N, K / 32]`` -> the stored int4 tensors."""
    q = codes.to(torch.uint8)
    return {"qweight": (q[:, ::2] << 4) | q[:, 1::2], "scales": scales.float(), "mins": mins.float()}


def quantize(w: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """A float ``[N, K]`` weight -> the stored tensors of ``mode`` (int4 falls
    back to int8 for shapes the int4 kernels do not take, see ``int4_fits``)."""
    w = w.float()
    if mode == "int4" and int4_fits(tuple(w.shape)):
        n, k = w.shape
        groups = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = (hi - lo) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: q = 0
        q = ((groups - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15)
        return pack_int4(q.reshape(n, k), scale, lo)
    if mode in ("int8", "int4"):
        scale = w.abs().amax(1) / 127
        scale = bfloat16_ceil(torch.where(scale > 0, scale, torch.ones_like(scale)))
        q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return {"qweight": q, "scales": scale}
    raise ValueError(f"unknown quantization mode {mode!r} (expected one of {', '.join(QUANTIZATIONS)})")


def stored_mode(tensors: dict[str, torch.Tensor]) -> str:
    return "int4" if "mins" in tensors else "int8"


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> codes int32 ``[N, K]`` (0..15)."""
    q = torch.stack(((qweight >> 4), (qweight & 15)), dim=-1)
    return q.reshape(qweight.shape[0], -1).to(torch.int32)


def dequantize(tensors: dict[str, torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight (or only ``rows`` of it) that the stored tensors stand for."""
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])
    if stored_mode(tensors) == "int8":
        return pick(tensors["qweight"]).float() * pick(tensors["scales"])[..., None]
    qweight = pick(tensors["qweight"])
    q = unpack_int4(qweight.reshape(-1, qweight.shape[-1])).float()
    scales = pick(tensors["scales"]).reshape(q.shape[0], -1).repeat_interleave(GROUP_SIZE, -1)
    mins = pick(tensors["mins"]).reshape(q.shape[0], -1).repeat_interleave(GROUP_SIZE, -1)
    return (q * scales + mins).reshape(*qweight.shape[:-1], -1)


class QuantizedWeight(torch.nn.Module):
    """A quantized ``[N, K]`` weight laid out for one device's kernel.

    ``linear(x)`` is ``F.linear(x, W)``; ``rows(ids)`` dequantizes only the
    looked-up rows (an embedding). Built once at load (``from_stored``); the
    buffers are the kernel's layout, not the stored one, so it is moved
    between devices by loading again, not by ``.to()``.
    """

    def __init__(self, mode: str, shape: tuple[int, int], compute_dtype: torch.dtype):
        super().__init__()
        self.mode, self.shape, self.compute_dtype = mode, tuple(shape), compute_dtype
        self._int8_cuda_ok = True

    @classmethod
    def from_stored(cls, tensors: dict[str, torch.Tensor], shape: tuple[int, int], device: torch.device,
                    *, rows: bool = False, linear: bool = True) -> "QuantizedWeight":
        """``rows``: keep what ``rows()`` needs (an embedding); for int4 that is
        the stored codes, since the kernels' tiled layout is not one to gather
        rows from. ``linear=False``: skip the kernel layout (an untied embedding)."""
        device = torch.device(device)
        mode = stored_mode(tensors)
        n, k = shape
        stored_shape = (n, k) if mode == "int8" else (n, k // 2)
        if tuple(tensors["qweight"].shape) != stored_shape:
            raise ValueError(f"a stored {mode} weight of shape {tuple(tensors['qweight'].shape)} "
                             f"does not fit a [{n}, {k}] weight")
        # bfloat16 activations: the fast path of the CPU kernels and the model dtype on CUDA.
        self = cls(mode, shape, torch.bfloat16)
        if device.type == "cpu" and cpu_quant.fits(shape) and cpu_quant.library():
            return self._tile_for_cpu(tensors, rows=rows, linear=linear)
        if mode == "int8":
            self.register_buffer("qweight", aligned(tensors["qweight"].to(device)))
            self.register_buffer("scales", aligned(tensors["scales"].to(device, torch.float32)))
            self.register_buffer("kernel_scales", aligned(tensors["scales"].to(device, self.compute_dtype)))
            return self
        if rows:
            for name in ("qweight", "scales", "mins"):
                self.register_buffer(name, aligned(tensors[name].to(device)))
        if not linear:
            return self
        scales, mins = tensors["scales"].float(), tensors["mins"].float()
        zeros = mins + 8 * scales
        sz = torch.stack((scales.t(), zeros.t()), dim=-1).contiguous()  # [K/g, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(device, self.compute_dtype))
        if device.type == "cpu":
            packed = [torch._convert_weight_to_int4pack_for_cpu(unpack_int4(tensors["qweight"][i : i + _PACK_CHUNK]), 2)
                      for i in range(0, n, _PACK_CHUNK)]
            self.register_buffer("packed", torch.cat(packed))
        else:
            inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
            self.inner_k_tiles = inner_k_tiles
            self.register_buffer("packed", torch._convert_weight_to_int4pack(
                aligned(tensors["qweight"].to(device)), inner_k_tiles))
        return self

    def _tile_for_cpu(self, tensors: dict[str, torch.Tensor], *, rows: bool, linear: bool) -> "QuantizedWeight":
        """The layout of ``kernels.cpu_quant`` instead of torch's (no more memory):
        int8 rows are looked up in the tiles; int4 keeps its stored codes for rows."""
        if self.mode == "int8":
            self.register_buffer("tiles", cpu_quant.pack_int8(tensors["qweight"]))
            self.register_buffer("scales", aligned(tensors["scales"].float()))
            return self
        if rows:
            for name in ("qweight", "scales", "mins"):
                self.register_buffer(name, aligned(tensors[name]))
        if linear:
            scales, mins = tensors["scales"].float(), tensors["mins"].float()
            sz = torch.stack((scales, mins + 8 * scales), -1).to(self.compute_dtype)  # torch's bf16 numbers
            parts = [cpu_quant.pack_int4(unpack_int4(tensors["qweight"][i : i + _PACK_CHUNK]), sz[i : i + _PACK_CHUNK])
                     for i in range(0, self.shape[0], _PACK_CHUNK)]
            self.register_buffer("tiles", torch.cat([t for t, _ in parts]))
            self.register_buffer("tile_scales", torch.cat([z for _, z in parts]))
        return self

    def _apply(self, fn, recurse=True):
        return self  # ``model.to(dtype)`` must not cast the kernel's scales; see the class doc

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if hasattr(self, "tiles") and x2.device.type == "cpu":
            scales = self.scales if self.mode == "int8" else self.tile_scales
            y = torch.ops.pagedlm.cpu_quant_mm.default(x2, self.tiles, scales)
        elif self.mode == "int8" and x2.shape[0] == 1 and x2.device.type == "cpu" and torch.compiler.is_compiling():
            # One row in a compiled step (batch.compiled): the dequantization
            # written out as products and a sum over the codes, which inductor
            # fuses into one loop reading each byte once, at about twice the
            # speed of the bfloat16 kernel here; x and the scales stay float32.
            y = (x2.float()[:, None, :] * self.qweight.float()[None]).sum(-1) * self.scales
        elif self.mode == "int8" and (not self._int8_cuda_ok or (x2.device.type == "cpu"
                                                               and x2.shape[0] >= CPU_GEMM_ROWS)):
            # Dequantized once per call, in x's dtype: many rows on the CPU (the
            # bf16 kernel computes slower than MKL there), or no int8 kernel.
            y = F.linear(x2, self.qweight.to(x2.dtype) * self.kernel_scales.to(x2.dtype)[:, None])
        elif self.mode == "int4":
            x2 = x2.to(self.compute_dtype)
            if x2.device.type == "cpu":
                y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP_SIZE, self.scales_and_zeros)
            else:
                y = torch._weight_int4pack_mm(x2, self.packed, GROUP_SIZE, self.scales_and_zeros)
        else:
            try:
                y = torch._weight_int8pack_mm(x2.to(self.compute_dtype), self.qweight, self.kernel_scales)
            except (RuntimeError, NotImplementedError):
                if x2.device.type == "cpu":
                    raise
                self._int8_cuda_ok = False  # no int8 kernel in this torch build on CUDA: dequantize
                return self.linear(x, bias)
        y = y.to(x.dtype).reshape(*shape[:-1], self.shape[0])
        return y if bias is None else y + bias

    def linear_buffers(self) -> list[torch.Tensor]:
        """What ``linear`` reads: the kernel's layout of the weight."""
        if hasattr(self, "tiles"):
            names = ("tiles", "scales") if self.mode == "int8" else ("tiles", "tile_scales")
        else:
            names = ("qweight", "kernel_scales") if self.mode == "int8" else ("packed", "scales_and_zeros")
        return [getattr(self, n) for n in names if hasattr(self, n)]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantized: ``F.embedding(ids, W)``."""
        if self.mode == "int8" and hasattr(self, "tiles"):
            flat = ids.reshape(-1)
            w = cpu_quant.unpack_int8_rows(self.tiles, flat).float() * self.scales[flat, None]
            return w.reshape(*ids.shape, -1).to(dtype)
        stored = {name: getattr(self, name) for name in ("qweight", "scales", "mins") if hasattr(self, name)}
        if "qweight" not in stored:
            raise RuntimeError("this quantized weight was built without rows=True; it has no row lookup")
        return dequantize(stored, ids).to(dtype)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.mode}, shape={self.shape}"
