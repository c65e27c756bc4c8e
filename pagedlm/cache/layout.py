"""Where each layer's keys live and how many bytes they may take, decided once
per engine: ``KVLayout``, made by ``plan_layout``.

Placement, per layer, from the model's ``KVSpec``s and the options:

- the default store (no ``--paged-kv``): every layer keeps per-row caches
  (a ``KVCache``, or a ``RotatingKVCache`` on a sliding layer);
- ``--paged-kv``, attention by the torch reference: the full-attention
  layers live in the pools (``paged_layers``); sliding layers keep their
  ring buffers. With prefix caching the pools also hold a copy of the
  sliding layers' keys (``mirrored_layers``): a sequence that starts from
  cached blocks needs the window of keys before them, and its ring buffers
  are seeded from that copy;
- ``--paged-kv``, a backend that reads the pools in place (``in_place``,
  the Triton kernels): every layer is paged, sliding ones too (the kernel
  bounds them by their window), and the pools are laid out for the kernels.

Sizing: one KV budget (``--kv-budget-bytes``; on CUDA
``--gpu-memory-utilization`` or ``--gpu-memory-fraction`` of the memory the
weights leave; else the device's default). The paged store spends all of it
on blocks of ``block_size`` tokens across the pooled layers, and refuses to
start when that holds less than one sequence of ``max_model_len``; the
default store reserves it sequence by sequence (``cache.admission``). A
draft model's keys come out of the same budget (``model_share``).

``prefix_salt`` keys the block hashes of prefix caching (``cache.blocks``):
whatever besides the tokens changes a block's keys (the model, the dtype,
the KV format).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from pagedlm.cache.kv_quant import head_bytes
from pagedlm.cache.paged import PagedPools
from pagedlm.cache.spec import KVSpec
from pagedlm.options import DEVICE_DEFAULTS, EngineOptions, OptionError


@dataclass(frozen=True)
class KVLayout:
    specs: tuple[KVSpec, ...]
    bytes_per_token: tuple[int, ...]  # per layer, in the format that layer is stored in
    budget_bytes: int  # the one KV budget
    in_place: bool  # attention reads the pools where they lie (triton); the pools are fused
    block_size: int | None  # None: the default (per-row) store, no pools
    num_blocks: int  # 0 without pools
    pooled_layers: tuple[int, ...]  # layers the pools hold (paged + mirrored)
    paged_layers: frozenset[int]  # attention reads these from the pools
    mirrored_layers: frozenset[int]  # the pools hold a copy; attention reads the row caches
    row_layers: tuple[int, ...]  # layers with per-row caches (not in paged_layers)
    prefix_salt: bytes | None  # None: no prefix caching
    kv_quant: str


class PoolTooSmall(OptionError):
    """The pools hold less than one sequence of max_model_len: ``tokens``, what they hold."""

    def __init__(self, message: str, tokens: int) -> None:
        super().__init__(message)
        self.tokens = tokens


def plan_layout(specs: Sequence[KVSpec], options: EngineOptions, device: torch.device | str, dtype: torch.dtype,
                *, in_place: bool, identity: str, max_model_len: int) -> KVLayout:
    """The layout of an engine over a model with these ``specs``. ``in_place``:
    the attention backend reads the pools in place (only with paging);
    ``identity`` names the model (its class and configuration) for the
    prefix salt. Raises `OptionError` for a budget that holds less than one
    sequence of ``max_model_len``, and for prefix caching on the torch path
    over layers whose keys differ in shape."""
    specs = tuple(specs)
    kv_quant = options.kv_quant
    budget = _budget(options, torch.device(device))
    paging = options.paged_kv
    pooled = [] if paging is None else [i for i, s in enumerate(specs) if s.window is None or in_place]
    caching = paging is not None and paging.prefix_caching and bool(pooled)
    num_blocks = 0
    if pooled:
        spec = specs[pooled[0]]
        if caching and not in_place:  # a cached prefix needs the sliding layers' keys too
            pooled = _pooled_for_caching(specs, spec)
        bs = paging.block_size
        per_block = PagedPools.bytes_per_block(len(pooled), bs, spec.num_kv_heads, spec.head_dim, dtype, kv_quant)
        num_blocks = budget // per_block
        need = -(-max_model_len // bs)
        if num_blocks < need:
            raise PoolTooSmall(
                f"the KV budget ({budget} bytes) holds {num_blocks} blocks of {bs} tokens, "
                f"fewer than one sequence of max_model_len {max_model_len} needs ({need}); "
                f"raise --kv-budget-bytes or lower --max-model-len", num_blocks * bs)
    paged = frozenset(i for i in pooled if specs[i].window is None or in_place)
    return KVLayout(
        specs=specs,
        bytes_per_token=tuple(token_bytes(specs, dtype, kv_quant, sliding_pooled=in_place)),
        budget_bytes=budget,
        in_place=in_place,
        block_size=paging.block_size if pooled else None,
        num_blocks=num_blocks,
        pooled_layers=tuple(pooled),
        paged_layers=paged,
        mirrored_layers=frozenset(pooled) - paged,
        row_layers=tuple(i for i in range(len(specs)) if i not in paged),
        prefix_salt=_salt(identity, dtype, kv_quant) if caching else None,
        kv_quant=kv_quant,
    )


def make_pools(layout: KVLayout, dtype: torch.dtype, device: torch.device | str) -> PagedPools | None:
    """The pools ``layout`` asks for (None for the default store)."""
    if layout.block_size is None:
        return None
    spec = layout.specs[layout.pooled_layers[0]]
    try:
        return PagedPools(layout.pooled_layers, layout.num_blocks, layout.block_size, spec.num_kv_heads,
                          spec.head_dim, dtype, device, layout.kv_quant, fused=layout.in_place)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # (the CPU's allocator raises a RuntimeError)
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        where = torch.device(device).type
        raise OptionError(f"the KV budget ({layout.budget_bytes} bytes) does not fit in the {where} memory left: "
                          f"lower --kv-budget-bytes") from None


def token_bytes(specs: Sequence[KVSpec], dtype: torch.dtype, kv_quant: str = "none",
                sliding_pooled: bool = False) -> list[int]:
    """One token's KV bytes per layer. ``kv_quant`` applies to the layers the
    paged pools hold: full-attention ones, and sliding ones when
    ``sliding_pooled`` (the kernels page them); else sliding layers keep
    per-row caches of ``dtype``."""
    return [2 * s.num_kv_heads * head_bytes(s.head_dim, dtype, "none" if s.window and not sliding_pooled else kv_quant)
            for s in specs]


def kv_bytes(specs: Sequence[KVSpec], bytes_per_token: Sequence[int], lengths: list[int]) -> int:
    """KV bytes that sequences of these lengths attend to, all layers: a
    full layer holds every token, a sliding one at most its window."""
    total, windowed = sum(lengths), {}
    out = 0
    for b, s in zip(bytes_per_token, specs):
        if s.window is None:
            out += b * total
        else:
            if s.window not in windowed:
                windowed[s.window] = sum(min(n, s.window) for n in lengths)
            out += b * windowed[s.window]
    return out


def _pooled_for_caching(specs: tuple[KVSpec, ...], spec: KVSpec) -> list[int]:
    """Every layer, when the sliding ones store keys shaped like the full ones."""
    for s in specs:
        if (s.num_kv_heads, s.head_dim) != (spec.num_kv_heads, spec.head_dim):
            raise OptionError("prefix caching keeps every layer's keys in one pool, and this model's "
                              "layers differ in KV heads or head size; use --no-prefix-caching")
    return list(range(len(specs)))


def _salt(identity: str, dtype: torch.dtype, kv_quant: str) -> bytes:
    """What the keys of a block depend on besides its tokens: the model, the
    KV dtype and its 8-bit format."""
    return hashlib.blake2b(repr((identity, str(dtype), kv_quant)).encode(), digest_size=16).digest()


def model_share(options: EngineOptions, device: torch.device | str, dtype: torch.dtype, specs: Sequence[KVSpec],
                draft_specs: Sequence[KVSpec], *, in_place: bool) -> EngineOptions:
    """``options`` for the model of an engine whose draft model keeps the
    keys of as many tokens (``--speculative draft``): the one budget split
    in proportion to a token's bytes in each, the model's part as an
    explicit ``kv_budget_bytes`` (the draft sizes its store from the
    model's layout). Called once the draft's weights are loaded: on CUDA
    they count as memory held."""
    total = _budget(options, torch.device(device))
    mine, theirs = (sum(token_bytes(s, dtype, options.kv_quant, sliding_pooled=in_place))
                    for s in (specs, draft_specs))
    return replace(options, kv_budget_bytes=total * mine // (mine + theirs), gpu_memory_fraction=None,
                   gpu_memory_utilization=None)


def _budget(options: EngineOptions, device: torch.device) -> int:
    if options.kv_budget_bytes is not None:
        return options.kv_budget_bytes
    defaults = DEVICE_DEFAULTS.get(device.type, DEVICE_DEFAULTS["cpu"])
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if options.gpu_memory_utilization is not None:
            return _utilization_budget(options.gpu_memory_utilization, device, free, total)
        return int(free * (options.gpu_memory_fraction or defaults["gpu_memory_fraction"]))
    return defaults["kv_budget_bytes"]


def _utilization_budget(utilization: float, device: torch.device, free: int, total: int) -> int:
    """vLLM's meaning: this process may hold ``utilization`` of the GPU's
    total memory; the KV cache gets that less what the process holds now
    (the weights). Other processes' memory is not this process's share,
    but it must leave room for the budget."""
    gib, used = 1024**3, torch.cuda.memory_allocated(device)
    budget = int(total * utilization) - used
    available = free + torch.cuda.memory_reserved(device) - used  # torch's cached blocks are ours
    name = f"--gpu-memory-utilization {utilization}"
    if budget <= 0:
        raise OptionError(f"{name} allows {total * utilization / gib:.2f} GiB of the GPU's {total / gib:.2f} "
                          f"GiB, and this process already holds {used / gib:.2f} GiB (weights included): "
                          f"nothing is left for the KV cache; raise it")
    if budget > available:
        raise OptionError(f"{name} leaves {budget / gib:.2f} GiB for the KV cache, but only "
                          f"{available / gib:.2f} GiB of the GPU are free (other processes hold the rest); "
                          f"lower it")
    return budget
