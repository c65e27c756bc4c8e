"""``to_device``: the values and dtype that torch's own conversion gives,
from lists, nested lists and numpy arrays of another dtype (numpy converts
them now, on one thread), on the CPU and, where there is one, on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedlm.kernels.copies import to_device

CASES = [
    ([3, -1, 7, 2**40], torch.long),
    ([[0.5, float("inf"), 3.0, -0.25], [1.0, 2.0, 0.0, 1e-8]], torch.float32),
    (np.arange(-5, 70000, dtype=np.int64), torch.int32),  # past torch's parallel grain: a large copy
    (np.array([[1, -2], [3, 4]], dtype=np.int32), torch.long),
    ([1.5, -2.75, 3.999], torch.int32),  # truncated toward zero, as torch does
    ([True, False, True], torch.bool),
    ([0.1, 2.5, -3.0], torch.bfloat16),  # numpy has no bfloat16: torch converts
]


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
@pytest.mark.parametrize("values,dtype", CASES, ids=[f"{i}-{d}" for i, (_, d) in enumerate(CASES)])
def test_to_device_gives_torch_conversion(values, dtype, device):
    got = to_device(values, dtype, device)  # on CUDA: through pinned memory, numpy's copy or torch's
    want = torch.from_numpy(np.asarray(values)).to(dtype)
    assert got.device.type == device and got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.cpu(), want)
