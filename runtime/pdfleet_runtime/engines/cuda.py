"""CUDA facts the adapters need about GPU regions, without making torch a dependency of the engines.

* ``allocation_range``: Mooncake's ``nvlink_intra`` shares memory with ``cudaIpcGetMemHandle``, and the
  peer maps the handle to the *start of the allocation*, then adds ``dst - registered_address``. A
  region that is not the start of its ``cudaMalloc`` allocation (a tensor carved from torch's
  caching allocator) would be written at the wrong offset, silently. The adapter registers whole
  allocations instead, found with ``cuMemGetAddressRange``.
* ``synchronize``: Mooncake's ``nvlink_intra`` issues a plain ``cudaMemcpy`` per entry, which for
  device-to-device copies returns before the copy ends; success therefore means "queued" until the
  device is synchronized.
* ``bind_thread``: the CUDA runtime's current device is per thread and starts at 0 in every new
  thread; an engine call from a worker thread must run on the rank's own GPU.

torch is imported lazily (only where a region is on ``cuda``); libcuda through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["allocation_range", "bind_thread", "device_index", "is_cuda", "synchronize"]


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def device_index(device: str) -> int:
    """``cuda`` -> 0, ``cuda:N`` -> N."""
    _, _, idx = device.partition(":")
    return int(idx or 0)


@functools.cache
def _libcuda() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuMemGetAddressRange_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return lib


def allocation_range(address: int, device: str) -> tuple[int, int]:
    """``(base, size)`` of the CUDA allocation holding ``address`` (a device pointer on ``device``)."""
    import torch

    torch.cuda.set_device(device_index(device))  # a current context for the driver call
    torch.cuda.synchronize()
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if rc != 0:
        raise RuntimeError(f"cuMemGetAddressRange({address:#x}) returned CUresult {rc}")
    return int(base.value), int(size.value)


def synchronize(device: str) -> None:
    """Wait until every copy queued on ``device`` (any stream) has ended; no-op for host memory."""
    if is_cuda(device):
        import torch

        torch.cuda.synchronize(device_index(device))


def bind_thread(device: str) -> None:
    """Make ``device`` the calling thread's current CUDA device (no-op for host memory)."""
    if is_cuda(device):
        import torch

        torch.cuda.set_device(device_index(device))
