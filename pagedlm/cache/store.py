"""The storage the model writes to and attends over: ``KVStore``.

A layer asks two things per step, whatever holds its keys:

    kv.write(layer, k, v, step)                  # this step's new [T, H_kv, D]
    out = kv.attend(layer, q, step, scale=s)     # [T, H_q, D]

and each row's queries see exactly that row's keys: causal, and bounded by
the window on sliding layers. Two kinds of storage sit behind it, chosen per
layer when the engine starts:

  - per-row caches (the default store, and sliding layers everywhere): a
    ``KVCache`` or ``RotatingKVCache`` per sequence and layer, created when
    the sequence is added (or lent by the prompt cache);
  - paged pools (``--paged-kv``, full-attention layers): ``PagedPools``,
    written through the step's slot mapping, read through its block tables.

On the reference path (``--attention-backend torch``) both hand
``attention.attend_row`` a contiguous ``[S, H_kv, D]`` tensor of exactly the
row's keys, so for the same schedule the paged store gives the default
store's bits. With ``kernels`` (``--attention-backend triton``) every layer
is paged, sliding ones too (the kernel bounds them by their window; their
blocks are not reclaimed behind the window), and decode rows attend in place
through ``kernels.paged_attention.paged_decode``: a step whose rows all
decode is then nothing but fixed-shape launches, which is what lets the
engine replay it as a CUDA graph. Prompt chunks still gather their blocks
and call SDPA.

With prefix caching on the reference path the pools also hold a copy of the
sliding layers' keys (``mirrored_layers``): attention still reads the ring
buffers, but a sequence that starts from cached blocks needs its window of
keys before them, and ``seed_row`` fills its ring buffers from that copy.
(Under the kernels those layers are paged already.)
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from torch.nn.utils.rnn import pad_sequence

from pagedlm.attention import attend_row, attend_rows
from pagedlm.cache.base import Cache
from pagedlm.cache.kv import KVCache, RotatingKVCache, causal_mask
from pagedlm.cache.kv_quant import head_bytes
from pagedlm.cache.spec import KVSpec
from pagedlm.kernels.paged_attention import paged_decode

if TYPE_CHECKING:
    from pagedlm.cache.step import StepBatch
    from pagedlm.cache.paged import PagedPools


def token_bytes(specs: list[KVSpec], dtype: torch.dtype, kv_quant: str = "none",
                sliding_pooled: bool = False) -> list[int]:
    """One token's KV bytes per layer. ``kv_quant`` applies to the layers the
    paged pools hold: full-attention ones, and sliding ones when
    ``sliding_pooled`` (the kernels page them); else sliding layers keep
    per-row caches of ``dtype``."""
    return [2 * s.num_kv_heads * head_bytes(s.head_dim, dtype, "none" if s.window and not sliding_pooled else kv_quant)
            for s in specs]


def kv_bytes(specs: list[KVSpec], bytes_per_token: list[int], lengths: list[int]) -> int:
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


def make_row_caches(specs: list[KVSpec], paged_layers: frozenset[int] = frozenset()) -> list[Cache | None]:
    """One sequence's per-layer caches; None for the layers the pools hold."""
    return [
        None if i in paged_layers else KVCache() if s.window is None else RotatingKVCache(s.window)
        for i, s in enumerate(specs)
    ]


