"""Small host data to the device without waiting for it: ``to_device``."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a list, tuple or numpy array) as a tensor on ``device``,
    without making the host wait for the device: on CUDA the copy leaves
    from pinned memory, queued on the current stream. (A copy from pageable
    memory waits for every kernel queued before it: the host could not
    prepare a step while the last one runs.)"""
    host = torch.from_numpy(np.asarray(values)).to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
