"""How much memory a worker holds: its peak resident set and, on CUDA, its peak device memory.

A worker materialises only the layers of its stage (engine/trainer.py), so its memory is its
stage's training state (parameters, gradients, optimizer moments, in-flight activations) plus a
constant (the interpreter, torch, the dataset, communication buffers) that does not grow with
the model. These figures make that a measured property rather than a promise:

- `peak_rss_bytes()`: the process's high-water mark of resident memory, as the kernel counts it
  (`VmHWM` in /proc/self/status; `ru_maxrss` where /proc is missing). It never decreases.
- `current_rss_bytes()`: resident memory now (`VmRSS`), e.g. a worker's baseline before it
  holds any layer.
- `peak_device_bytes(device)`: `torch.cuda.max_memory_allocated` on a CUDA device (tensors
  only, not the allocator's cache), None elsewhere.

Each worker logs its figures before its first step and at every progress line, and carries them
in the step's commit all-reduce (a MAX, no extra collective), so the TensorBoard writer records
the largest worker's as `memory/peak_rss_gb` and `memory/peak_device_gb`.
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
