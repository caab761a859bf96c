"""A step's small host arrays (indices, positions) copied to the device without a stream sync.

``tensor.to("cuda")`` from host memory waits until every kernel queued before it has run: torch
synchronizes the stream after a blocking host-to-device copy. In a step that is the whole step
before it, so a copy of a few hundred indices in the middle of a launch made the host wait for
the device and stop preparing the next launches. On CUDA the copy here is ``non_blocking``: from
pageable memory the driver stages the bytes before the call returns (CUDA's "API synchronization
behavior"), so the source array may be freed or overwritten at once (the helper copies it into a
fresh array first, so that holds for a view of pinned memory too), and no device work is waited
for (``tests/runtime/test_host_to_device.py`` checks both). Other devices keep the
blocking copy: their runtimes do not promise that staging.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["host_to_device"]


def host_to_device(array: Any, device: torch.device | str, dtype: Any = np.int64) -> torch.Tensor:
    """``array`` (anything numpy takes) as a ``dtype`` tensor on ``device``; on CUDA without
    waiting for the work queued on the current stream."""
    device = torch.device(device)
    # Always a fresh (pageable) array: a view of a step's pinned buffers would be copied
    # asynchronously, and the host could rewrite it before the copy ran.
    host = torch.from_numpy(np.array(array, dtype=dtype, order="C"))
    return host.to(device, non_blocking=device.type == "cuda")
