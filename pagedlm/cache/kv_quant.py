"""8-bit KV blocks (``--kv-quant int8|fp8``): the one place for their math.

A paged pool that quantizes holds, per layer, a payload the shape of an
unquantized pool and one scale per token and KV head:

- ``k``, ``v``: ``[num_blocks, block_size, H_kv, D]``, ``int8`` or
  ``float8_e4m3fn`` (``fp8``);
- ``k_scale``, ``v_scale``: ``[num_blocks, block_size, H_kv]``, bfloat16;

so a slot (block * block_size + offset) indexes both, and block tables,
slot mappings, admission and preemption are unchanged. Symmetric, no zero
point: ``x ~= q * scale`` with ``scale = max|x| / QMAX`` over the token's
``D`` values of one KV head (``QMAX`` = 127 for int8, 448 for e4m3).

Those are the logical shapes. In memory, pools the Triton kernels read are
head-major (``HEAD_MAJOR``, built by ``zeros`` and ``stored``): keys
``[num_blocks, H_kv, block_size, D]``, values ``[num_blocks, H_kv, D,
block_size]``, scales ``[num_blocks, H_kv, block_size]``, each viewed back
in the logical order. The decode kernel's products sum over ``D`` for keys
and over tokens for values, and the tensor cores' shared-memory loads
transpose 16-bit elements but not bytes: token-major 8-bit values cost one
shared-memory load per byte. Head-major, a block of one KV head is one
contiguous run and its values (tokens innermost) load as 16-byte rows
(``docs/design/kv-quant.md``). Pools only the torch path reads stay
token-major (``TOKEN_MAJOR``), the order its gather returns: head-major
made the CPU's gather 1.6x slower.

Why per token and KV head: a token's scale is known when the token is
written (no block-wide scale to revise as a block fills, no second pass),
keys differ in magnitude from head to head and token to token (the BOS key,
outlier channels), and the overhead is small: 2 bytes per ``D`` payload
bytes, 3% at ``D`` = 64. Why bfloat16 scales: float32's range (a float16
scale underflows for rows of small values) at half its bytes, which keeps
int8 at >= 1.9x the tokens of bfloat16 KV even at ``D`` = 64 (float32
scales would give 1.88x there). ``q`` is computed against the stored
(rounded) scale and clamped, so the bfloat16 rounding of the scale costs no
accuracy: for int8 ``|x - q * scale| <= scale / 2`` holds exactly.

Payloads move as bytes (``uint8`` views): torch's ``index_copy_`` has no
float8 kernel on the CPU or on CUDA, and a byte copy is the same on every
device and either format.
"""

from __future__ import annotations

import torch

STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}  # e4m3fn's largest finite value is 448
SCALE_DTYPE = torch.bfloat16
# Memory orders (logical dims, outermost first) of a pool's keys, values and scales.
KEY_ORDER = (0, 2, 1, 3)  # [blocks, H_kv, block_size, D]
VALUE_ORDER = (0, 2, 3, 1)  # [blocks, H_kv, D, block_size]: tokens innermost
SCALE_ORDER = (0, 2, 1)  # [blocks, H_kv, block_size]
HEAD_MAJOR = (KEY_ORDER, VALUE_ORDER, SCALE_ORDER)  # 8-bit pools the kernels read
TOKEN_MAJOR = ((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2))  # the logical order: what the torch gather returns


def head_bytes(head_dim: int, dtype: torch.dtype, mode: str) -> int:
    """Bytes of one token's keys (or values) of one KV head: ``D`` values of
    ``dtype``, or ``D`` 8-bit codes and one scale."""
    if mode == "none":
        return head_dim * torch.finfo(dtype).bits // 8
    return head_dim + torch.finfo(SCALE_DTYPE).bits // 8


def storage_dtype(mode: str, dtype: torch.dtype) -> torch.dtype:
    """What a pool's payload is made of: ``dtype`` itself when not quantized."""
    return dtype if mode == "none" else STORAGE[mode]


def quantize(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` -> codes ``[..., D]`` (``STORAGE[mode]``) and scales ``[...]``
    (``SCALE_DTYPE``), one per row of ``D``."""
    x = x.float()
    scale = (x.abs().amax(-1) / QMAX[mode]).to(SCALE_DTYPE)
    # An all-zero row (or one whose scale underflows): codes 0 whatever the scale.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # Clamped: the scale was rounded, max|x| / scale may exceed QMAX by 2^-8
    # (and a float8 cast past 448 is not guaranteed to saturate).
    y = (x / scale.float()[..., None]).clamp_(-QMAX[mode], QMAX[mode])
    q = y.round_().to(torch.int8) if mode == "int8" else y.to(STORAGE[mode])
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes ``[..., D]`` and scales ``[...]`` -> ``[..., D]`` of ``dtype``
    (computed in float32, rounded once), contiguous."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's storage as ``uint8`` (a view: no copy; a wider dtype's
    last dimension grows by its size)."""
    return t.view(torch.uint8)


def zeros(shape: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor of logical ``shape`` whose memory runs in ``order``."""
    return torch.zeros([shape[i] for i in order], dtype=dtype, device=device).permute(_inverse(order))


def stored(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``t``'s values copied into memory running in ``order``, viewed in ``t``'s logical order."""
    return t.permute(order).contiguous().permute(_inverse(order))


def select_blocks(t: torch.Tensor, order: tuple[int, ...], index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)`` for ``t`` whose memory runs in ``order``
    (blocks outermost): selected where each block is one contiguous run
    (torch's select on the permuted view walks it element by element,
    1.6x slower on the CPU), returned in the logical order."""
    return t.permute(order).index_select(0, index).permute(_inverse(order))


def _inverse(order: tuple[int, ...]) -> list[int]:
    return sorted(range(len(order)), key=order.__getitem__)


def quantize_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, mode: str):
    """Whole ``[blocks, block_size, H_kv, D]`` key and value pools quantized and
    laid out as ``PagedPools`` lays them for the kernels (``HEAD_MAJOR``):
    ``((key codes, key scales), (value codes, value scales))``, for
    benchmarks and tests that build pools directly."""
    out = []
    for pool, order in ((k_pool, KEY_ORDER), (v_pool, VALUE_ORDER)):
        q, s = quantize(pool, mode)
        out.append((stored(q, order), stored(s, SCALE_ORDER)))
    return tuple(out)
