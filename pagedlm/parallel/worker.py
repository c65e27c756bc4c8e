"""A worker rank (1 .. N-1): load its shard, then run what rank 0 sends, step by step.

Messages (``Comm.send`` from rank 0, in order):

- ``("store", sid, layout, backend)``: build this rank's ``KVStore`` for
  an engine (``sid``): rank 0's layout (block count, placement) with this
  rank's KV heads;
- ``("step", sid, ops, fields, dropped)``: forget the stores of engines that
  are gone (``dropped``), replay the store ops on store ``sid``
  (``store.replay``), then run the shard over the step (``fields``:
  ``StepBatch`` as numpy arrays and host tuples), its all-reduces matching
  rank 0's;
- ``("logits", shape, dtype)``: take the hidden rows rank 0 broadcasts,
  compute this rank's vocabulary columns, gather them to rank 0;
- ``("stop",)``.

A worker ignores SIGINT (Ctrl-C reaches the whole process group; rank 0
decides), exits with status 0 when rank 0 is gone (its connection closes
while the worker waits for a message; a thread watching its parent backs
that up), and reports an exception to rank 0 through ``errors`` before it
exits with status 1.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from pagedlm.attention import select_backend
from pagedlm.cache.layout import make_pools
from pagedlm.cache.step import StepBatch
from pagedlm.cache.store import KVStore
from pagedlm.loading.quant import weight_bytes

from .layers import Comm
from .partition import partition
from .shard import build_args, load_shard, source_for
from .store import replay

PARENT_POLL_S = 0.5
_TENSORS = ("input_ids", "positions", "seq_lens", "logits_rows", "slot_mapping", "block_tables")
_HOST = ("seq_ids", "query_start_host", "seq_lens_host", "sampling_rows", "max_position")


def step_fields(step: StepBatch) -> dict:
    """``step`` as a message: its tensors as numpy arrays (None stays None), its host tuples."""
    out = {name: None if (t := getattr(step, name)) is None else t.cpu().numpy() for name in _TENSORS}
    out.update({name: getattr(step, name) for name in _HOST})
    return out


def fields_step(fields: dict, device: torch.device) -> StepBatch:
    return StepBatch(**{name: None if fields[name] is None else torch.from_numpy(fields[name]).to(device)
                        for name in _TENSORS}, **{name: fields[name] for name in _HOST})


def threads_per_rank(world: int) -> int:
    """CPU threads for each rank's kernels: the cores shared out."""
    return max(1, (os.cpu_count() or 1) // world)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank (rank r on cuda:r); every CPU rank on the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)  # rank 0 is gone: nobody will send another step


def worker_main(rank: int, world: int, host: str, port: int, backend: str, device: str, dtype: torch.dtype,
                spec: object, quantization: str, timeout, errors, parent: int | None) -> None:
    """A spawned worker's life (``parent``: rank 0's pid, watched; None under torchrun)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is not None:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        store = dist.TCPStore(host, port, world, False, timeout=timeout)
        serve(rank, world, store, backend, torch.device(device), dtype, spec, quantization, timeout)
    except BaseException as e:  # reported to rank 0, which fails its requests with it
        detail = traceback.format_exc()
        print(f"pagedlm: tensor-parallel worker {rank}:\n{detail}", file=sys.stderr, flush=True)
        if errors is not None:
            errors.put((rank, f"{type(e).__name__}: {e}", detail))
        raise SystemExit(1) from None


def serve(rank: int, world: int, store, backend: str, device: torch.device, dtype: torch.dtype, spec: object,
          quantization: str, timeout) -> None:
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads_per_rank(world))
    store.set(f"joining/{rank}", "1")  # rank 0 waits for this before it builds the groups
    comm = Comm(store, rank, world, backend, timeout, device)
    config, source, where = source_for(spec, quantization)
    args = build_args(config)
    part = partition(args.num_attention_heads, args.num_key_value_heads, args.intermediate_size,
                     args.vocab_size, world)[rank]
    model = load_shard(config, part, comm, source, device, dtype, where)
    del source
    comm.report(weight_bytes(model))
    stores: dict[int, tuple[KVStore, dict]] = {}  # an engine's store id -> its store and kept row caches
    while True:
        try:
            message = comm.recv()
        except RuntimeError:  # rank 0's connection closed: it ended (or died); nothing more will come
            return
        kind = message[0]
        with torch.inference_mode():
            if kind == "step":
                _, sid, ops, fields, dropped = message
                for gone in dropped:
                    stores.pop(gone, None)
                kv, kept = stores[sid]
                replay(kv, kept, ops)
                step = fields_step(fields, device)
                model(step.input_ids, step.positions, kv, step)
                kv.end_step()
            elif kind == "logits":
                _, shape, dtype_name = message
                h = comm.broadcast(torch.empty(shape, dtype=getattr(torch, dtype_name.removeprefix("torch.")),
                                               device=device))
                comm.gather_columns(model.compute_logits(h), part.vocab_padded, args.vocab_size)
            elif kind == "store":
                _, sid, layout, backend_name = message
                layout = dataclasses.replace(layout, specs=tuple(model.kv_spec()))
                stores[sid] = (KVStore(layout, make_pools(layout, dtype, device),
                                       select_backend(backend_name, device, paged=layout.block_size is not None)),
                               {})
            elif kind == "stop":
                return
            else:
                raise ValueError(f"unknown message {kind!r}")

