"""Model FLOPs utilisation (MFU): the FLOPs a token costs, a device's peak, and what a step achieved.

`flops_per_token`: 6·N + 12·L·H·T as torchtitan and nanoGPT count it (N the parameters in a
matrix multiply, the embedding's lookups excluded, a tied head included; L blocks, H the hidden
size, T the sequence length; no recomputation, no causal discount). `device_peak_tflops`:
`training.peak_tflops`, else the device's dense peak from `PEAK_TFLOPS` for the precision.
`Throughput.of`: tokens/s, TFLOP/s per training device, MFU (unknown without a peak).
docs/training.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from ...config import JobConfig, ModelConfig

__all__ = ["PEAK_TFLOPS", "flops_per_token", "device_peak_tflops", "peak_row", "Throughput"]

PEAK_TFLOPS: dict[str, tuple[float, float, float]] = {
    # model words (lower case): (bf16 dense, tf32 dense, fp32), TFLOP/s, from NVIDIA's data sheets
    # (the with-sparsity figures halved); matched word by word against the device's name
    "gb200": (2500.0, 1250.0, 80.0),
    "b200": (2250.0, 1100.0, 75.0),
    "gh200": (989.5, 494.7, 66.9),
    "h200": (989.5, 494.7, 66.9),
    "h100 nvl": (835.5, 417.8, 60.0),
    "h100 pcie": (756.5, 378.0, 51.2),
    "h100": (989.5, 494.7, 66.9),  # SXM ("NVIDIA H100 80GB HBM3")
    "a100": (312.0, 156.0, 19.5),
    "l40s": (362.1, 183.0, 91.6),
    "l40": (181.05, 90.5, 90.5),
    "l4": (121.0, 60.0, 30.3),
    "a10g": (70.0, 35.0, 31.2),
    "a10": (125.0, 62.5, 31.2),
}
"""Dense peak TFLOP/s of known GPUs by the words of their model in `torch.cuda.get_device_name()`."""


def flops_per_token(cfg: JobConfig, seq_len: Optional[int] = None) -> Optional[float]:
    """Training FLOPs of one token, 6·N + 12·L·H·T, for the job's model at `seq_len`
    (default `data.seq_len`); built on the meta device, so it costs no memory. None for a custom
    model (`model.family=custom`): its blocks, hidden size and attention are unknown, and a
    count from guessed ones would be a made-up figure."""
    from ...models.build import build_meta_layers, num_layers

    m: ModelConfig = cfg.model
    if m.family == "custom":
        return None
    n = num_layers(m)
    layers = build_meta_layers(m, n, seed=cfg.training.seed)
    matmul_params = sum(p.numel() for layer in layers[1:] for p in layer.parameters())
    blocks = n - 2
    hidden = _hidden_size(m)
    t = seq_len if seq_len is not None else cfg.data.seq_len
    return 6.0 * matmul_params + 12.0 * blocks * hidden * t


def _hidden_size(m: ModelConfig) -> int:
    if m.pretrained_path:
        from ...models.pretrained import pretrained_config

        config = pretrained_config(m)
        return int(getattr(config, "hidden_size", getattr(config, "n_embd", m.hidden_size)))
    return m.hidden_size


def device_peak_tflops(device: torch.device, precision: str, override: Optional[float] = None) -> Optional[float]:
    """The device's dense peak TFLOP/s for `precision` (`bf16` or `fp32`); `override` (the
    `training.peak_tflops` setting) wins; None when unknown (a CPU, an unlisted GPU). bf16 tensor
    cores under bf16; TF32 under fp32 when torch lets matrix multiplies use it, plain FP32 otherwise."""
    if override:
        return float(override)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_for_name(torch.cuda.get_device_name(device), precision, tf32=torch.backends.cuda.matmul.allow_tf32)


def name_words(name: str) -> list[str]:
    """A device name's words, lower case, split at anything but letters and digits
    ("NVIDIA A100-SXM4-80GB" -> nvidia, a100, sxm4, 80gb)."""
    return re.findall(r"[a-z0-9]+", name.lower())


def peak_row(name: str) -> Optional[str]:
    """The `PEAK_TFLOPS` row of a device name (pure, for tests): the row whose words all are words
    of the name, the most specific (most words) if several are; None when none is. Whole words
    only: "NVIDIA L40" is not an L4, "NVIDIA GH200" not an H200."""
    words = set(name_words(name))
    rows = [row for row in PEAK_TFLOPS if set(row.split()) <= words]
    return max(rows, key=lambda row: len(row.split()), default=None)


def peak_for_name(name: str, precision: str, *, tf32: bool) -> Optional[float]:
    """The device's peak by its name (`peak_row`): bf16 tensor cores, else TF32 or FP32."""
    row = peak_row(name)
    if row is None:
        return None
    bf16, tf32_peak, fp32 = PEAK_TFLOPS[row]
    return bf16 if precision == "bf16" else tf32_peak if tf32 else fp32


@dataclass(frozen=True)
class Throughput:
    """What one step achieved."""

    tokens_per_s: float
    """Tokens of the global batch over the step's wall time."""
    tflops_per_device: Optional[float]
    """Model TFLOP/s per worker that trains (None when the FLOPs per token are unknown)."""
    mfu: Optional[float]
    """tflops_per_device over the device's peak (None when either is unknown)."""

    @classmethod
    def of(
        cls,
        *,
        tokens: int,
        seconds: float,
        flops_per_token: Optional[float],
        devices: int,
        peak_tflops: Optional[float],
    ) -> "Throughput":
        tps = tokens / seconds if seconds > 0 else 0.0
        if flops_per_token is None:
            return cls(tokens_per_s=tps, tflops_per_device=None, mfu=None)
        per_device = tps * flops_per_token / max(1, devices) / 1e12
        return cls(
            tokens_per_s=tps, tflops_per_device=per_device, mfu=per_device / peak_tflops if peak_tflops else None
        )

    def describe(self, *, hint: bool = True) -> str:
        """Tokens/s, TFLOP/s and MFU; an unknown MFU is said (with how to know it) only with `hint`."""
        if self.tflops_per_device is None:
            return f"{self.tokens_per_s:,.0f} tokens/s" + (", TFLOP/s and MFU unknown (a custom model)" if hint else "")
        text = f"{self.tokens_per_s:,.0f} tokens/s, {self.tflops_per_device:.3g} TFLOP/s per device"
        if self.mfu is not None:
            return f"{text}, MFU {100 * self.mfu:.1f} %"
        return text + (", MFU unknown (set training.peak_tflops)" if hint else "")
