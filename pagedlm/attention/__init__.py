"""Attention over the KV store, chosen once per engine: ``select_backend``.

    backend = select_backend(options.attention_backend, device, paged=...)
    store = KVStore(layout, pools, backend)   # the store stores; its attend is the backend's
    out = store.attend(layer, q, step, scale=s)

A backend (``base.AttentionBackend``) attends, keeps what one step's layers
share (``plan.StepPlan``) until ``end_step``, and says which steps a CUDA
graph may capture. Two today, one module each: ``torch`` (the reference:
SDPA over each row's contiguous keys, any device) and ``triton`` (every row
reads the paged pools in place: one kernel for one-query rows, one for rows
of several). ``describe_store`` is the line the CLI and the server print at
startup to say which store and backend run. A new backend is a module here, a
branch in ``select_backend`` and its name among ``options.ATTENTION_BACKENDS``.
The SDPA calls themselves are in ``sdpa``.
"""

from __future__ import annotations

import torch

from pagedlm.attention.base import AttentionBackend
from pagedlm.attention.torch_backend import TorchBackend
from pagedlm.attention.triton_backend import TritonBackend
from pagedlm.kernels import paged_attention
from pagedlm.options import ATTENTION_BACKENDS

__all__ = ["AttentionBackend", "describe_store", "select_backend"]


def select_backend(name: str, device: torch.device | str, *, paged: bool) -> AttentionBackend:
    """The backend for ``--attention-backend name`` (``"auto"``, ``"torch"`` or
    ``"triton"``) with ``--paged-kv`` on or off (``paged``): the kernels read
    only pools, so without them it is torch; ``auto`` is triton on CUDA when
    the kernels can run there."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (one of {', '.join(ATTENTION_BACKENDS)})")
    device = torch.device(device)
    if paged and (name == "triton" or (name == "auto" and device.type == "cuda"
                                       and paged_attention.available(device))):
        return TritonBackend()
    return TorchBackend()


def describe_store(engine) -> str:
    """What stores and attends for ``engine`` (an ``LLMEngine``), in one line."""
    paged = engine.options.paged_kv
    overlap = ", async scheduling" if engine.async_scheduling else ""
    if not engine.paged_kv:
        return f"per-row KV caches (paging off), attention torch{overlap}"
    graphs = ", decode replayed as CUDA graphs" if engine.graphs is not None else ""
    return (f"paged KV in {paged.block_size}-token blocks (prefix caching {'on' if paged.prefix_caching else 'off'}, "
            f"KV {engine.options.kv_quant}), attention {engine.attention_backend}{graphs}{overlap}")
