"""Measure a per-layer profile on this device, and cache it.

The device holds one layer at a time. `profile_model` builds layer i alone
(`build_layer_model(cfg.model, seed=..., owned=[i])`), measures it on one microbatch, drops it
(gc.collect(), and torch.cuda.empty_cache() on CUDA), then builds layer i+1; between layers only
the previous layer's output is kept (detached), as layer i+1's input. A tied LM head built alone
holds its own copy of the embedding weight, which it counts as its parameters, as a head built
together with the embedding counts the shared one. The largest layer, not the model, bounds the
memory profiling needs: one block of a GPT-3-175B-like model (1.8B parameters) rather than 175B.
With `model.pretrained_path`, building layer i reads only that layer's tensors from the checkpoint.

With `planning.profile_identical_blocks_once` (the default), layers of one kind are measured
once: two layers are identical when `layer_kind` matches (class, plain attributes such as widths
and eps but not the layer index, parameter and buffer names, shapes and dtypes; computed on meta
copies from `build_meta_layers`, no weights) and their inputs have one shape and dtype. The
first of a kind is built and measured; the others are not built and get its numbers under their
own names. As an identical block's output has its input's shape, the measured block's output
goes on as the input of the layer after the skipped ones (values do not matter for timing).
The byte counts below depend on shapes only, so they equal those of measuring every block;
times are the first block's where each block would have had its own noisy median. For GPT-2 or
Llama that is 3 layers built instead of num_layers + 2.

For every layer measured, `warmup` untimed and `repeats` timed iterations of

    forward:  out = layer(input.detach().requires_grad_())   (+ loss_fn for the last layer)
    backward: out.backward(randn_like(out))                   (loss.backward() for the last layer)
    split:    another forward, then the backward as torch's zero-bubble stages split it:
              stage_backward_input (the input's gradient, I), then stage_backward_weight (the
              weights' gradients from the intermediates' gradients I kept, W)

are timed and the medians kept (`backward_s`, and `input_grad_s` and `weight_grad_s` from the
split; a layer whose input takes no gradient, the embedding of token ids, has I = 0 and its
whole backward as W; one run is one full and one split iteration): on the CPU with
`time.perf_counter`; on CUDA with CUDA events (`torch.cuda.Event(enable_timing=True)` recorded
on the device's current stream around the forward and the backward, read after the event that
ends the backward has completed), so the times are the kernels' own and include neither Python
launch overhead nor host synchronisation. Memory numbers are exact counts, not timings:

- param_bytes: bytes of the layer's parameter storages, each storage counted once;
  grad_bytes = param_bytes; optimizer_bytes = 2 x param_bytes for AdamW (two moments), 0 for SGD.
- activation_bytes: what autograd keeps for backward, measured in one extra forward under
  `torch.autograd.graph.saved_tensors_hooks`: saved tensors deduplicated by storage, excluding
  parameter storages. That forward's output, detached, is the next layer's input.
- output_bytes: bytes of the layer's output tensor (what crosses a stage boundary).

The microbatch is `training.microbatch_size` x `data.seq_len`. With `training.microbatch_size:
auto` every layer is measured at two sizes (`microbatch.profile_microbatch_sizes`: 1 and the
largest candidate size <= 4), the first as `layers`, the other under `at_microbatch_sizes`; the
planner fits the other sizes from them (planning/microbatch.py), and the key records `auto` and
the sizes measured.

`load_or_profile` returns the profile of a job: the file in `planning.profile_path` if set, else
a cached profile under `<cache_dir>/profiles/<profile_cache_key(key)>.json` whose stored key
equals the current key exactly (model config, microbatch shape, precision, optimizer, device
kind, library versions, whether identical blocks were measured once, that the backward was
also timed split), else a fresh measurement
(`profile_model`) with the job's seed, which is then saved there. A cached file with another
key is reported as stale and replaced. A reused profile is logged with its file, its age (the
file's modification time) and how to measure again: the cache cannot tell a profile measured
on a busy machine from a good one, so `planning.reprofile` (`oobleck plan --reprofile`) measures
anew and replaces the file. Measuring logs its progress and the time left (planning/progress.py).
A profile measured (or reused) on a CUDA device records
that device's total memory (`ModelProfile.device_memory_bytes`), the planner's default for
`planning.device_memory_gb`.

`device_label(device)` names the device kind ("cuda NVIDIA H100 80GB HBM3", "cpu x86_64"): the
control plane shares one worker-measured profile per device kind under that name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from ..config import JobConfig
from ..models.tensor_parallel import local
from .microbatch import profile_microbatch_sizes
from .profile import LayerProfile, ModelProfile, ProfileError, profile_cache_key
from .progress import ProfileProgress, format_seconds

__all__ = [
    "device_label",
    "device_memory_bytes",
    "layer_kind",
    "profile_layers",
    "layers_to_measure",
    "profile_layer_by_layer",
    "profile_model",
    "profile_key",
    "load_or_profile",
]

_OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}
MIB = 1024**2


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
        self.exclude = exclude
        self.seen: dict[tuple[str, int], int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key, size = _storage_key(t), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            key, size = ("id", id(t)), t.numel() * t.element_size()
        if key not in self.exclude:
            self.seen.setdefault(key, size)
        # Not `t` itself: a saved output would then hold its own grad_fn, a cycle through C++ that
        # gc cannot break, and the graph with every saved tensor (parameters included) would leak.
        return t.detach()

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())


class _LayerMeter:
    """Times one layer on one input and counts its bytes (see the module docstring)."""

    def __init__(
        self,
        labels: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        device: torch.device,
        warmup: int,
        repeats: int,
        optimizer: str,
        precision: str,
    ) -> None:
        self.labels, self.loss_fn, self.device = labels, loss_fn, device
        self.warmup, self.repeats, self.optimizer, self.precision = warmup, repeats, optimizer, precision
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def autocast(self) -> Any:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, layer: nn.Module, x: torch.Tensor, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        _, out, target = self.forward_from(layer, x, last)
        return out, target

    def forward_from(
        self, layer: nn.Module, x: torch.Tensor, last: bool, *, through_view: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the input, the layer's output, what backward starts from). `through_view`: the layer
        gets a view of the input, not the leaf itself (module backward hooks, such as those of
        torch's FlopCounterMode, refuse a leaf input under torch.autograd.grad)."""
        inp = x.detach()
        if inp.is_floating_point():
            inp.requires_grad_(True)
        with self.autocast():
            out = layer(inp.view_as(inp) if through_view and inp.requires_grad else inp)
            target = self.loss_fn(out, self.labels) if last else out
        return inp, out, target

    def timed_split(self, layer: nn.Module, x: torch.Tensor, last: bool) -> tuple[float, float]:
        """(input-gradient, weight-gradient) seconds of one backward split as torch's zero-bubble
        stages run it: `stage_backward_input` (the input's gradient, keeping the gradients of the
        intermediates the weights need), then `stage_backward_weight` (the weights' gradients
        from those). A layer whose input takes no gradient (token ids) has none: its whole
        backward is weight gradient."""
        inp, out, target = self.forward_from(layer, x, last, through_view=True)
        if target._is_view():  # stage_backward_input detaches it in place, which a view refuses
            target = target.clone()
        grad = None if last else torch.randn_like(out)
        params = list(layer.parameters())
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.cuda else []

        def mark(k: int) -> float:
            if self.cuda:
                marks[k].record()
                return 0.0
            return time.perf_counter()

        split = target.requires_grad and inp.requires_grad
        t0 = mark(0)
        if split:
            _, groups = stage_backward_input([target], None if grad is None else [grad], [inp], iter(params))
        t1 = mark(1)
        if split:
            stage_backward_weight(iter(params), groups)
        elif target.requires_grad:
            target.backward(grad)
        t2 = mark(2)
        if self.cuda:
            marks[2].synchronize()
            t0, t1, t2 = 0.0, marks[0].elapsed_time(marks[1]) / 1e3, marks[0].elapsed_time(marks[2]) / 1e3
        del out, target, grad, inp
        for p in params:
            p.grad = None
        return (t1 - t0 if split else 0.0), t2 - t1

    def timed_iteration(self, layer: nn.Module, x: torch.Tensor, last: bool) -> tuple[float, float]:
        """(forward, backward) seconds of one iteration of `layer` on input `x`."""
        if self.cuda:
            fwd0, fwd1, bwd0, bwd1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            fwd0.record()
            out, target = self.forward(layer, x, last)
            fwd1.record()
            grad = None if last else torch.randn_like(out)
            bwd0.record()
            if target.requires_grad:
                target.backward(grad)
            bwd1.record()
            bwd1.synchronize()
            fwd_s, bwd_s = fwd0.elapsed_time(fwd1) / 1e3, bwd0.elapsed_time(bwd1) / 1e3
        else:
            t0 = time.perf_counter()
            out, target = self.forward(layer, x, last)
            t1 = time.perf_counter()
            grad = None if last else torch.randn_like(out)
            t2 = time.perf_counter()
            if target.requires_grad:
                target.backward(grad)
            t3 = time.perf_counter()
            fwd_s, bwd_s = t1 - t0, t3 - t2
        del out, target, grad
        for p in layer.parameters():
            p.grad = None
        return fwd_s, bwd_s

    def measure(
        self, layer: nn.Module, x: torch.Tensor, *, last: bool, name: str, on_run: Callable[[], None] | None = None
    ) -> tuple[LayerProfile, torch.Tensor]:
        """The layer's profile on input `x`, and its output (detached: the next layer's input);
        `on_run` is called after each of the warmup + repeats runs (progress)."""
        fwd_times, bwd_times, input_times, weight_times = [], [], [], []
        for it in range(self.warmup + self.repeats):
            fwd_s, bwd_s = self.timed_iteration(layer, x, last)
            input_s, weight_s = self.timed_split(layer, x, last)
            if on_run is not None:
                on_run()
            if it >= self.warmup:
                fwd_times.append(fwd_s)
                bwd_times.append(bwd_s)
                input_times.append(input_s)
                weight_times.append(weight_s)
        meter = _SavedTensorMeter({_storage_key(p) for p in layer.parameters()})
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            out, target = self.forward(layer, x, last)
        out = out.detach()
        del target  # frees the graph: only the output tensor is kept
        pbytes = _param_bytes(layer)
        prof = LayerProfile(
            name=name,
            forward_s=statistics.median(fwd_times),
            backward_s=statistics.median(bwd_times),
            input_grad_s=statistics.median(input_times),
            weight_grad_s=statistics.median(weight_times),
            param_bytes=pbytes,
            grad_bytes=pbytes,
            optimizer_bytes=_OPTIMIZER_STATES[self.optimizer] * pbytes,
            activation_bytes=meter.nbytes,
            output_bytes=out.numel() * out.element_size(),
        )
        return prof, out


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


