"""The collectives a rank's shard calls, and the two layers that call them.

``Comm`` holds one rank's two process groups over one ``torch.distributed``
store: ``compute`` (gloo on the CPU, NCCL on CUDA; a finite timeout: a rank
that stops answering fails the step) for the all-reduces and the logits'
gather, and ``control`` (gloo, no practical timeout: workers wait there
between requests) for the step broadcast (``send`` / ``recv``).

Where the all-reduces are, per decoder layer: after ``o_proj`` and after
``down_proj`` (``RowParallelLinear``), plus one after the embedding lookup
(``VocabParallelEmbedding``); the logits are gathered to rank 0 once per
``compute_logits``. Everything else (q/k/v, gate/up, norms, RoPE,
attention) is local to the rank.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedlm.models.layers import Embedding, Linear

CONTROL_TIMEOUT = timedelta(days=3650)  # workers idle between requests as long as the server does
CHUNK = 1 << 16  # a step's message fits one broadcast of this many bytes (a longer one takes two)


class Comm:
    def __init__(self, store: dist.Store, rank: int, world: int, backend: str, timeout: timedelta,
                 device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.compute = _group(backend, dist.PrefixStore("compute", store), rank, world, timeout)
        self.control = _group("gloo", dist.PrefixStore("control", store), rank, world, CONTROL_TIMEOUT)

    def close(self) -> None:
        """Drop the process groups now, while the interpreter is whole: left to
        the interpreter's exit, gloo's destructor could find its threads
        still joinable and abort the process ("terminate called without an
        active exception": rank 0 of a torchrun script, about 1 run in 8)."""
        self.compute = self.control = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        self.compute.allreduce([t]).wait()
        return t

    def gather_columns(self, local: torch.Tensor, padded: int, total: int) -> torch.Tensor | None:
        """Rank 0: every rank's ``[S, n_r]`` columns side by side, ``[S, total]``
        (each padded to ``padded`` for the collective); other ranks: None."""
        if local.shape[1] < padded:
            local = torch.nn.functional.pad(local, (0, padded - local.shape[1]))
        local = local.contiguous()
        out = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else []
        self.compute.gather(out, local, 0).wait()
        return torch.cat(out, dim=1)[:, :total] if self.rank == 0 else None

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank (in place), over the compute group."""
        self.compute.broadcast(t, 0).wait()
        return t

    def report(self, value: int) -> list[int] | None:
        """Every rank's ``value``, on rank 0 (by rank); None elsewhere (control group)."""
        t = torch.tensor([value], dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else []
        self.control.gather(out, t, 0).wait()
        return [int(x) for x in out] if self.rank == 0 else None

    def send(self, message: object) -> None:
        """Rank 0: ``message`` to every other rank (``recv``)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = bytearray(CHUNK)
        head[:8] = len(data).to_bytes(8, "little")
        head[8 : 8 + len(data)] = data[: CHUNK - 8]
        self.control.broadcast(torch.frombuffer(head, dtype=torch.uint8), 0).wait()
        if len(data) > CHUNK - 8:
            rest = bytearray(data[CHUNK - 8 :])
            self.control.broadcast(torch.frombuffer(rest, dtype=torch.uint8), 0).wait()

    def recv(self) -> object:
        """Another rank: the next message rank 0 ``send``s."""
        head = torch.empty(CHUNK, dtype=torch.uint8)
        self.control.broadcast(head, 0).wait()
        raw = head.numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        data = raw[8 : 8 + min(n, CHUNK - 8)]
        if n > CHUNK - 8:
            rest = torch.empty(n - (CHUNK - 8), dtype=torch.uint8)
            self.control.broadcast(rest, 0).wait()
            data += rest.numpy().tobytes()
        return pickle.loads(data)


def _group(backend: str, store: dist.Store, rank: int, world: int, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, options)


class RowParallelLinear(Linear):
    """A linear layer over this rank's slice of the input features, summed
    over the ranks: ``o_proj`` and ``down_proj``. Only rank 0 holds the bias
    (added once to the sum)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm):
        super().__init__(in_features, out_features, bias=bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


class VocabParallelEmbedding(Embedding):
    """This rank's rows ``[start, start + n)`` of the embedding: a lookup
    reads the ids it holds (zeros for the others) and sums over the ranks;
    as the tied output head it gives this rank's columns of the logits."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, comm: Comm):
        super().__init__(num_embeddings, embedding_dim)
        self.start, self.comm = start, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = super().forward(local.masked_fill(outside, 0))
        return self.comm.all_reduce(h.masked_fill_(outside[:, None], 0))
