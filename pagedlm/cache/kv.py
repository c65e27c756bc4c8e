"""Contiguous KV caches of one sequence and one layer: ``KVCache`` and ``RotatingKVCache``.

Keys and values are token-major, ``[tokens, H_kv, D]``, the layout of the
paged store's blocks: a fetch here and a gather there hand attention tensors
of the same shape and strides, so the default and paged stores give the same
bits. Both hand attention exactly the keys it attends to, never padding:
float32 SDPA changes its last bits when the key length changes.
"""

from __future__ import annotations

import torch

STEP = 256


def causal_mask(
    n_queries: int, offset: int, device: torch.device | str | None = None, window: int | None = None
) -> torch.Tensor:
    """Bool ``[n_queries, offset + n_queries]``: query ``i`` (absolute position
    ``offset + i``) may attend to keys at positions ``<= offset + i``, and with
    a ``window`` only to those less than ``window`` positions back."""
    q = torch.arange(offset, offset + n_queries, device=device)
    k = torch.arange(offset + n_queries, device=device)
    mask = k[None, :] <= q[:, None]
    if window is not None:
        mask &= k[None, :] > q[:, None] - window
    return mask


def _device_of(t: torch.Tensor | None, device: torch.device | str | None):
    if device is not None:
        return device
    return t.device if t is not None else None


