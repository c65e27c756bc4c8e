"""Which slice of every weight a rank holds: ``Partition``, made by ``partition``.

Megatron's split, as vLLM does it: attention heads across ranks (q/k/v
column-parallel, o row-parallel), the MLP's intermediate dimension across
ranks (gate/up column-parallel, down row-parallel), the vocabulary across
ranks (the embedding and the output head); norms whole on every rank.

Heads go in contiguous runs, and each rank keeps every KV head its query
heads read. With at least as many KV heads as ranks, each rank takes whole
KV groups (the first ``KV % N`` ranks one group more); with fewer, the query
heads are split (the first ``H % N`` ranks one more) and a KV head whose
group spans ranks is on each of them (replicated, as in vLLM). A rank's
query heads must read its KV heads in equal runs (grouped-query attention
maps query head i to KV head i // (H_r / KV_r)); a split where they do not
is refused. The rank with the most KV heads is rank 0, whose KV specs size
the one KV budget (``cache.layout``): no rank holds more KV bytes than that
budget says.

Sizes are cut in multiples of ``align`` where they divide (32 for the
intermediate dimension, 16 for the vocabulary), so that an int4 weight's
groups of 32 and its kernels' 16-row tiles stay whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.options import check_refusals

MLP_ALIGN = 32  # kernels.quant.GROUP_SIZE: a row-parallel int4 weight cuts K at group boundaries
VOCAB_ALIGN = 16  # int4_fits: the int4 kernels take rows in multiples of 16


@dataclass(frozen=True)
class Partition:
    """One rank's share: half-open ``(start, stop)`` ranges of the full model's axes."""

    rank: int
    world: int
    heads: tuple[int, int]  # query heads
    kv_heads: tuple[int, int]  # the KV heads those query heads read
    intermediate: tuple[int, int]  # the MLP's hidden units
    vocab: tuple[int, int]  # token ids of the embedding and output head
    vocab_padded: int  # the longest rank's vocabulary slice (gathered logits are padded to it)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def split(n: int, world: int, align: int = 1) -> list[tuple[int, int]]:
    """``[0, n)`` in ``world`` contiguous runs, sizes in multiples of ``align``
    (1 if it does not divide ``n`` or leaves a run empty), the first runs one
    unit longer."""
    align = align if n % align == 0 and n // align >= world else 1
    units = n // align
    base, extra = divmod(units, world)
    out, start = [], 0
    for r in range(world):
        size = (base + (r < extra)) * align
        out.append((start, start + size))
        start += size
    return out


def partition(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
              world: int) -> list[Partition]:
    """Every rank's share, by rank: ``partition(...)[rank]``."""
    check_refusals({"tensor_parallel_size": world, "num_attention_heads": num_heads})
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world:
        kv = split(num_kv_heads, world)
        heads = [(a * group, b * group) for a, b in kv]
    else:
        heads = split(num_heads, world)
        kv = [(a // group, (b - 1) // group + 1) for a, b in heads]
    check_refusals({"tensor_parallel_size": world, "uneven_kv_runs": not all(_even_runs(h, group) for h in heads)})
    # The run with the most KV heads goes to rank 0 (the module doc says why).
    first = max(range(world), key=lambda r: (kv[r][1] - kv[r][0], -r))
    order = [first] + [r for r in range(world) if r != first]
    inter = split(intermediate_size, world, MLP_ALIGN)
    vocab = split(vocab_size, world, VOCAB_ALIGN)
    padded = max(b - a for a, b in vocab)
    return [Partition(rank, world, heads[r], kv[r], inter[rank], vocab[rank], padded)
            for rank, r in enumerate(order)]


def _even_runs(heads: tuple[int, int], group: int) -> bool:
    """Whether query heads ``[a, b)`` read their KV heads in runs of one length."""
    a, b = heads
    runs = [min(b, (k + 1) * group) - max(a, k * group) for k in range(a // group, (b - 1) // group + 1)]
    return len(set(runs)) == 1