class KVStore:
    def __init__(self, specs: list[KVSpec], pools: "PagedPools | None" = None) -> None:
        self.specs = specs
        self.pools = pools
        self.kernels = pools is not None and pools.fused  # attention reads the pools in place
        pooled = pools.layers if pools is not None else ()
        self.paged_layers = frozenset(i for i in pooled if specs[i].window is None or self.kernels)
        self.mirrored_layers = frozenset(pooled) - self.paged_layers
        self._row_layers = [i for i in range(len(specs)) if i not in self.paged_layers]
        self.rows: dict[int, list[Cache | None]] = {}
        self._fetched: dict[int, list] = {}  # layer -> per row (keys, values, mask), write to attend
        self._step_plan: _StepPlan | None = None

    # -- rows --------------------------------------------------------------

    def add_row(self, seq_id: int, caches: list[Cache | None] | None = None) -> None:
        """Give a sequence its per-row caches (new, or lent holding a prefix)."""
        self.rows[seq_id] = caches if caches is not None else make_row_caches(self.specs, self.paged_layers)

    def seed_row(self, seq_id: int, table: list[int], length: int) -> None:
        """A sequence whose first ``length`` tokens are cached blocks (``table``):
        give its sliding layers' ring buffers the keys of the window before
        them, from the pools' copy."""
        bs = self.pools.block_size
        for layer in self.mirrored_layers:
            keep = min(length, self.specs[layer].window - 1)
            first = (length - keep) // bs
            blocks = torch.tensor([table[first : -(-length // bs)]], device=self.pools.k[layer].device)
            k, v = self.pools.gather(layer, blocks, length - first * bs)
            self.rows[seq_id][layer].update_and_fetch(k[0, k.shape[1] - keep :], v[0, v.shape[1] - keep :])

    def pop_row(self, seq_id: int) -> list[Cache | None]:
        """Take a sequence's per-row caches away (to dispose or keep)."""
        return self.rows.pop(seq_id)

    def row_bytes(self, seq_id: int) -> int:
        """Bytes of the sequence's own caches (the pools' blocks not included)."""
        caches = self.rows.get(seq_id)
        return sum(caches[i].nbytes for i in self._row_layers) if caches else 0

    # -- the protocol the model sees ---------------------------------------

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, step: "StepBatch") -> None:
        if layer in self.paged_layers:
            self.pools.write(layer, keys, values, step.slot_mapping)
            return
        if layer in self.mirrored_layers:
            self.pools.write(layer, keys, values, step.slot_mapping)
        fetched = []
        bounds = step.query_start_host
        for r, seq_id in enumerate(step.seq_ids):
            a, b = bounds[r], bounds[r + 1]
            cache = self.rows[seq_id][layer]
            mask = cache.make_mask(b - a, keys.device)
            k, v = cache.update_and_fetch(keys[a:b], values[a:b])
            fetched.append((k, v, mask))
        self._fetched[layer] = fetched

    def attend(self, layer: int, q: torch.Tensor, step: "StepBatch", *, scale: float) -> torch.Tensor:
        if self.kernels and step.num_tokens == len(step.seq_ids):
            # every row decodes: the kernel alone, nothing read on the host (a CUDA graph replays it)
            return self._decode_in_place(layer, q, step.block_tables, step.seq_lens, scale)
        plan = self._plan(step, q.device)
        fetched = self._fetched.pop(layer, None)  # None: a paged layer
        if len(step.seq_ids) == 1:  # one row: its output is the whole output
            if plan.decode:
                return self._decode(layer, q, plan, fetched, scale)
            return self._attend_one(layer, q, plan, 0, fetched, scale)
        out = torch.empty_like(q)
        if plan.decode:
            out[plan.decode_tokens] = self._decode(layer, q[plan.decode_tokens], plan, fetched, scale)
        bounds = step.query_start_host
        for r in plan.prefill:
            a, b = bounds[r], bounds[r + 1]
            out[a:b] = self._attend_one(layer, q[a:b], plan, r, fetched, scale)
        return out

    def _decode(self, layer, q, plan, fetched, scale) -> torch.Tensor:
        """The step's decode rows: in place with the kernels, else gathered."""
        if self.kernels:
            return self._decode_in_place(layer, q, plan.decode_tables, plan.decode_seq_lens, scale)
        return self._attend_rows(layer, q, plan, fetched, scale)

    def _decode_in_place(self, layer, q, block_tables, seq_lens, scale) -> torch.Tensor:
        """Decode rows reading their blocks where they lie (``paged_decode``)."""
        return paged_decode(q, self.pools.k[layer], self.pools.v[layer], block_tables, seq_lens, scale,
                            self.specs[layer].window, self.pools.scales(layer))

    def _attend_one(self, layer, q, plan, r, fetched, scale) -> torch.Tensor:
        """A row with several queries (a prompt chunk): its keys, its mask, SDPA."""
        if fetched is not None:
            k, v, mask = fetched[r]
        else:
            step = plan.step
            seq_len = step.seq_lens_host[r]
            k, v = self.pools.gather(layer, step.block_tables[r : r + 1], seq_len)
            k, v = k[0], v[0]
            mask = plan.causal(r, q.shape[0], seq_len, self.specs[layer].window)
        return attend_row(q, k, v, mask, scale)

    def _attend_rows(self, layer, q, plan, fetched, scale) -> torch.Tensor:
        """Every row with one query (decode) in one SDPA call: keys padded with
        zeros to the longest row, a key-padding mask when lengths differ."""
        if fetched is not None:
            keys = [fetched[r][0] for r in plan.decode]
            values = [fetched[r][1] for r in plan.decode]
            lengths = tuple(k.shape[0] for k in keys)
            if len(keys) == 1:
                k, v = keys[0][None], values[0][None]
            else:
                k, v = pad_sequence(keys, batch_first=True), pad_sequence(values, batch_first=True)
        else:
            lengths = plan.decode_lens
            k, v = self.pools.gather(layer, plan.decode_tables, max(lengths))
        return attend_rows(q, k, v, plan.padding(lengths), scale)

    def end_step(self) -> None:
        """Drop what one step kept for its layers (its plan, masks and row
        tables): nothing of a step outlives it."""
        self._step_plan = None
        self._fetched.clear()

    def _plan(self, step: "StepBatch", device) -> "_StepPlan":
        if self._step_plan is None or self._step_plan.step is not step:
            self._step_plan = _StepPlan(step, device)
        return self._step_plan


class _StepPlan:
    """What every layer of one step shares: which rows decode (one query)
    and which prefill, and their masks, built once."""

    def __init__(self, step: "StepBatch", device) -> None:
        self.step, self.device = step, device
        bounds = step.query_start_host
        n_rows = len(step.seq_ids)
        self.decode = tuple(r for r in range(n_rows) if bounds[r + 1] - bounds[r] == 1)
        self.prefill = tuple(r for r in range(n_rows) if bounds[r + 1] - bounds[r] > 1)
        self.decode_tokens = torch.tensor([bounds[r] for r in self.decode], dtype=torch.long, device=device)
        self.decode_lens = tuple(step.seq_lens_host[r] for r in self.decode)
        self._masks: dict = {}

    @functools.cached_property
    def decode_tables(self) -> torch.Tensor:
        """The decode rows' block tables (paged store)."""
        return self.step.block_tables.index_select(0, self._decode_rows)

    @functools.cached_property
    def decode_seq_lens(self) -> torch.Tensor:
        """The decode rows' lengths, on the device (kernels)."""
        return self.step.seq_lens.index_select(0, self._decode_rows)

    @functools.cached_property
    def _decode_rows(self) -> torch.Tensor:
        return torch.tensor(self.decode, dtype=torch.long, device=self.step.seq_lens.device)

    def causal(self, row: int, n: int, seq_len: int, window: int | None = None) -> torch.Tensor:
        """A prompt chunk's causal mask (bounded by a sliding ``window``),
        once per step for every paged layer."""
        key = ("causal", row, window)
        if key not in self._masks:
            self._masks[key] = causal_mask(n, seq_len - n, self.device, window)
        return self._masks[key]

    def padding(self, lengths: tuple[int, ...]) -> torch.Tensor | None:
        """Key-padding mask ``[rows, max(lengths)]``; None when no row is padded."""
        longest = max(lengths)
        if all(n == longest for n in lengths):
            return None
        if lengths not in self._masks:
            lens = torch.tensor(lengths, device=self.device)
            self._masks[lengths] = torch.arange(longest, device=self.device)[None, :] < lens[:, None]
        return self._masks[lengths]
