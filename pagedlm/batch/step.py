"""Building one forward pass's worth of work: ``prepare_step`` (the
``StepBatch`` it returns is defined in ``cache.step``).
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from pagedlm.cache.step import StepBatch
from pagedlm.kernels.copies import to_device

from .sequence import PENDING

if TYPE_CHECKING:
    from pagedlm.cache.blocks import BlockManager

    from .sequence import Sequence


def prepare_step(
    rows: list[tuple["Sequence", int]],
    device: torch.device,
    blocks: "BlockManager | None" = None,
    feed: "tuple[dict[int, int], torch.Tensor | Callable[[], torch.Tensor]] | None" = None,
) -> StepBatch:
    """The step for ``rows``: (sequence, number of new tokens) in row order;
    with ``blocks`` (the paged store) their block tables and slot mapping.

    A row samples when its new tokens reach the end of its tokens (a decode
    row, or the last chunk of a prompt); a row mid-prompt only stores keys.
    A verify row (a decode row that also feeds its sequence's ``draft``)
    needs the logits of its last token and of every proposed one: its
    ``logits_rows`` are those ``1 + d`` positions, in order.

    Async scheduling: a decode row whose token the last step sampled and the
    host does not know yet (`PENDING`) is fed from ``feed``: (the row of
    each such sequence in the last step's tokens, those tokens on the
    device; or a function that gives them, called once the host's inputs
    are built: the engine picks a step's tokens there when that pick waited
    for grammar masks filled meanwhile). Nothing here waits for the device:
    the inputs leave pinned memory on the current stream, and the fed tokens
    are gathered there.
    """
    ids: list[int] = []
    positions: list[int] = []
    starts = [0]
    lens: list[int] = []
    sampling: list[int] = []
    logits_rows: list[int] = []
    fed_at: list[int] = []  # positions in the step fed from the last step's tokens,
    fed_from: list[int] = []  # and which of them
    for r, (seq, n) in enumerate(rows):
        begin, total = seq.num_computed, seq.num_tokens
        if n == 1 and begin + 1 == total:  # a decode row (most rows, most steps): its last token
            ids.append(seq.last_token)
            positions.append(begin)
        else:
            ids += seq.new_tokens(n)
            positions += range(begin, begin + n)
        if ids[-1] == PENDING:
            fed_at.append(len(ids) - 1)
            fed_from.append(feed[0][seq.seq_id])
        starts.append(starts[-1] + n)
        lens.append(begin + n)
        if begin + n >= total:
            sampling.append(r)
            logits_rows += range(starts[r] + total - 1 - begin, starts[r + 1])
    # Everything the device needs goes over in one copy, then is cut apart.
    parts = [ids, positions, lens, logits_rows, fed_at, fed_from]
    width = 0
    if blocks is not None:
        tables = [blocks.tables[seq.seq_id] for seq, _ in rows]
        held = np.fromiter(map(len, tables), np.int64, len(tables))
        width = int(held.max())
        padded = np.full((len(rows), width), -1, dtype=np.int64)
        padded[np.arange(width) < held[:, None]] = np.fromiter(chain.from_iterable(tables), np.int64, held.sum())
        pos = np.asarray(positions, dtype=np.int64)
        row_of = np.repeat(np.arange(len(rows)), [n for _, n in rows])
        bs = blocks.block_size
        parts += [padded[row_of, pos // bs] * bs + pos % bs, padded.reshape(-1)]
    # Each piece starts 16 bytes in (an even count of int64 before it): Triton
    # specializes a kernel on whether each pointer is 16-byte aligned, so a
    # piece 8 bytes off in some steps would compile every kernel it feeds a
    # second time, mid-run (~1 s each).
    sizes = [len(p) for p in parts]
    spans = [n + n % 2 for n in sizes]
    flat = np.zeros(sum(spans), dtype=np.int64)
    for piece, start, n in zip(parts, np.cumsum([0, *spans]), sizes):
        flat[start : start + n] = piece
    packed = to_device(flat, torch.long, device)
    input_ids, positions_t, seq_lens, logits_rows, at, src, *paged = (
        t[:n] for t, n in zip(packed.split(spans), sizes))
    if fed_at:
        tokens = feed[1]() if callable(feed[1]) else feed[1]
        input_ids.index_copy_(0, at, tokens.index_select(0, src))
    return StepBatch(
        input_ids=input_ids,
        positions=positions_t,
        seq_lens=seq_lens,
        logits_rows=logits_rows,
        slot_mapping=paged[0] if paged else None,
        block_tables=paged[1].view(len(rows), width) if paged else None,
        seq_ids=tuple(seq.seq_id for seq, _ in rows),
        query_start_host=tuple(starts),
        seq_lens_host=tuple(lens),
        sampling_rows=tuple(sampling),
        max_position=max(lens) - 1,
    )
