"""Every Triton kernel of the CUDA path compiles for sm_90 with the types the
engine launches it with (`tests/fast/compile_kernels.py`, in a process of its
own without the interpreter): the interpreter the other kernel tests run
under does not type-check, and a decode kernel the GPU's compiler refused
passed them for a day (2026-12-04)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.fast.kernel_refs import requires_triton

ROOT = Path(__file__).resolve().parents[2]


@requires_triton
def test_every_kernel_compiles_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "tests.fast.compile_kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) == 41, done.stdout  # every case ran
