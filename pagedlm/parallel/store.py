"""Every rank's KV store, kept in step with the engine's: ``MirroredStore`` and ``replay``.

The engine's admission and scheduler change its store between steps: a
sequence gets its row caches (new, or lent by the prompt cache holding a
prefix), ring buffers seeded from cached blocks, a block copied before a
write (copy-on-write), a rejected speculative tail trimmed, a row taken
away. ``MirroredStore`` (rank 0's store, made by the engine through
``TensorParallelLM.make_store``) records each of these as an op; the next
step's message carries them, and each worker replays them (``replay``) on
its own ``KVStore`` before it runs the step. Each store holds only its
rank's KV heads; block ids, slots and lengths are the engine's, so the
block manager, admission, preemption and prefix sharing run once, on rank 0.

Row caches that leave the store (to the prompt cache, or to be disposed)
stay on the workers under a handle until rank 0's caches are gone (a
``weakref.finalize`` on them records ``drop``). When rank 0 lends them to a
sequence again, the op carries their lengths: the prompt cache may have
trimmed them to a shorter prefix, and the worker trims its own to match.
"""

from __future__ import annotations

import weakref

from pagedlm.cache.prompt import _shrink
from pagedlm.cache.store import KVStore


class _RecordedPools:
    """Rank 0's pools, whose ``copy_blocks`` (copy-on-write) is also recorded."""

    def __init__(self, pools, ops: list) -> None:
        self._pools, self._ops = pools, ops

    def __getattr__(self, name):
        return getattr(self._pools, name)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self._ops.append(("copy", list(src), list(dst)))
        self._pools.copy_blocks(src, dst)


class MirroredStore(KVStore):
    def __init__(self, layout, pools, backend, sid: int) -> None:
        self.sid = sid  # which of the workers' stores mirrors this one (an engine each)
        self.ops: list[tuple] = []
        super().__init__(layout, _RecordedPools(pools, self.ops) if pools is not None else None, backend)
        self._handles: dict[int, int] = {}  # id of a row's first cache -> its handle on the workers
        self._next_handle = 0

    def take_ops(self) -> list[tuple]:
        """The ops recorded since the last call, in order."""
        n = len(self.ops)  # a finalizer may append meanwhile: take only what is there
        ops = self.ops[:n]
        del self.ops[:n]
        return ops

    def add_row(self, seq_id, caches=None) -> None:
        anchor = next((c for c in caches or () if c is not None), None)
        handle = self._handles.get(id(anchor)) if anchor is not None else None
        super().add_row(seq_id, caches)
        if handle is not None:  # caches the workers keep already: at their (maybe trimmed) lengths
            self.ops.append(("lend", seq_id, handle, [c.offset if c is not None else 0 for c in caches]))
            return
        anchor = next((c for c in self.rows[seq_id] if c is not None), None)
        handle = None
        if anchor is not None:
            handle = self._next_handle
            self._next_handle += 1
            self._handles[id(anchor)] = handle
            weakref.finalize(anchor, self._dropped, id(anchor), handle)
        self.ops.append(("row", seq_id, handle))

    def _dropped(self, key: int, handle: int) -> None:
        self._handles.pop(key, None)
        self.ops.append(("drop", handle))

    def seed_row(self, seq_id, table, length) -> None:
        self.ops.append(("seed", seq_id, list(table), length))
        super().seed_row(seq_id, table, length)

    def trim_row(self, seq_id, n) -> None:
        self.ops.append(("trim", seq_id, n))
        super().trim_row(seq_id, n)

    def pop_row(self, seq_id):
        self.ops.append(("pop", seq_id))
        return super().pop_row(seq_id)


def replay(store: KVStore, kept: dict[int, list], ops: list[tuple]) -> None:
    """Apply rank 0's ``ops`` to a worker's ``store``; ``kept``: handle ->
    row caches the worker holds for rank 0's caches still alive."""
    for op in ops:
        kind = op[0]
        if kind == "row":
            _, seq_id, handle = op
            store.add_row(seq_id)
            if handle is not None:
                kept[handle] = store.rows[seq_id]
        elif kind == "lend":
            _, seq_id, handle, lengths = op
            caches = kept[handle]
            for cache, length in zip(caches, lengths):
                if cache is not None and cache.offset > length:
                    cache.trim(cache.offset - length)
                    _shrink(cache)
            store.add_row(seq_id, caches)
        elif kind == "drop":
            for cache in kept.pop(op[1], ()):
                if cache is not None:
                    cache.dispose()
        elif kind == "seed":
            store.seed_row(op[1], op[2], op[3])
        elif kind == "trim":
            store.trim_row(op[1], op[2])
        elif kind == "pop":
            store.pop_row(op[1])
        elif kind == "copy":
            store.pools.copy_blocks(op[1], op[2])
        else:
            raise ValueError(f"unknown store op {kind!r}")
