"""Measure a per-layer profile on this device, one layer at a time.

`profile_model` builds layer i alone, measures it (`LayerMeter`, layer_meter.py), frees it, then
builds layer i+1 on the previous output: the largest layer, not the model, bounds the memory.
With `planning.profile_identical_blocks_once`, layers of one `layer_kind` (computed on meta
copies) are measured once and share the numbers (exact bytes; the first block's times). With
`training.microbatch_size: auto` every layer is measured at the sizes of
`microbatch.profile_microbatch_sizes`. docs/planning.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn

from ...config import JobConfig
from .layer_meter import LayerMeter, check_settings
from .microbatch import profile_microbatch_sizes
from .profile import LayerProfile, ModelProfile
from .progress import ProfileProgress

__all__ = [
    "layer_kind",
    "profile_layers",
    "layers_to_measure",
    "profile_layer_by_layer",
    "profile_model",
]

MIB = 1024**2


_SIMPLE_TYPES = (bool, int, float, str, type(None))
_INDEX_ATTRIBUTES = frozenset({"layer_idx"})  # a block's position: no part of its work


def layer_kind(layer: nn.Module) -> tuple:
    """What two layers must share to be measured once (`planning.profile_identical_blocks_once`):
    for the layer and each submodule its name, class and plain attributes (int, float, str, bool,
    None: widths, heads, eps, dropout, attention type...; `layer_idx` left out), and the name,
    shape and dtype of every parameter and buffer. Works on meta layers (no weights needed)."""
    modules = tuple(
        (
            name,
            f"{type(m).__module__}.{type(m).__qualname__}",
            tuple(
                sorted(
                    (k, v)
                    for k, v in vars(m).items()
                    if not k.startswith("_") and k not in _INDEX_ATTRIBUTES and isinstance(v, _SIMPLE_TYPES)
                )
            ),
        )
        for name, m in layer.named_modules(remove_duplicate=False)
    )
    params = tuple(
        (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in layer.named_parameters(remove_duplicate=False)
    )
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in layer.named_buffers(remove_duplicate=False))
    return modules, params, buffers


def layers_to_measure(kinds: Sequence[Hashable | None] | None, num_layers: int) -> int:
    """How many of `num_layers` layers `profile_layer_by_layer` builds and measures: one per
    distinct kind (the last layer apart, as it is measured with the loss), every layer without a
    kind. Layers of one kind with different input shapes are each measured, which this count (for
    progress only) does not foresee."""
    if kinds is None:
        return num_layers
    seen = {(k, i == num_layers - 1) for i, k in enumerate(kinds) if k is not None}
    return len(seen) + sum(1 for k in kinds if k is None)


def profile_layer_by_layer(
    build: Callable[[int], nn.Module],
    num_layers: int,
    sample_input: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    kinds: Sequence[Hashable | None] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    optimizer: str = "adamw",
    key: dict[str, Any] | None = None,
    names: Sequence[str] | None = None,
    precision: str = "fp32",
    release: bool = True,
    log: Callable[[str], None] | None = None,
    progress: ProfileProgress | None = None,
) -> ModelProfile:
    """Profile layers 0..num_layers-1, holding one at a time: `build(i)` returns layer i on
    sample_input's device; after its measurement the profiler drops it (with `release`, also
    gc.collect() and, on CUDA, empty_cache()) and keeps only its output, the next layer's input.

    With `kinds` (one hashable per layer, e.g. `layer_kind` of its meta copy; None = always
    measure), a layer whose kind, input shape and dtype equal those of a layer measured before is
    not built: it gets that layer's numbers under its own name, and the earlier output (same
    shape) goes on as its output. The last layer is profiled together with loss_fn.

    With `log`, one line per measured layer and one per run of layers given the same layer's
    numbers, and progress lines with the time left (`progress`, or one made
    here for this call: planning/profile/progress.py)."""
    check_settings(optimizer, warmup, repeats, precision)
    if num_layers < 1:
        raise ValueError("profile_layer_by_layer needs at least one layer")
    if kinds is not None and len(kinds) != num_layers:
        raise ValueError(f"kinds has {len(kinds)} entries for {num_layers} layers; give one per layer")
    names = list(names) if names is not None else [f"layer.{i}" for i in range(num_layers)]
    if progress is None and log is not None:
        progress = ProfileProgress(layers_to_measure(kinds, num_layers), warmup + repeats, log)
    device = sample_input.device
    cuda = device.type == "cuda"
    meter = LayerMeter(
        labels, loss_fn, device=device, warmup=warmup, repeats=repeats, optimizer=optimizer, precision=precision
    )
    result: list[LayerProfile] = []
    measured: dict[Hashable, tuple[int, LayerProfile, torch.Size, torch.dtype]] = {}
    reused: list[tuple[int, int]] = []  # (layer, the measured layer whose numbers it got), not yet logged
    x = sample_input
    rng_devices = [device] if cuda else []
    # CUDA events record on the current device's current stream: make `device` the current one
    on_device = torch.cuda.device(device) if cuda else contextlib.nullcontext()
    with torch.random.fork_rng(devices=rng_devices), on_device:
        torch.manual_seed(0)
        meter.sync()
        for i in range(num_layers):
            last = i == num_layers - 1
            kind = None if kinds is None or kinds[i] is None else (kinds[i], tuple(x.shape), x.dtype, last)
            seen = measured.get(kind) if kind is not None else None
            if seen is not None and (last or (seen[2], seen[3]) == (x.shape, x.dtype)):
                result.append(dataclasses.replace(seen[1], name=names[i]))
                if reused and reused[-1][1] != seen[0]:
                    _log_reused(log, reused, names, num_layers)
                reused.append((i, seen[0]))
                continue  # x has the shape this layer's output would have
            _log_reused(log, reused, names, num_layers)
            if progress is not None:
                progress.start_layer(names[i])
            layer = build(i)
            if layer is None:
                raise ValueError(f"layer {i} ({names[i]}) is not built; profiling needs every layer")
            prof, out = meter.measure(
                layer, x, last=last, name=names[i], on_run=progress.run_done if progress is not None else None
            )
            del layer
            if release:
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            if kind is not None:
                measured[kind] = (i, prof, out.shape, out.dtype)
            result.append(prof)
            summary = progress.layer_done() if progress is not None else ""
            if log is not None:
                log(
                    f"profiling layer {i + 1}/{num_layers} {names[i]}: fwd "
                    f"{prof.forward_s * 1e3:.2f} ms, bwd {prof.backward_s * 1e3:.2f} ms, "
                    f"params {prof.param_bytes / MIB:.2f} MiB, activations "
                    f"{prof.activation_bytes / MIB:.2f} MiB; {summary}"
                )
            x = out if not last else x
            del out
    _log_reused(log, reused, names, num_layers)
    return ModelProfile(layers=result, key=dict(key or {}))


def _log_reused(
    log: Callable[[str], None] | None, reused: list[tuple[int, int]], names: Sequence[str], num_layers: int
) -> None:
    """One line for a run of layers given the numbers of the same measured layer; empties `reused`."""
    if reused and log is not None:
        (first, source), (end, _) = reused[0], reused[-1]
        if first == end:
            log(
                f"profiling layer {first + 1}/{num_layers} {names[first]}: identical to {names[source]}, "
                "its numbers reused"
            )
        else:
            log(
                f"profiling layers {first + 1}-{end + 1}/{num_layers} {names[first]}..{names[end]}: identical to "
                f"{names[source]}, their numbers reused"
            )
    reused.clear()


def profile_layers(
    layers: Sequence[nn.Module],
    sample_input: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    warmup: int = 1,
    repeats: int = 5,
    optimizer: str = "adamw",
    key: dict[str, Any] | None = None,
    names: Sequence[str] | None = None,
    precision: str = "fp32",
    identical_blocks_once: bool = False,
    log: Callable[[str], None] | None = None,
) -> ModelProfile:
    """Profile every layer of an already built list on one microbatch (see the module
    docstring); layers must be on sample_input's device. With identical_blocks_once, layers of
    one `layer_kind` are measured once. The last layer is profiled together with loss_fn."""
    if not layers or any(layer is None for layer in layers):
        raise ValueError("profile_layers needs every layer built (no None entries)")
    kinds = [layer_kind(layer) for layer in layers] if identical_blocks_once else None
    return profile_layer_by_layer(
        layers.__getitem__,
        len(layers),
        sample_input,
        labels,
        loss_fn,
        kinds=kinds,
        warmup=warmup,
        repeats=repeats,
        optimizer=optimizer,
        key=key,
        names=names,
        precision=precision,
        release=False,
        log=log,
    )


def profile_model(
    cfg: JobConfig,
    *,
    device: str | torch.device,
    key: dict[str, Any] | None = None,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    log: Callable[[str], None] | None = None,
) -> ModelProfile:
    """Measure the job's model on `device` one layer at a time: layer i is built alone
    (`build_layer_model(owned=[i])`, initialised from the job's seed), passed through `prepare`
    (e.g. tensor-parallel sharding), measured and freed before layer i+1 is built (a pretrained
    model's layer i reads only its own tensors). With `planning.profile_identical_blocks_once`,
    layers of one `layer_kind` (computed on meta copies) are built and measured once. Layers are
    measured without recomputation; the numbers under it are derived (`LayerProfile`), so one
    profile plans every `training.activation_checkpoint`."""
    from ... import models
    from ...models.build import build_meta_layers

    dev, seed = torch.device(device), cfg.training.seed
    whole = models.build_layer_model(cfg.model, seed=seed, owned=[], device=dev)  # names and loss, no layer
    n = whole.num_layers

    def build(i: int) -> nn.Module:
        return models.build_layer_model(cfg.model, seed=seed, owned=[i], device=dev).held(i)

    kinds = None
    if cfg.planning.profile_identical_blocks_once:
        kinds = [layer_kind(layer) for layer in build_meta_layers(cfg.model, n, seed=seed)]

    def build_prepared(i: int) -> nn.Module:
        layer = build(i)
        return prepare(layer) if prepare is not None and layer is not None else layer

    measured: dict[int, ModelProfile] = {}
    sizes = profile_microbatch_sizes(cfg)  # the configured size; for `auto`, two (planning/profile/microbatch.py)
    runs = cfg.planning.profile_warmup + cfg.planning.profile_repeats
    progress = ProfileProgress(layers_to_measure(kinds, n) * len(sizes), runs, log) if log is not None else None
    for size in sizes:
        gen = torch.Generator().manual_seed(seed)
        shape = (size, cfg.data.seq_len)
        ids = torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(dev)
        labels = torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(dev)
        if log is not None:
            log(
                f"profile: measuring {n} layers on {dev}, one at a time (microbatch {shape[0]} x "
                f"{shape[1]}, {cfg.training.precision}"
                + (
                    f", identical blocks measured once: {layers_to_measure(kinds, n)} layers to build and time"
                    if kinds is not None
                    else ""
                )
                + f", {runs} runs each)"
            )
        measured[size] = profile_layer_by_layer(
            build_prepared,
            n,
            ids,
            labels,
            whole.loss_fn,
            kinds=kinds,
            warmup=cfg.planning.profile_warmup,
            repeats=cfg.planning.profile_repeats,
            optimizer=cfg.training.optimizer.name,
            key=key,
            names=whole.names,
            precision=cfg.training.precision,
            log=log,
            progress=progress,
        )
    prof = measured[sizes[0]]
    prof.microbatch_size = sizes[0]
    prof.at_microbatch_sizes = {b: measured[b].layers for b in sizes[1:]}
    return prof
