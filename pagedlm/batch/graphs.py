"""CUDA graphs of the decode step, and of the verify step: ``DecodeGraphs``.

A decode step of a small model is launch-bound: a few hundred kernels of a
few microseconds each, every one paying the host's Python and the driver's
launch. Captured once as a CUDA graph, the whole forward pass (embedding,
every layer's write and in-place attention, the output head) replays with
one launch.

A graph bakes in its shapes and addresses, so the step it replays reads
static buffers: token ids, positions, slot mapping, lengths, where each
row's queries start, and a block table as wide as the longest sequence the
engine admits. Each row of a graph feeds ``queries`` tokens: 1 for decode
steps; ``1 + k`` for the verify steps of speculative decoding, where every
row checks a proposal of k tokens (an engine with ``--speculative`` keeps
both sets). One graph is captured per batch size in ``capture_sizes``
(largest first, sharing one memory pool); a step of ``n`` rows copies its
inputs into the first rows of the buffers and replays the smallest graph of
at least ``n`` rows. The rows past ``n`` are padding: slots -1 (``write_kv``
skips them), ``queries`` keys over block 0 (finite: the pools start
zeroed; their positions are whatever the buffer held), logits thrown away.

Which steps a graph may replay is the attention backend's to say
(``store.backend.can_capture``: with the kernels, steps whose rows all feed
as many tokens; the torch backend builds masks and gathers from host-known
lengths and offers none); on top of that every row must feed ``queries``
tokens and need the logits of all of them (a decode row's one; a verify
row's ``1 + k``), and the batch fit the largest graph. Other steps run
eagerly.
"""

from __future__ import annotations

import contextlib
import gc
from typing import TYPE_CHECKING

import torch

from pagedlm.cache.step import StepBatch

if TYPE_CHECKING:
    from pagedlm.cache.store import KVStore
    from pagedlm.options import EngineOptions


def capture_graphs(model: torch.nn.Module, store: "KVStore", options: "EngineOptions", max_num_seqs: int,
                   max_model_len: int, queries: int = 1) -> "DecodeGraphs | None":
    """The graphs a model over ``store`` captures (an engine's, or its draft
    model's): on CUDA with a backend that reads the pools in place, unless
    ``--enforce-eager``; None otherwise (the step runs eagerly)."""
    device = next(model.parameters()).device
    if not store.backend.in_place or device.type != "cuda" or options.enforce_eager:
        return None
    block_size = store.layout.block_size
    return DecodeGraphs(model, store, max_num_seqs, -(-max_model_len // block_size), block_size, device, queries)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (rounded up)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += range(16, max_num_seqs + 16, 16) if max_num_seqs > 8 else [max_num_seqs]
    return sorted(set(sizes))


@contextlib.contextmanager
def _no_collection():
    """Python's cyclic garbage collected first and not during the captures:
    a collection in the middle of one can free a dead engine's graphs, events
    or pinned buffers, CUDA calls that invalidate the capture (on an H100, the
    fifth engine of one process failed so, "operation failed due to a previous
    error during capture"; torch's ``graph`` no longer collects before it)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, store: "KVStore", max_num_seqs: int,
                 table_width: int, block_size: int, device: torch.device, queries: int = 1) -> None:
        self.model, self.store, self.queries = model, store, queries
        self.sizes = capture_sizes(max_num_seqs)
        n, q = self.sizes[-1], queries
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        self.input_ids, self.block_tables = zeros(n * q), zeros(n, table_width)
        self.positions = zeros(n * q)
        self.seq_lens = torch.full((n,), q, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n * q,), -1, dtype=torch.long, device=device)
        self.query_start = torch.arange(0, n * q + 1, q, dtype=torch.int32, device=device)
        self.max_position = table_width * block_size - 1
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        with _no_collection():
            for size in reversed(self.sizes):
                self.graphs[size] = self._capture(size, pool)

    def _step(self, n: int) -> StepBatch:
        """A step over the first ``n`` rows of the buffers."""
        rows, q = tuple(range(n)), self.queries
        return StepBatch(
            input_ids=self.input_ids[: n * q], positions=self.positions[: n * q],
            seq_lens=self.seq_lens[:n], logits_rows=None,
            slot_mapping=self.slot_mapping[: n * q], block_tables=self.block_tables[:n],
            seq_ids=rows, query_start_host=tuple(range(0, n * q + 1, q)), seq_lens_host=(),
            sampling_rows=rows, max_position=self.max_position, query_start=self.query_start[: n + 1], replayed=True,
        )

    def _forward(self, step: StepBatch) -> torch.Tensor:
        hidden = self.model(step.input_ids, step.positions, self.store, step)
        return self.model.compute_logits(hidden)

    def _capture(self, n: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        step = self._step(n)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # compile the kernels, grow RoPE's table: nothing allocates in capture
                self._forward(step)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            logits = self._forward(step)
        return graph, logits

    def can_run(self, step: StepBatch) -> bool:
        n, q = len(step.seq_ids), self.queries
        return (step.num_tokens == n * q and self.store.backend.can_capture(self.store, step)
                and len(step.sampling_rows) == n and len(step.logits_rows) == n * q and n <= self.sizes[-1])

    def run(self, step: StepBatch) -> torch.Tensor:
        """Logits ``[n * queries, vocab]`` of a step of ``n`` rows (``can_run``):
        every token's, row after row."""
        n, q = len(step.seq_ids), self.queries
        size = next(b for b in self.sizes if b >= n)
        self.input_ids[: n * q].copy_(step.input_ids)
        self.positions[: n * q].copy_(step.positions)
        self.seq_lens[:n].copy_(step.seq_lens)
        self.slot_mapping[: n * q].copy_(step.slot_mapping)
        self.block_tables[:n, : step.block_tables.shape[1]].copy_(step.block_tables)
        if size > n:  # padding rows: write nothing, read finite keys
            self.slot_mapping[n * q : size * q].fill_(-1)
            self.seq_lens[n:size].fill_(q)
            self.block_tables[n:size, 0].fill_(0)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[: n * q]
