"""A smaller model that proposes: ``DraftProposer`` (``--speculative draft
--draft-model M``), a `pagedlm.speculative.Proposer`.

The draft model keeps its own keys and values in a store of the target's
kind (per-row caches, or paged pools with a block manager of its own, as
many blocks as the target's pool and no prefix caching), and proposes its
greedy continuation: k tokens for every row that asks, in k batched
forward passes (the first also feeds what the row gained since the draft
last saw it). A greedy draft is a proposal of one token with certainty, so
the engine's one-hot rule (`speculative.verify`) is exact for greedy and
sampled rows alike.

What the draft stored of a row is kept between steps (``fed``); at the
next proposal it is cut back to the longest prefix the row's tokens still
share (the draft's own rejected tokens go), then extended. A row cache that
cannot rewind (a sliding window's ring buffer past one-token updates) drops
the row, which is fed again from its start. The first pass feeds at most
``max_tokens_per_pass`` tokens (the engine's step budget) over all rows, in
row order: a row whose catch-up does not fit is fed over several steps,
proposing nothing until it has caught up; a row the draft's pool has no
room for proposes nothing. On CUDA with the kernels (and without
``--enforce-eager``) the one-token passes replay CUDA graphs of the draft,
captured as the engine captures the model's (`DecodeGraphs`).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedlm.attention import select_backend
from pagedlm.cache.blocks import BlockManager
from pagedlm.cache.layout import KVLayout, make_pools, plan_layout
from pagedlm.cache.paged import PagedPools
from pagedlm.cache.store import KVStore
from pagedlm.options import EngineOptions, UnsupportedOption
from pagedlm.speculative import Proposing

from .graphs import capture_graphs
from .step import prepare_step


class _Row:
    """What ``prepare_step`` reads of a row: its tokens (the target's, then
    the draft's own proposals) and how many the draft has stored."""

    def __init__(self, seq_id: int, tokens: list[int], num_computed: int, k: int) -> None:
        self.seq_id, self.tokens, self.num_computed, self.k = seq_id, tokens, num_computed, k
        self.proposed: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def new_tokens(self, n: int) -> list[int]:
        return self.tokens[self.num_computed : self.num_computed + n]

    @property
    def last_token(self) -> int:
        return self.tokens[-1]


class DraftProposer:
    def __init__(self, draft: torch.nn.Module, num_speculative_tokens: int, target_vocab: int,
                 target_layout: KVLayout, options: EngineOptions, max_model_len: int,
                 max_tokens_per_pass: int, max_num_seqs: int) -> None:
        vocab = int(draft.args.vocab_size)
        if vocab != target_vocab:
            raise UnsupportedOption(f"--draft-model has a vocabulary of {vocab} tokens and the model {target_vocab}: "
                                    "a draft must share the model's tokenizer")
        param = next(draft.parameters())
        self.model, self.num_speculative_tokens = draft, num_speculative_tokens
        self.device, self.max_tokens_per_pass = param.device, max_tokens_per_pass
        backend = select_backend(options.attention_backend, self.device, paged=options.paged_kv is not None)
        specs = draft.kv_spec()
        paging = options.paged_kv and dataclasses.replace(options.paged_kv, prefix_caching=False)
        budget = target_layout.budget_bytes
        pooled = [s for s in specs if s.window is None or backend.in_place]
        if target_layout.num_blocks and pooled:  # as many blocks as the target's pool
            budget = target_layout.num_blocks * PagedPools.bytes_per_block(
                len(pooled), paging.block_size, pooled[0].num_kv_heads, pooled[0].head_dim, param.dtype,
                options.kv_quant)
        own = dataclasses.replace(options, paged_kv=paging, kv_budget_bytes=budget, gpu_memory_fraction=None,
                                  gpu_memory_utilization=None)
        layout = plan_layout(specs, own, self.device, param.dtype, in_place=backend.in_place, identity="draft",
                             max_model_len=max_model_len)
        pools = make_pools(layout, param.dtype, self.device)
        self.blocks = BlockManager(layout.num_blocks, layout.block_size) if pools is not None else None
        self.store = KVStore(layout, pools, backend)
        # The passes after the first decode one token a row: replayed, as the engine's are.
        self.graphs = capture_graphs(draft, self.store, options, max_num_seqs, max_model_len)
        self.fed: dict[int, list[int]] = {}  # seq id -> the tokens whose keys the draft's store holds

    # -- the proposer -----------------------------------------------------------

    def propose(self, rows: list[tuple[Proposing, int]]) -> list[list[int]]:
        work = [self._resume(seq.seq_id, seq.tokens, k) for seq, k in rows]
        todo = [row for row in work if row.k > 0]
        budget = self.max_tokens_per_pass  # the first pass's catch-up, shared in row order
        n: dict[int, int] = {}
        for row in todo:
            n[row.seq_id] = min(row.num_tokens - row.num_computed, budget)
            budget -= n[row.seq_id]
        while todo:
            todo = [row for row in todo if n[row.seq_id] and self._room(row, n[row.seq_id])]
            if not todo:
                break
            step = prepare_step([(row, n[row.seq_id]) for row in todo], self.device, self.blocks)
            with torch.inference_mode():
                if self.graphs is not None and self.graphs.can_run(step):
                    best = self.graphs.run(step).argmax(-1).tolist()
                else:
                    hidden = self.model(step.input_ids, step.positions, self.store, step)
                    best = (self.model.compute_logits(hidden[step.logits_rows]).argmax(-1).tolist()
                            if step.sampling_rows else [])
            self.store.end_step()
            for row in todo:
                row.num_computed += n[row.seq_id]
            for r, token in zip(step.sampling_rows, best):
                todo[r].proposed.append(token)
                todo[r].tokens.append(token)
            for row in todo:
                self.fed[row.seq_id] = row.tokens[: row.num_computed]
            todo = [todo[r] for r in step.sampling_rows if len(todo[r].proposed) < todo[r].k]
            n = dict.fromkeys(n, 1)  # then one token a pass
        return [row.proposed for row in work]

    def release(self, seq_id: int) -> None:
        if self.fed.pop(seq_id, None) is not None:
            for cache in self.store.pop_row(seq_id):
                if cache is not None:
                    cache.dispose()
            if self.blocks is not None:
                self.blocks.free(seq_id)

    # -- rows ---------------------------------------------------------------------

    def _resume(self, seq_id: int, tokens: list[int], k: int) -> _Row:
        """The row as the draft holds it, cut back to what ``tokens`` still share
        (at least one token left to feed: its logits propose)."""
        fed = self.fed.get(seq_id)
        if fed is None:
            self.store.add_row(seq_id)
            self.fed[seq_id] = fed = []
        keep = 0
        for a, b in zip(fed, tokens[: len(tokens) - 1]):
            if a != b:
                break
            keep += 1
        if keep < len(fed):
            try:
                self.store.trim_row(seq_id, len(fed) - keep)
            except RuntimeError:  # a ring buffer that cannot rewind: feed the row again from its start
                self.release(seq_id)
                return self._resume(seq_id, tokens, k)
            if self.blocks is not None:
                self.blocks.trim(seq_id, keep)
            self.fed[seq_id] = fed[:keep]
        return _Row(seq_id, list(tokens), keep, k)

    def _room(self, row: _Row, n: int) -> bool:
        """Blocks for the row's next ``n`` tokens (the default store always has room)."""
        if self.blocks is None:
            return True
        return self.blocks.allocate_slots(row.seq_id, row.num_computed + n) is not None
