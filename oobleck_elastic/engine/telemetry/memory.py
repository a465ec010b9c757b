"""How much memory a worker holds: its peak resident set (`peak_rss_bytes`, the kernel's `VmHWM`),
its resident set now (`current_rss_bytes`) and, on CUDA, its peak device memory
(`peak_device_bytes`: tensors only, not the allocator's cache).

Invariant: a worker materialises only its stage's layers, so its memory is its stage's training
state plus a constant that does not grow with the model; these figures make that measured. They
ride on the step's commit (a MAX), so TensorBoard records the largest worker's. docs/training.md.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Optional

import torch

GB = 1e9
_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> Optional[int]:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes."""
    kb = _status_kb("VmHWM")
    if kb is None:  # no /proc: ru_maxrss is in kB on Linux, in bytes on macOS
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    return kb * 1024


def current_rss_bytes() -> int:
    """This process's resident memory now, in bytes (the peak where /proc is missing)."""
    kb = _status_kb("VmRSS")
    return kb * 1024 if kb is not None else peak_rss_bytes()


def peak_device_bytes(device: torch.device) -> Optional[int]:
    """Peak bytes allocated by tensors on a CUDA `device`; None on other devices."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def describe(peak_rss: int, peak_device: Optional[int]) -> str:
    """`peak RSS 1.234 GB, device 5.678 GB` (the device part only on CUDA)."""
    text = f"peak RSS {peak_rss / GB:.3f} GB"
    return text + (f", device {peak_device / GB:.3f} GB" if peak_device is not None else "")
