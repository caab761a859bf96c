"""A step's small host arrays (indices, positions) copied to the device without a stream sync.

``tensor.to("cuda")`` from host memory waits until every kernel queued before it has run: torch
synchronizes the stream after a blocking host-to-device copy. In a step that is the whole step
before it, so a copy of a few hundred indices in the middle of a launch made the host wait for
the device and stop preparing the next launches.

On CUDA the array goes through pinned memory: torch's caching host allocator gives a pinned
block, the bytes are copied into it on the host (from a fresh copy of the array, also when the
array is a view of pinned memory), and the device copy is queued ``non_blocking``. The host
returns at once, and the source array may be rewritten at once. The allocator does not hand the
block out again until the copy has run, because torch records an event on it. A ``non_blocking``
copy straight from pageable memory would not promise this: CUDA documents that such a copy "may
synchronize with the stream" when it stages the bytes (CUDA's "API synchronization behavior").
Other devices keep the blocking copy.
``tests/runtime/test_host_to_device.py`` checks on CUDA that the host does not wait for queued
kernels, and that the source may be overwritten right after the call.
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
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(device)
    # A fresh array first: pin_memory() returns a tensor over memory that is pinned already (a view
    # of a step's pinned buffers) as it is, and the host could rewrite that before the copy ran.
    host = torch.from_numpy(np.array(array, dtype=dtype, order="C"))
    return host.pin_memory().to(device, non_blocking=True)
