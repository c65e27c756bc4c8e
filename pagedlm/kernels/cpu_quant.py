"""Quantized CPU products with integer dot products (``cpu_quant.cpp``), and
the compiled one-row step's attention (``torch.ops.pagedlm.decode_attention``,
``batch.compiled``), built in the same library.

torch's int4 CPU kernel converts every weight to float and multiplies it in
(6-14 GB/s of codes here, bound by that work, not by memory). llama.cpp's
way, this one: quantize the activations to int8 per group of 32 (a float
scale each), multiply bytes by bytes with integer SIMD (AVX-512 VNNI's
``vpdpbusd``, or AVX2's ``maddubs``), scale once per group. The weights'
numbers are those of ``kernels.quant`` (int4: the stored codes with torch's
bfloat16 scales and zeros; int8: the codes and their per-row scale), only
laid out in tiles of 16 rows (``pack_int4``, ``pack_int8``); the results
differ from torch's kernels by the activations' rounding (8 bits a value
against bfloat16's). Measured here (2 threads, one row): 2-4.4x torch's
kernels, 22-98 GB/s of codes (Gemma 3's 262144 x 640 int8 head 11.1 ->
3.1 ms); 512 rows 1.65-3.6x (docs/design/quantization.md).

The products are torch operators (``torch.ops.pagedlm.cpu_quant_mm``,
registered in C++): a compiled graph calls them as it calls torch's own, for
~2 us a call; a Python-defined op around a ctypes call cost ~4 us more, and
SmolLM2's int8 compiled step lost 2-5% to torch's path with it. The
library is built at first use (engine start, ~6 s) with the system compiler (``$CXX``, else ``g++``) against torch's headers,
``-march=native`` (so AVX-512 VNNI where the CPU has it, else AVX2;
neither: no kernel), and cached under ``$PAGEDLM_CACHE_DIR/cpu_quant/``
keyed by the source, the command, the compiler's version, torch's and the
CPU's flags. Its threads are torch's (OpenMP, torch's libgomp). No compiler, a
failed build or no AVX2: ``library()`` is False, one line on stderr says
why, and the products stay torch's.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pagedlm.options import CPU_QUANT_KERNEL_ENV, cache_dir, env_flag

SOURCE = Path(__file__).with_name("cpu_quant.cpp")
FLAGS = ("-O3", "-march=native")
GROUP, TILE = 32, 16  # inputs per activation scale; output rows per tile


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def build(flags: tuple[str, ...] = FLAGS) -> Path:
    """The compiled library for ``flags`` (built once, then cached); raises if it cannot be built."""
    from torch.utils.cpp_extension import include_paths  # torch's headers ship in its wheels

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler ($CXX, g++)")
    torch_lib = Path(torch.__file__).parent / "lib"
    command = [compiler, *flags, "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-w",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{p}" for p in include_paths()), str(SOURCE),
               f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *command, version, torch.__version__, _cpu_flags()]).encode())
    cache = cache_dir() / "cpu_quant"
    target = cache / f"cpu_quant-{key.hexdigest()[:16]}.so"
    if not target.exists():
        print(f"pagedlm: building the integer CPU kernel for quantized weights (once, ~6 s; cached in {cache})",
              file=sys.stderr)
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)
            if done.returncode:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or ["build failed"]
                raise RuntimeError(errors[0].strip())
            os.replace(out, target)  # atomic: concurrent first uses each build, one wins
    return target


def library() -> bool:
    """Whether the kernel's ops (``torch.ops.pagedlm.cpu_quant_mm``) are loaded;
    False (with a one-line notice where a build failed) where they cannot be
    built here, and under ``PAGEDLM_CPU_QUANT=0`` (or another off spelling: torch's
    products, as before; a value that is no switch is an `OptionError`)."""
    return env_flag(CPU_QUANT_KERNEL_ENV) is not False and _library()


@functools.cache
def _library() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        torch.ops.load_library(str(build()))
    except (OSError, RuntimeError) as e:
        print(f"pagedlm: no integer CPU quantized kernel ({e}); using torch's", file=sys.stderr)
        return False
    torch.library.register_fake("pagedlm::cpu_quant_mm")(
        lambda x, tiles, scales: x.new_empty(x.shape[0], tiles.shape[0] * TILE, dtype=torch.float32))
    torch.library.register_fake("pagedlm::decode_attention")(
        lambda q, k, v, scale: q.new_empty(1, q.shape[1], v.shape[2]))
    return True


def pack_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` (0..15) and bfloat16 ``[N, K/32, 2]`` (scale, zero) -> the kernel's
    tiles: uint8 ``[N/16, K/32, 4, 16, 4]`` (chunk c, row r, byte b: input 4c + b low,
    16 + 4c + b high) and bfloat16 ``[N/16, K/32, 2, 16]`` (16 scales, then 16 zeros)."""
    n, k = codes.shape
    q = codes.to(torch.uint8).reshape(n // TILE, TILE, k // GROUP, 2, 4, 4)  # tile, row, group, half, c, b
    tiles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).contiguous()
    sz = scales_and_zeros.reshape(n // TILE, TILE, k // GROUP, 2).permute(0, 2, 3, 1).contiguous()
    return tiles, sz


def pack_int8(qweight: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` -> uint8 ``[N/16, K/32, 8, 16, 4]`` (step t, row r, byte b: input
    4t + b), each code plus 128 (``vpdpbusd`` multiplies unsigned bytes by signed ones)."""
    n, k = qweight.shape
    q = (qweight.view(torch.uint8) ^ 0x80).reshape(n // TILE, TILE, k // GROUP, 8, 4)
    return q.permute(0, 2, 3, 1, 4).contiguous()


def unpack_int8_rows(tiles: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the int8 codes that ``pack_int8`` tiled, as int8 ``[len(ids), K]``."""
    picked = tiles[ids // TILE, :, :, ids % TILE]  # [ids, K/32, 8, 4]
    return (picked.reshape(len(ids), -1) ^ 0x80).view(torch.int8)


def fits(shape: tuple[int, int]) -> bool:
    """Whether a ``[N, K]`` weight tiles (others keep torch's kernels)."""
    n, k = shape
    return n % TILE == 0 and k % GROUP == 0
