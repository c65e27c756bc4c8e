"""Tensor parallelism's faults and shutdown, each in its own process (a fault
ends the process by design): a worker killed mid-request (under `LLM`, and
under `pagedlm serve` with a client streaming), a worker that raises,
SIGTERM and Ctrl-C to the engine's process, the model garbage-collected.
Each ends within seconds, with the error said, and leaves no worker process
behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXIT_S = 15  # spawn and import time on a loaded 2-core machine, plus the few seconds the fault may take

SCRIPT = r'''
import gc, os, signal, sys, time, torch
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as a terminal's process has it (not inherited ignored)
from pagedlm import LLM, SamplingParams
from pagedlm.models import build_model
from tests.helpers import CharTokenizer

mode, pidfile = sys.argv[1:]
torch.manual_seed(0)
model = build_model(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         max_position_embeddings=4096)).eval().requires_grad_(False)
llm = LLM(model, tokenizer=CharTokenizer(), tensor_parallel_size=2)
pids = [p.pid for p in llm.engine.model._workers.processes]
with open(pidfile, "w") as f:
    f.write(" ".join(map(str, pids)))
if mode == "gc":
    del llm
    gc.collect()
    print("collected", flush=True)
    time.sleep(60)
if mode == "raise":
    llm.engine.model.comm.send(("bogus",))  # a message the worker does not know: it raises
print("ready", flush=True)
while True:
    llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=4000, ignore_eos=True), use_tqdm=False)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _start(mode: str, tmp_path) -> tuple[subprocess.Popen, list[int]]:
    pidfile = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(pidfile)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()  # "ready" (or "collected"): the workers run
    assert line.strip() in ("ready", "collected"), proc.communicate(timeout=EXIT_S)[1][-2000:]
    return proc, [int(p) for p in pidfile.read_text().split()]


def _ends(proc: subprocess.Popen, pids: list[int]) -> tuple[int, str]:
    """The process's exit status and stderr; it and every worker gone within seconds."""
    try:
        _, err = proc.communicate(timeout=EXIT_S)
    finally:
        proc.kill()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "orphaned workers"
    return proc.returncode, err


def test_a_worker_killed_mid_request_fails_it_and_the_engine_exits(tmp_path):
    proc, pids = _start("kill", tmp_path)
    time.sleep(1.0)  # mid-generation
    started = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    code, err = _ends(proc, pids)
    assert time.monotonic() - started < 10
    assert code != 0
    assert "tensor-parallel worker 1" in err and "the engine stops" in err


def test_a_worker_that_raises_fails_the_request_with_its_error(tmp_path):
    proc, pids = _start("raise", tmp_path)
    code, err = _ends(proc, pids)
    assert code != 0
    assert "tensor-parallel worker 1 failed: ValueError: unknown message 'bogus'" in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_to_the_engine_leaves_no_worker(tmp_path, sig):
    proc, pids = _start("serve", tmp_path)
    time.sleep(0.5)
    proc.send_signal(sig)
    code, _ = _ends(proc, pids)
    assert code != 0


def test_the_model_garbage_collected_stops_its_workers(tmp_path):
    proc, pids = _start("gc", tmp_path)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not [p for p in pids if _alive(p)]
        assert proc.poll() is None  # the process itself goes on: a collected model is no fault
    finally:
        proc.kill()
        proc.communicate()


def _tiny_folder(path: Path) -> Path:
    """A Hugging Face folder of a tiny random model over the tiny byte-level tokenizer."""
    import json

    import torch
    from safetensors.torch import save_file

    from pagedlm.bench.common import unfuse
    from pagedlm.models import build_model
    from tests.helpers import byte_level

    tokenizer = byte_level()
    config = dict(model_type="llama", vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = build_model(config)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "add_bos_token": False}))
    tokenizer.save(str(path / "tokenizer.json"))
    weights = {k: v.contiguous() for k, v in unfuse(model.state_dict(), config).items()}
    save_file(weights, str(path / "model.safetensors"))
    return path


def test_the_server_fails_a_stream_when_a_worker_dies_and_exits(tmp_path):
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = _tiny_folder(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLM_")}
    proc = subprocess.Popen([sys.executable, "-m", "pagedlm.cli", "serve", "--model", str(folder), "--port", str(port),
                             "--tensor-parallel-size", "2"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**env, "PYTHONPATH": str(ROOT)})
    url, workers = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        workers = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat") if _parent(p) == proc.pid]
        assert len(workers) == 1  # rank 1
        lines = []
        body = {"model": str(folder), "prompt": "hello", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in filter(None, r.iter_lines()):  # SSE events, without their blank separators
                lines.append(line)
                if len(lines) == 10:  # mid-stream
                    os.kill(workers[0], signal.SIGKILL)
                    killed = time.monotonic()
        assert any("tensor-parallel worker 1" in line for line in lines[10:]), lines[-3:]
        assert lines[-1] == "data: [DONE]"
        proc.wait(timeout=EXIT_S)
        assert time.monotonic() - killed < 10
    finally:
        proc.kill()
        proc.communicate()
    assert not [p for p in workers if _alive(p)]


def _parent(stat: Path) -> int | None:
    """The parent pid in a /proc/PID/stat; None for multiprocessing's resource tracker or a process gone."""
    try:
        if b"resource_tracker" in (stat.parent / "cmdline").read_bytes():
            return None
        return int(stat.read_text().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
