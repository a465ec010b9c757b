"""Which profile a job uses: a given file, a cached measurement with the same key, or a new one.

`load_or_profile`: `planning.profile_path` if set, else a cached profile whose stored key equals
`profile_key` exactly (model, microbatch shape, precision, optimizer, device kind, library
versions, ...), else a fresh measurement saved there; a stale file is replaced, and
`planning.reprofile` measures anew. A CUDA profile records its device's memory, the default for
`planning.device_memory_gb`. `device_label` names the device kind the control plane shares one
worker-measured profile under. docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ...config import JobConfig
from .microbatch import profile_microbatch_sizes
from .profile import ModelProfile, ProfileError, profile_cache_key, recompute_mismatch
from .profiler import profile_model
from .progress import format_seconds

__all__ = ["device_label", "device_memory_bytes", "load_or_profile", "profile_key"]


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine()


def device_label(device: str | torch.device) -> str:
    """The device kind a profile is valid for: its type and model name, e.g.
    "cuda NVIDIA H100 80GB HBM3" or "cpu x86_64" (every device of one kind shares one profile)."""
    dev = torch.device(device)
    return f"{dev.type} {_device_name(dev)}"


def device_memory_bytes(device: str | torch.device) -> int | None:
    """Total memory of a CUDA device in bytes; None for the CPU (its memory is the node's, shared
    by all its workers, not one device's)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    return None


def profile_key(cfg: JobConfig, *, device: str | torch.device) -> dict[str, Any]:
    """Everything a measured profile depends on, as a plain JSON-able dict."""
    import transformers

    dev = torch.device(device)
    device_name = _device_name(dev)
    model = dataclasses.asdict(cfg.model)
    if cfg.model.pretrained_path:
        conf = Path(cfg.model.pretrained_path).expanduser() / "config.json"
        if conf.is_file():
            model["pretrained_config_sha256"] = hashlib.sha256(conf.read_bytes()).hexdigest()
    key: dict[str, Any] = {
        "model": model,
        "microbatch_size": cfg.training.microbatch_size,  # a number, or "auto"
        "seq_len": cfg.data.seq_len,
        "precision": cfg.training.precision,
        "dtype": "bfloat16" if cfg.training.precision == "bf16" else "float32",
        "optimizer": cfg.training.optimizer.name,
        "device": dev.type,
        "device_name": device_name,
        "identical_blocks_once": cfg.planning.profile_identical_blocks_once,
        # profiles cached before the backward was also timed split (input_grad_s, weight_grad_s)
        # are stale: measured again once, not planned with the share forever
        "backward_split": "stage_backward_input+weight",
        # measured without recomputation, the numbers under it derived: one profile for every mode
        # (older profiles, measured under one mode, are stale)
        "recomputed_variant": "derived",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if cfg.training.microbatch_size == "auto":
        key["profiled_microbatch_sizes"] = profile_microbatch_sizes(cfg)
    if dev.type == "cuda":
        key["timer"] = "cuda_events"  # profiles timed with synchronize + perf_counter are stale
    return json.loads(json.dumps(key, sort_keys=True))  # exactly what a JSON round trip gives


def _key_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(keys) or "?"


REPROFILE_HINT = "oobleck plan --reprofile, or planning.reprofile=true for a job"
"""How to measure a cached profile again (named when a cached profile is reused)."""


def load_or_profile(
    cfg: JobConfig,
    *,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    reprofile: bool = False,
    now: Callable[[], float] = time.time,
) -> ModelProfile:
    """The job's profile: `planning.profile_path`, else a cache hit with the same key, else a
    fresh measurement (`profile_model`, saved to the cache). `reprofile` (or
    `planning.reprofile`) measures again and replaces the cached file. See the module docstring."""
    if cfg.planning.profile_path:
        prof = ModelProfile.load(cfg.planning.profile_path)
        mismatch = recompute_mismatch(cfg, prof, cfg.planning.profile_path)
        if mismatch:
            raise ProfileError(mismatch)
        log(f"profile: using {cfg.planning.profile_path} ({prof.num_layers} layers)")
        expected = cfg.model.num_layers + 2
        if cfg.model.family != "custom" and not cfg.model.pretrained_path and prof.num_layers != expected:
            log(
                f"profile: warning: {cfg.planning.profile_path} has {prof.num_layers} layers but "
                f"model.num_layers={cfg.model.num_layers} gives {expected}"
            )
        return prof
    key = profile_key(cfg, device=device)
    path = Path(cache_dir or cfg.data.cache_dir).expanduser() / "profiles" / f"{profile_cache_key(key)}.json"
    if (reprofile or cfg.planning.reprofile) and path.is_file():
        age = format_seconds(now() - path.stat().st_mtime)
        log(f"profile: measuring again as asked (reprofile): replacing {path}, measured {age} ago")
    elif path.is_file():
        try:
            cached = ModelProfile.load(path)
        except ProfileError as err:
            log(f"profile: cached {path} is unreadable ({err}); re-profiling")
        else:
            if cached.key == key:
                log(
                    f"profile: reusing cached {path} ({cached.num_layers} layers), measured "
                    f"{format_seconds(now() - path.stat().st_mtime)} ago; to measure again: {REPROFILE_HINT}"
                )
                cached.device_memory_bytes = device_memory_bytes(device) or cached.device_memory_bytes
                return cached
            log(f"profile: cached {path} is stale (key differs in {_key_diff(cached.key, key)}); re-profiling")
    prof = profile_model(cfg, device=device, key=key, log=log)
    prof.device_memory_bytes = device_memory_bytes(device)
    prof.save(path)
    log(f"profile: saved {path}")
    return prof