def _check_settings(optimizer: str, warmup: int, repeats: int, precision: str) -> None:
    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"optimizer '{optimizer}' unknown; choose one of {', '.join(_OPTIMIZER_STATES)}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision '{precision}' unknown; choose fp32 or bf16")


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

    With `log`, one line per layer, and progress lines with the time left (`progress`, or one made
    here for this call: planning/progress.py)."""
    _check_settings(optimizer, warmup, repeats, precision)
    if num_layers < 1:
        raise ValueError("profile_layer_by_layer needs at least one layer")
    if kinds is not None and len(kinds) != num_layers:
        raise ValueError(f"kinds has {len(kinds)} entries for {num_layers} layers; give one per layer")
    names = list(names) if names is not None else [f"layer.{i}" for i in range(num_layers)]
    if progress is None and log is not None:
        progress = ProfileProgress(layers_to_measure(kinds, num_layers), warmup + repeats, log)
    device = sample_input.device
    cuda = device.type == "cuda"
    meter = _LayerMeter(
        labels, loss_fn, device=device, warmup=warmup, repeats=repeats, optimizer=optimizer, precision=precision
    )
    result: list[LayerProfile] = []
    measured: dict[Hashable, tuple[int, LayerProfile, torch.Size, torch.dtype]] = {}
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
                if log is not None:
                    log(
                        f"profiling layer {i + 1}/{num_layers} {names[i]}: identical to "
                        f"{names[seen[0]]}, its numbers reused"
                    )
                continue  # x has the shape this layer's output would have
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
    return ModelProfile(layers=result, key=dict(key or {}))


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
    layers of one `layer_kind` (computed on meta copies) are built and measured once."""
    from .. import models
    from ..models.build import build_meta_layers

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
    sizes = profile_microbatch_sizes(cfg)  # the configured size; for `auto`, two (planning/microbatch.py)
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
