"""Rank 0: the model the engine calls (``TensorParallelLM``), the workers it starts, its faults.

``start`` spawns ranks 1 .. N-1 with torch.multiprocessing (or, under
torchrun's environment, joins the ranks torchrun started), loads rank 0's
shard, and waits until every rank holds its own. The engine then sees one
model: ``forward`` sends the step (and the store ops since the last one) to
the workers and runs rank 0's shard, whose all-reduces meet theirs;
``compute_logits`` broadcasts the rows' hidden states and gathers the
vocabulary columns of every rank; ``make_store`` gives the engine a
``MirroredStore`` after telling the workers the layout.

Faults: any exception inside a step (a worker that died, raised, or did not
answer within the collective timeout; an error on rank 0 itself) leaves the
ranks out of step, so the model fails for good: the step raises
``TensorParallelError`` naming the worker and its error, every later call
raises it again, the workers are stopped, and the process is sent SIGTERM
after ``FAULT_EXIT_S`` (the server drains and exits; a script ends). A
monitor thread does the same when a worker exits between steps. Shutdown
(the model garbage-collected, interpreter exit, Ctrl-C) terminates the
workers and drops rank 0's process groups; a worker whose rank 0 is gone
exits by itself (``worker``).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from pagedlm.loading.quant import weight_bytes
from pagedlm.options import OptionError, tp_timeout
from pagedlm.models.base import DecoderLM

from .layers import Comm
from .partition import partition
from .shard import build_args, check_float, load_shard, model_config, source_for
from .store import MirroredStore
from .worker import rank_device, serve, step_fields, threads_per_rank, worker_main

STARTUP_TIMEOUT = timedelta(seconds=600)  # workers import torch and load their shards
FAULT_EXIT_S = 1.0  # the failed step's errors reach the clients first
STOP_WAIT_S = 5.0
REPORT_WAIT_S = 0.3
JOIN_POLL_S = 0.05  # for a failed worker's message or exit status


class TensorParallelError(RuntimeError):
    """The ranks are out of step (a worker died or failed): the engine cannot go on."""


class _Workers:
    """The worker processes and their error channel; ``stop`` ends them
    (idempotent, no reference to the model: a finalizer calls it)."""

    def __init__(self, processes: list, errors) -> None:
        self.processes, self.errors = processes, errors
        self.stopping = threading.Event()
        self.threads = torch.get_num_threads()  # rank 0's process gets its share while the ranks run

    def reason(self) -> str | None:
        """What went wrong on a worker: its reported error, or how it exited."""
        if self.errors is not None:
            try:  # a worker that raised put its error here before it exited
                rank, message, _ = self.errors.get(timeout=REPORT_WAIT_S)
                return f"tensor-parallel worker {rank} failed: {message}"
            except (queue.Empty, OSError, ValueError, EOFError):
                pass
        for rank, p in enumerate(self.processes, start=1):
            if p.pid is None:  # never started
                continue
            p.join(REPORT_WAIT_S if p.exitcode is None else 0)
            if p.exitcode is not None:
                return f"tensor-parallel worker {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def stop(self) -> None:
        if not self.stopping.is_set():
            torch.set_num_threads(self.threads)
        self.stopping.set()
        started = [p for p in self.processes if p.pid is not None]
        for p in started:
            if p.exitcode is None:
                p.terminate()
        for p in started:
            p.join(STOP_WAIT_S)
            if p.exitcode is None:
                p.kill()
                p.join(STOP_WAIT_S)


class TensorParallelLM(nn.Module):
    """A ``CausalLM`` over N ranks: rank 0's shard here, the others in the workers."""

    def __init__(self, shard: DecoderLM, comm: Comm, args, vocab_padded: int, workers: _Workers,
                 weight_bytes: list[int]) -> None:
        super().__init__()
        self.shard, self.comm, self.args = shard, comm, args
        self.vocab_padded = vocab_padded
        self.world = comm.world
        self.weight_bytes = weight_bytes  # per rank, as each rank measured its shard
        self._workers = workers
        self._failed: TensorParallelError | None = None
        self._lock = threading.Lock()
        self._stores = 0  # engines' stores made so far (each engine has one; several may be alive)
        self._dropped_stores: list[int] = []  # ids of those garbage-collected, for the workers to drop
        self._stop = weakref.finalize(self, _shut_down, workers, comm)
        if workers.processes:
            threading.Thread(target=_monitor, args=(weakref.ref(self), workers), daemon=True).start()

    # -- the CausalLM surface ----------------------------------------------

    def kv_spec(self):
        return self.shard.kv_spec()  # rank 0's KV heads: the most of any rank (partition)

    def make_store(self, layout, pools, backend) -> MirroredStore:
        """An engine's store (``LLMEngine``), built after the workers build theirs."""
        sid, self._stores = self._stores, self._stores + 1
        self._call(self.comm.send, ("store", sid, layout, backend.name))
        store = MirroredStore(layout, pools, backend, sid)
        weakref.finalize(store, self._dropped_stores.append, sid)
        return store

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: MirroredStore, step) -> torch.Tensor:
        n = len(self._dropped_stores)
        dropped = self._dropped_stores[:n]
        del self._dropped_stores[:n]
        self._call(self.comm.send, ("step", kv.sid, kv.take_ops(), step_fields(step), dropped))
        return self._call(self.shard, input_ids, positions, kv, step)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        h = h.contiguous()
        self._call(self.comm.send, ("logits", tuple(h.shape), str(h.dtype)))
        self._call(self.comm.broadcast, h)
        local = self._call(self.shard.compute_logits, h)
        return self._call(self.comm.gather_columns, local, self.vocab_padded, self.args.vocab_size)

    def close(self) -> None:
        """Stop the workers now (also done when the model is garbage-collected)."""
        self._stop()

    # -- faults -------------------------------------------------------------

    def _call(self, fn, *args):
        if self._failed is not None:
            raise self._failed
        try:
            return fn(*args)
        except Exception as e:
            raise self.fail(f"{type(e).__name__}: {e}") from e
        except BaseException:  # Ctrl-C mid-step: the ranks are out of step too, but the user is leaving
            with self._lock:
                self._failed = self._failed or TensorParallelError("a step was interrupted; the engine stops")
            self._workers.stop()
            raise

    def fail(self, detail: str) -> TensorParallelError:
        """Mark the ranks out of step: stop the workers, schedule the exit; the error to raise."""
        with self._lock:  # the engine's thread and the monitor's may both get here
            if self._failed is not None:
                return self._failed
            reason = self._workers.reason() or detail
            self._failed = TensorParallelError(f"{reason}; the engine stops (tensor parallelism cannot "
                                               f"continue without every rank)")
        self._workers.stop()
        exit_soon = threading.Timer(FAULT_EXIT_S, os.kill, (os.getpid(), signal.SIGTERM))
        exit_soon.daemon = True  # a process that ends first (a CLI printing the error) is not held up
        exit_soon.start()
        return self._failed


