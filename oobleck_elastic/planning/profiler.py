"""Measure a per-layer profile on this device, and cache it.

`profile_layers` runs the flat layers one at a time on one microbatch. Each layer's input is
materialised once under no_grad (the previous layer's output); then `warmup` untimed and
`repeats` timed iterations of

    forward:  out = layer(input.detach().requires_grad_())   (+ loss_fn for the last layer)
    backward: out.backward(randn_like(out))                   (loss.backward() for the last layer)

are timed and the medians kept: on the CPU with `time.perf_counter`; on CUDA with CUDA events
(`torch.cuda.Event(enable_timing=True)` recorded on the device's current stream around the forward
and the backward, read after the event that ends the backward has completed), so the times are
the kernels' own and include neither Python launch overhead nor host synchronisation. Memory
numbers are exact counts, not timings:

- param_bytes: bytes of the layer's parameter storages, each storage counted once;
  grad_bytes = param_bytes; optimizer_bytes = 2 x param_bytes for AdamW (two moments), 0 for SGD.
- activation_bytes: what autograd keeps for backward, measured in one extra forward under
  `torch.autograd.graph.saved_tensors_hooks`: saved tensors deduplicated by storage, excluding
  parameter storages.
- output_bytes: bytes of the layer's output tensor (what crosses a stage boundary).

`load_or_profile` returns the profile of a job: the file in `planning.profile_path` if set, else
a cached profile under `<cache_dir>/profiles/<profile_cache_key(key)>.json` whose stored key
equals the current key exactly (model config, microbatch shape, precision, optimizer, device
kind, library versions), else a fresh measurement of the model built with the job's seed, which
is then saved there. A cached file with another key is reported as stale and replaced. A
profile measured (or reused) on a CUDA device records that device's total memory
(`ModelProfile.device_memory_bytes`), the planner's default for `planning.device_memory_gb`.

`device_label(device)` names the device kind ("cuda NVIDIA H100 80GB HBM3", "cpu x86_64"): the
control plane shares one worker-measured profile per device kind under that name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..config import JobConfig
from ..models.tensor_parallel import local
from .profile import LayerProfile, ModelProfile, ProfileError, profile_cache_key

__all__ = ["device_label", "device_memory_bytes", "profile_layers", "profile_key", "load_or_profile"]

_OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}
MIB = 1024 ** 2


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    t = local(t)  # a tensor-parallel parameter: this device's shard
    return (str(t.device), t.untyped_storage().data_ptr())


def _param_bytes(layer: nn.Module) -> int:
    seen: dict[tuple[str, int], int] = {}
    for p in layer.parameters():
        seen.setdefault(_storage_key(p), local(p).untyped_storage().nbytes())
    return sum(seen.values())


class _SavedTensorMeter:
    """Pack hook that adds up the storages autograd saves, skipping parameter storages."""

    def __init__(self, exclude: set[tuple[str, int]]) -> None:
        self.exclude, self.seen = exclude, {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key, size = _storage_key(t), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            key, size = ("id", id(t)), t.numel() * t.element_size()
        if key not in self.exclude:
            self.seen.setdefault(key, size)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())


def profile_layers(layers: Sequence[nn.Module], sample_input: torch.Tensor, labels: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   warmup: int = 1, repeats: int = 5, optimizer: str = "adamw",
                   key: dict[str, Any] | None = None, names: Sequence[str] | None = None,
                   precision: str = "fp32",
                   log: Callable[[str], None] | None = None) -> ModelProfile:
    """Profile every layer on one microbatch (see the module docstring); layers must be built
    and on sample_input's device. The last layer is profiled together with loss_fn."""
    if not layers or any(layer is None for layer in layers):
        raise ValueError("profile_layers needs every layer built (no None entries)")
    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"optimizer '{optimizer}' unknown; choose one of "
                         f"{', '.join(_OPTIMIZER_STATES)}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision '{precision}' unknown; choose fp32 or bf16")
    names = list(names) if names is not None else [f"layer.{i}" for i in range(len(layers))]
    device = sample_input.device
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def autocast() -> Any:
        if precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(layer: nn.Module, x: torch.Tensor, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        inp = x.detach()
        if inp.is_floating_point():
            inp.requires_grad_(True)
        with autocast():
            out = layer(inp)
            target = loss_fn(out, labels) if last else out
        return out, target

    def clear_grads(layer: nn.Module) -> None:
        for p in layer.parameters():
            p.grad = None

    def timed_iteration(layer: nn.Module, x: torch.Tensor, last: bool) -> tuple[float, float]:
        """(forward, backward) seconds of one iteration of `layer` on input `x`."""
        if cuda:
            fwd0, fwd1, bwd0, bwd1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            fwd0.record()
            out, target = forward(layer, x, last)
            fwd1.record()
            grad = None if last else torch.randn_like(out)
            bwd0.record()
            if target.requires_grad:
                target.backward(grad)
            bwd1.record()
            bwd1.synchronize()
            fwd_s, bwd_s = fwd0.elapsed_time(fwd1) / 1e3, bwd0.elapsed_time(bwd1) / 1e3
        else:
            sync()
            t0 = time.perf_counter()
            out, target = forward(layer, x, last)
            sync()
            t1 = time.perf_counter()
            grad = None if last else torch.randn_like(out)
            sync()
            t2 = time.perf_counter()
            if target.requires_grad:
                target.backward(grad)
            sync()
            t3 = time.perf_counter()
            fwd_s, bwd_s = t1 - t0, t3 - t2
        del out, target, grad
        clear_grads(layer)
        return fwd_s, bwd_s

    result: list[LayerProfile] = []
    x = sample_input
    rng_devices = [device] if cuda else []
    # CUDA events record on the current device's current stream: make `device` the current one
    on_device = torch.cuda.device(device) if cuda else contextlib.nullcontext()
    with torch.random.fork_rng(devices=rng_devices), on_device:
        torch.manual_seed(0)
        sync()
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            fwd_times, bwd_times = [], []
            for it in range(warmup + repeats):
                fwd_s, bwd_s = timed_iteration(layer, x, last)
                if it >= warmup:
                    fwd_times.append(fwd_s)
                    bwd_times.append(bwd_s)
            exclude = {_storage_key(p) for p in layer.parameters()}
            meter = _SavedTensorMeter(exclude)
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                out, target = forward(layer, x, last)
            output_bytes = out.numel() * out.element_size()
            del out, target
            pbytes = _param_bytes(layer)
            prof = LayerProfile(
                name=names[i], forward_s=statistics.median(fwd_times),
                backward_s=statistics.median(bwd_times), param_bytes=pbytes, grad_bytes=pbytes,
                optimizer_bytes=_OPTIMIZER_STATES[optimizer] * pbytes,
                activation_bytes=meter.nbytes, output_bytes=output_bytes)
            result.append(prof)
            if log is not None:
                log(f"profiling layer {i + 1}/{len(layers)} {names[i]}: fwd "
                    f"{prof.forward_s * 1e3:.2f} ms, bwd {prof.backward_s * 1e3:.2f} ms, "
                    f"params {pbytes / MIB:.2f} MiB, activations "
                    f"{prof.activation_bytes / MIB:.2f} MiB")
            if not last:
                with torch.no_grad(), autocast():
                    x = layer(x)
    return ModelProfile(layers=result, key=dict(key or {}))


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
    key = {
        "model": model,
        "microbatch_size": cfg.training.microbatch_size,
        "seq_len": cfg.data.seq_len,
        "precision": cfg.training.precision,
        "dtype": "bfloat16" if cfg.training.precision == "bf16" else "float32",
        "optimizer": cfg.training.optimizer.name,
        "device": dev.type,
        "device_name": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if dev.type == "cuda":
        key["timer"] = "cuda_events"  # profiles timed with synchronize + perf_counter are stale
    return json.loads(json.dumps(key, sort_keys=True))  # exactly what a JSON round trip gives


def _key_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(keys) or "?"


def load_or_profile(cfg: JobConfig, *, device: str | torch.device = "cpu",
                    cache_dir: str | Path | None = None,
                    log: Callable[[str], None] = print) -> ModelProfile:
    """The job's profile: `planning.profile_path`, else a cache hit with the same key, else a
    fresh measurement (saved to the cache). See the module docstring."""
    from ..models import build_layer_model

    if cfg.planning.profile_path:
        prof = ModelProfile.load(cfg.planning.profile_path)
        log(f"profile: using {cfg.planning.profile_path} ({prof.num_layers} layers)")
        expected = cfg.model.num_layers + 2
        if cfg.model.family != "custom" and not cfg.model.pretrained_path \
                and prof.num_layers != expected:
            log(f"profile: warning: {cfg.planning.profile_path} has {prof.num_layers} layers but "
                f"model.num_layers={cfg.model.num_layers} gives {expected}")
        return prof
    key = profile_key(cfg, device=device)
    path = Path(cache_dir or cfg.data.cache_dir) / "profiles" / f"{profile_cache_key(key)}.json"
    if path.is_file():
        try:
            cached = ModelProfile.load(path)
        except ProfileError as err:
            log(f"profile: cached {path} is unreadable ({err}); re-profiling")
        else:
            if cached.key == key:
                log(f"profile: reusing cached {path} ({cached.num_layers} layers)")
                cached.device_memory_bytes = device_memory_bytes(device) or cached.device_memory_bytes
                return cached
            log(f"profile: cached {path} is stale (key differs in {_key_diff(cached.key, key)}); "
                "re-profiling")
    lm = build_layer_model(cfg.model, seed=cfg.training.seed, device=device)
    gen = torch.Generator().manual_seed(cfg.training.seed)
    shape = (cfg.training.microbatch_size, cfg.data.seq_len)
    ids = torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device)
    labels = torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device)
    log(f"profile: measuring {lm.num_layers} layers on {device} (microbatch {shape[0]} x "
        f"{shape[1]}, {cfg.training.precision})")
    prof = profile_layers(lm.layers, ids, labels, lm.loss_fn,
                          warmup=cfg.planning.profile_warmup, repeats=cfg.planning.profile_repeats,
                          optimizer=cfg.training.optimizer.name, key=key, names=lm.names,
                          precision=cfg.training.precision, log=log)
    prof.device_memory_bytes = device_memory_bytes(device)
    prof.save(path)
    log(f"profile: saved {path}")
    return prof
