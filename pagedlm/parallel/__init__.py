"""Tensor parallelism over torch.distributed (``--tensor-parallel-size N``).

The engine process is rank 0: it keeps the one scheduler and block manager
and calls a ``TensorParallelLM``, which runs rank 0's shard and sends each
step to ranks 1 .. N-1 (``driver``, ``worker``). The split is Megatron's
(``partition``, ``shard``, ``layers``); each rank's KV store holds its own
KV heads and replays rank 0's store changes (``store``). Design and limits:
docs/design/tensor-parallel.md.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from pagedlm.options import EngineOptions, check_refusals

from .driver import TensorParallelError, TensorParallelLM, run_worker_from_env, start

__all__ = ["TensorParallelError", "TensorParallelLM", "load_parallel", "parallelize", "distributed_backend",
           "torchrun_rank"]


def distributed_backend(options: EngineOptions, device: str | torch.device) -> str:
    """``--distributed-backend``, else NCCL on CUDA and gloo on the CPU."""
    return options.distributed_backend or ("nccl" if torch.device(device).type == "cuda" else "gloo")


def torchrun_rank(environ=None) -> int:
    """This process's rank under torchrun's environment (0 without it)."""
    env = os.environ if environ is None else environ
    return int(env.get("RANK", 0)) if int(env.get("WORLD_SIZE", 1)) > 1 else 0


def load_parallel(spec: str, device: str, dtype: torch.dtype, quantization: str, options: EngineOptions):
    """``(TensorParallelLM, Tokenizer)`` for ``spec`` over
    ``options.tensor_parallel_size`` ranks, each reading only its slices.
    Under torchrun a rank other than 0 serves as a worker here until rank 0
    ends, then exits."""
    from pagedlm.loading import load_tokenizer, resolve

    _check(options, device)
    folder = resolve(spec)
    tokenizer = load_tokenizer(folder)
    backend = distributed_backend(options, device)
    if torchrun_rank() > 0:
        run_worker_from_env(folder, backend=backend, device=device, dtype=dtype, quantization=quantization)
        raise SystemExit(0)
    model = start(folder, size=options.tensor_parallel_size, backend=backend, device=device, dtype=dtype,
                  quantization=quantization)
    return model, tokenizer


def parallelize(model: nn.Module, options: EngineOptions) -> TensorParallelLM:
    """A float model in memory over ``options.tensor_parallel_size`` ranks
    (``model`` is left whole; each rank copies its slices)."""
    param = next(model.parameters())
    _check(options, param.device)
    return start(model, size=options.tensor_parallel_size, backend=distributed_backend(options, param.device),
                 device=param.device, dtype=param.dtype)


def _check(options: EngineOptions, device: str | torch.device) -> None:
    """The refusals of ``options`` on ``device`` (an engine built by hand skips the flags' resolution)."""
    check_refusals({"tensor_parallel_size": options.tensor_parallel_size, "device": torch.device(device).type,
                    "distributed_backend": options.distributed_backend, "enforce_eager": options.enforce_eager})
