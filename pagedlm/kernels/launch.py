"""How every Triton kernel of the engine launches: on NVIDIA Hopper and
later, as a programmatic dependent of the kernel before it in the stream
(PDL, ``launch_options``), its programs waiting for that kernel in
``await_inputs``. A batch-1 step is a chain of a few hundred small
kernels; each paid its launch and ramp-up after the one before had
drained (`docs/design/gpu-fast-path.md`, "Programmatic dependent launch").

Each kernel takes a ``PDL`` constant and calls ``await_inputs(PDL)`` as its
first statement (the one-row product reads its first weight tile before
it: `gemv._row_kernel`); each launch passes ``**launch_options(device)``.
Elsewhere (older GPUs, ROCm, the CPU and the interpreter) ``PDL`` is off
and the kernels are plain launches.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: no kernel launches
    triton = None

PDL = True  # on where the device can (``launch_options``); False: plain launches everywhere


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    """NVIDIA Hopper or later (ROCm's devices are "cuda" to torch too)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` are programmatic dependents."""
    return PDL and _pdl_capable(device)


def launch_options(device: torch.device) -> dict:
    """The launch arguments every kernel takes: on Hopper (and later) each
    launches as a programmatic dependent of the kernel before it in the
    stream (``launch_pdl``), so its programs are resident and waiting
    (``await_inputs``) while that kernel drains: the launch and ramp-up
    between two kernels of a step overlap the first's tail."""
    on = pdl_on(device)
    return dict(PDL=on, launch_pdl=on)


if triton is not None:

    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """With PDL (a programmatic dependent launch): wait until the kernel
        before has finished and its writes show, then let the kernel after
        launch its programs (they wait here likewise). Every program calls it
        before it reads what a kernel wrote or writes anything: the wait
        orders a kernel after all those before only if every program of every
        kernel makes it."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