class KVCache:
    """Grows in steps of ``STEP`` tokens so that decode rarely reallocates."""

    STEP = STEP

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.offset = 0

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prev, n = self.offset, keys.shape[0]
        if self.keys is None or prev + n > self.keys.shape[0]:
            self._grow(keys, values, prev + n)
        self.keys[prev : prev + n] = keys
        self.values[prev : prev + n] = values
        self.offset = prev + n
        return self.keys[: self.offset], self.values[: self.offset]

    def next_slot(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for one more token, which the caller writes (a compiled decode
        step writes it inside its graph): the keys and values that token
        attends to, and its slot among them. The offset counts it already."""
        if self.offset == self.keys.shape[0]:
            self._grow(self.keys, self.values, self.offset + 1)
        slot = self.offset
        self.offset += 1
        return self.keys[: self.offset], self.values[: self.offset], slot

    def _grow(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        capacity = -(-needed // self.STEP) * self.STEP
        new_k = keys.new_zeros(capacity, *keys.shape[1:])
        new_v = values.new_zeros(capacity, *values.shape[1:])
        if self.keys is not None and self.offset > 0:
            new_k[: self.offset] = self.keys[: self.offset]
            new_v[: self.offset] = self.values[: self.offset]
        self.keys, self.values = new_k, new_v

    def make_mask(
        self, n_queries: int, device: torch.device | str | None = None
    ) -> torch.Tensor | None:
        """``None`` for one query (it sees every key), else a causal mask.

        ``device`` defaults to the buffers' device (CPU before the first
        update); pass it when the first call happens before any update."""
        if n_queries == 1:
            return None
        return causal_mask(n_queries, self.offset, _device_of(self.keys, device))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def dispose(self) -> None:
        self.keys = self.values = None
        self.offset = 0


class RotatingKVCache:
    """Sliding-window cache: query at position ``p`` sees keys ``j`` with
    ``0 <= p - j < max_size`` (transformers' sliding-window semantics).

    Two storage modes:
      - linear: ``_n`` valid tokens in temporal order at ``[0, _n)``. Prefill
        and multi-token updates leave the cache here; ``_n`` may then exceed
        ``max_size`` (the last ``max_size - 1`` old tokens plus the new ones).
      - ring: exactly ``max_size`` tokens; ``_idx`` is the slot of the oldest
        one, which the next single token overwrites.
    A single-token update returns exactly the in-window keys (order does not
    matter without a mask); a multi-token update returns keys in temporal
    order and ``make_mask`` masks them by causality and window.
    """

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"RotatingKVCache needs max_size >= 1, got {max_size}")
        self.max_size = max_size
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.offset = 0
        self._n = 0
        self._idx = 0
        self._ring = False

    # -- storage helpers -------------------------------------------------

    def _temporal(self, x: torch.Tensor) -> torch.Tensor:
        """Valid tokens, oldest first."""
        if self._ring:
            return torch.cat([x[self._idx :], x[: self._idx]])
        return x[: self._n]

    def _kept(self) -> int:
        """Old tokens a multi-token update keeps (and returns) before the new ones."""
        return min(self._n, self.max_size - 1)

    # -- protocol --------------------------------------------------------

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if keys.shape[0] == 1 and self.keys is not None:
            return self._update_one(keys, values)
        return self._update_concat(keys, values)

    def _update_concat(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self._kept()
        if self.keys is None or kept == 0:
            new_k, new_v = keys.clone(), values.clone()
        else:
            old_k = self._temporal(self.keys)[self._n - kept :]
            old_v = self._temporal(self.values)[self._n - kept :]
            new_k = torch.cat([old_k, keys])
            new_v = torch.cat([old_v, values])
        self.keys, self.values = new_k, new_v
        self._n = new_k.shape[0]
        self._ring = False
        self._idx = 0
        self.offset += keys.shape[0]
        return self.keys, self.values

    def _update_one(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, slot = self.next_slot()
        k[slot : slot + 1] = keys
        v[slot : slot + 1] = values
        return k, v

    def next_slot(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for one more token after the first update, which the caller
        writes: the keys and values that token attends to (exactly its
        window), and its slot among them. The offset counts it already."""
        if not self._ring:
            if self._n >= self.max_size:
                # Linear buffer after a multi-token update: keep the newest
                # max_size tokens as a ring whose oldest slot is 0.
                start = self._n - self.max_size
                self.keys = self.keys[start : self._n].clone()
                self.values = self.values[start : self._n].clone()
                self._n, self._ring, self._idx = self.max_size, True, 0
            else:
                if self._n == self.keys.shape[0]:
                    self._grow()
                slot = self._n
                self._n += 1
                self.offset += 1
                if self._n == self.max_size:
                    self._ring, self._idx = True, 0
                return self.keys[: self._n], self.values[: self._n], slot
        slot = self._idx
        self._idx = (self._idx + 1) % self.max_size
        self.offset += 1
        return self.keys, self.values, slot

    def _grow(self) -> None:
        """Extend the linear buffer by up to STEP slots, never past max_size."""
        capacity = min(self._n + STEP, self.max_size)
        new_k = self.keys.new_zeros(capacity, *self.keys.shape[1:])
        new_v = self.values.new_zeros(capacity, *self.values.shape[1:])
        new_k[: self._n] = self.keys[: self._n]
        new_v[: self._n] = self.values[: self._n]
        self.keys, self.values = new_k, new_v

    def make_mask(
        self, n_queries: int, device: torch.device | str | None = None
    ) -> torch.Tensor | None:
        """``None`` for one query (the fetch is exactly its window), else a
        mask over ``[kept old tokens..., new tokens...]`` by causality and window."""
        if n_queries == 1:
            return None
        kept = self._kept() if self.keys is not None else 0
        device = _device_of(self.keys, device)
        q = torch.arange(n_queries, device=device)[:, None] + kept
        k = torch.arange(kept + n_queries, device=device)[None, :]
        dist = q - k
        return (dist >= 0) & (dist < self.max_size)

    def is_trimmable(self) -> bool:
        """Whether any number of tokens can be trimmed: before the window first fills."""
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        """Rewind ``n`` tokens when what stays still holds every key the next
        query sees (the last ``max_size - 1``, or all of them): before the
        window first fills, or right after a multi-token update that kept
        the window before its new tokens (a speculative verify row's
        rejected tail); else trims nothing. Invariant kept: a linear
        buffer holds at least min(offset, max_size - 1) tokens."""
        n = min(self.offset, n)
        if self._ring or self._n - n < min(self.offset - n, self.max_size - 1):
            return 0
        self.offset -= n
        self._n -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def dispose(self) -> None:
        self.keys = self.values = None
        self.offset = self._n = self._idx = 0
        self._ring = False