def _shut_down(workers: _Workers, comm: Comm) -> None:
    """Stop the workers, then drop rank 0's process groups (a finalizer: the
    model garbage-collected, ``close``, or the interpreter's exit)."""
    workers.stop()
    comm.close()


def _monitor(model_ref, workers: _Workers) -> None:
    """Fail the model when a worker exits unless it is being stopped, or
    exits cleanly (status 0: rank 0's connection closed as this process ends)."""
    running = list(workers.processes)
    while running:
        done = wait([p.sentinel for p in running])
        exited = [p for p in running if p.sentinel in done]
        running = [p for p in running if p not in exited]
        for p in exited:
            p.join()
        if any(p.exitcode != 0 for p in exited) and not workers.stopping.is_set():
            model = model_ref()
            if model is not None:
                model.fail("a worker exited")
            return


def start(spec: object, *, size: int, backend: str, device: str | torch.device, dtype: torch.dtype,
          quantization: str = "none", environ=None) -> TensorParallelLM:
    """Rank 0 of ``size`` ranks over ``spec``: a resolved model folder, or a
    float ``DecoderLM`` in memory (left as it is; its tensors are shared
    with the workers, which copy their slices)."""
    env = os.environ if environ is None else environ
    timeout = timedelta(seconds=tp_timeout(env))
    device = torch.device(device)
    if isinstance(spec, nn.Module):
        check_float(spec)
        state = {k: v.detach().share_memory_() if v.device.type == "cpu" else v.detach()
                 for k, v in spec.state_dict().items()}
        spec = ("tensors", model_config(spec), state)
    else:
        spec = str(spec)
    config, source, where = source_for(spec, quantization)
    args = build_args(config)
    part = partition(args.num_attention_heads, args.num_key_value_heads, args.intermediate_size,
                     args.vocab_size, size)[0]
    launched = int(env.get("WORLD_SIZE", 1)) > 1  # torchrun started the other ranks
    if launched:
        if int(env["WORLD_SIZE"]) != size:
            raise OptionError(f"--tensor-parallel-size {size}, but WORLD_SIZE={env['WORLD_SIZE']} ranks were "
                              f"started: give the same number")
        store, host = _env_store(env, 0, size), None
    else:
        host = "127.0.0.1"
        store = dist.TCPStore(host, 0, size, True, timeout=STARTUP_TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    errors = None if launched else ctx.Queue()
    processes = [] if launched else [
        ctx.Process(target=worker_main, daemon=True, name=f"pagedlm-tp-{rank}",
                    args=(rank, size, host, store.port, backend, str(device), dtype, spec, quantization,
                          timeout, errors, os.getpid()))
        for rank in range(1, size)]
    workers = _Workers(processes, errors)
    try:
        for p in processes:
            p.start()
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(size))
        _await_workers(store, size, workers)
        comm = Comm(store, 0, size, backend, timeout, rank_device(device, 0))
        shard = load_shard(config, part, comm, source, rank_device(device, 0), dtype, where)
        del source
        sizes = comm.report(weight_bytes(shard))
    except BaseException as e:
        reason = workers.reason()
        workers.stop()
        if reason is not None:
            raise TensorParallelError(reason) from e
        raise
    return TensorParallelLM(shard, comm, build_args(config), part.vocab_padded, workers, sizes)


def _await_workers(store: dist.Store, size: int, workers: _Workers) -> None:
    """Wait until every worker is about to join the process groups (a group
    waits for all its ranks): a worker that fails first (an import, its
    device) is reported instead of waited for."""
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    for rank in range(1, size):
        while not store.check([f"joining/{rank}"]):
            if any(p.exitcode is not None for p in workers.processes):
                raise TensorParallelError(workers.reason())
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank {rank} did not start within "
                                          f"{STARTUP_TIMEOUT.total_seconds():.0f} s")
            time.sleep(JOIN_POLL_S)


def run_worker_from_env(spec: object, *, backend: str, device: str | torch.device, dtype: torch.dtype,
                        quantization: str = "none", environ=None) -> None:
    """Under torchrun (``RANK`` > 0, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``): be that rank until rank 0 stops."""
    env = os.environ if environ is None else environ
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    serve(rank, size, _env_store(env, rank, size), backend, torch.device(device), dtype, str(spec), quantization,
          timedelta(seconds=tp_timeout(env)))


def _env_store(env, rank: int, size: int) -> dist.Store:
    """The ranks' store at ``MASTER_ADDR:MASTER_PORT``: torchrun's own (its
    agent hosts it: ``TORCHELASTIC_USE_AGENT_STORE``), else rank 0 hosts it;
    our keys under a prefix of their own."""
    host, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500))
    hosting = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(host, port, size, hosting, timeout=STARTUP_TIMEOUT, wait_for_workers=False)
    return dist.PrefixStore("pagedlm/", store)
