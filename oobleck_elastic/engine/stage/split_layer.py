"""A compiled layer whose input and weight gradients are separate autograd nodes (`run_split`),
so that torch's split backward (zero-bubble's I and W passes) runs each compiled graph once, and
a whole backward (1F1B, GPipe) runs both.

Invariant: every call's gradients equal eager autograd's, whichever pass order the schedule
takes; the graphs are split_graphs.py's, compiled once per kind of layer. docs/schedules.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ...models.recompute import RngState
from .split_graphs import split_backward, trace

__all__ = ["SplitGraphs", "graphs_for", "run_split", "split_counters"]

split_counters: dict[str, int] = {"input": 0, "weight": 0, "weight_only": 0, "replay": 0}
"""Compiled backward graphs run in this process, by kind (tests check which ran)."""


def _compile(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    return torch.compile(gm, dynamic=False)


@dataclass
class SplitGraphs:
    """The compiled graphs of one kind of layer for one input shape (split_graphs.py)."""

    forward: Callable[..., Any]
    input: Optional[Callable[..., Any]]
    weight: Callable[..., Any]
    weight_only: Callable[..., Any]
    weight_inputs: list[tuple[str, int]]
    names: list[str]
    n_params: int
    out_shape: torch.Size
    out_dtype: torch.dtype


_GRAPHS: dict[Any, SplitGraphs] = {}


def graphs_for(layer: nn.Module, x: torch.Tensor) -> SplitGraphs:
    """The process's graphs for layers of `layer`'s kind on inputs like `x` under the current
    autocast state, traced on first use (split_graphs.py)."""
    from ...planning.profile.profiler import layer_kind

    device = x.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    key = (layer_kind(layer), layer.training, tuple(x.shape), x.dtype, x.requires_grad, x.device, autocast)
    graphs = _GRAPHS.get(key)
    if graphs is None:
        traced = trace(layer, x)
        split = split_backward(traced)
        graphs = SplitGraphs(
            forward=_compile(traced.forward),
            input=_compile(split.input) if split.input is not None else None,
            weight=_compile(split.weight),
            weight_only=_compile(split.weight_only),
            weight_inputs=split.weight_inputs,
            names=traced.names,
            n_params=traced.n_params,
            out_shape=traced.out_shape,
            out_dtype=traced.out_dtype,
        )
        _GRAPHS[key] = graphs
    return graphs


@dataclass
class _Call:
    """One call's state, shared by its Input and Weight nodes."""

    graphs: SplitGraphs
    device_type: str
    out: Optional[torch.Tensor] = None
    saved: list[torch.Tensor] = field(default_factory=list)
    boundary: Optional[list[torch.Tensor]] = None
    output_grad: Optional[torch.Tensor] = None
    replay: Optional[tuple[list[torch.Tensor], torch.Tensor, RngState]] = None
    """With activation checkpointing (models/recompute.py): the forward graph's inputs and the random
    state, kept instead of `saved`, which the first backward node to need it replays."""

    def saved_now(self) -> list[torch.Tensor]:
        """The forward's saved tensors, replayed once when they were dropped."""
        if self.replay is not None and not self.saved:
            flat, x, rng = self.replay
            split_counters["replay"] += 1
            with rng.replayed(), _no_autocast(self):
                _, *self.saved = self.graphs.forward(*flat, x)
        return self.saved


def _no_autocast(call: _Call) -> Any:
    # the graphs hold autocast's casts already (traced under it)
    return torch.autocast(device_type=call.device_type, enabled=False)


class _Weight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *params: torch.Tensor) -> torch.Tensor:
        ctx.call = call
        return params[0].new_zeros((), dtype=call.graphs.out_dtype).expand(call.graphs.out_shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        call: _Call = ctx.call
        graphs = call.graphs
        grad = grad.contiguous()
        with _no_autocast(call):
            if call.boundary is None:
                split_counters["weight_only"] += 1
                grads = graphs.weight_only(*call.saved_now(), grad)
            else:
                split_counters["weight"] += 1
                saved = call.saved_now()
                sources: dict[str, list[Any]] = {"backward": [*saved, call.output_grad], "boundary": call.boundary}
                grads = graphs.weight(*[sources[kind][i] for kind, i in graphs.weight_inputs])
                call.saved, call.boundary, call.output_grad, call.replay = [], None, None, None
        return (None, *grads)


class _Input(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, x: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        ctx.call = call
        with _no_autocast(call):
            call.out, *saved = call.graphs.forward(*flat, x)
        if call.replay is None:
            call.saved = saved
        else:  # activation checkpointing: keep the inputs, drop the rest (`_Call.saved_now`)
            call.replay = (list(flat), x.detach(), call.replay[2])
        return x.new_zeros((), dtype=call.graphs.out_dtype).expand(call.graphs.out_shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        call: _Call = ctx.call
        assert call.graphs.input is not None
        grad = grad.contiguous()  # as the graph was compiled for: one graph whatever the gradient's strides
        split_counters["input"] += 1
        with _no_autocast(call):
            dx, *boundary = call.graphs.input(*call.saved_now(), grad)
        call.boundary, call.output_grad = boundary, grad
        return (None, dx) + (None,) * (len(ctx.needs_input_grad) - 2)


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, from_input: torch.Tensor, from_weight: torch.Tensor) -> torch.Tensor:
        out, call.out = call.out, None
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return None, grad, grad


def run_split(layer: nn.Module, x: torch.Tensor, *, recompute: bool = False) -> torch.Tensor:
    """`layer(x)` through its kind's compiled graphs, with separate input- and weight-gradient
    nodes. The autograd graph of one call (input x, parameters P, output y):

        P -> Weight ------                       Join -> y
        x -> Input -------/

    `Input` runs the compiled forward; its backward runs the I graph (the input gradient, and the
    boundary tensors the weight gradients use). `Weight` returns a zero-size stand-in; its backward
    runs the W graph on the boundary. `Join` hands the output gradient to both. torch's split
    backward (`stage_backward_input`, then `stage_backward_weight` from the nodes both paths join)
    runs Input in the I pass and Weight in the W pass. A whole backward runs both: `Weight` is
    created first, so autograd's ready queue (later nodes first) runs `Input` before it; should
    `Weight` run first anyway, it uses the `weight_only` graph. A layer whose input takes no
    gradient (token ids) has no Input node. The forward's saved tensors live in one `_Call` that
    `Weight` drops when it has run, so they live as long as eager autograd's would. With
    `recompute` (activation checkpointing) the call keeps only the forward graph's inputs and
    replays it when the first of Input and Weight runs: once per call, whatever the pass order."""
    if not torch.is_grad_enabled():
        return layer(x)
    graphs = graphs_for(layer, x)
    values: dict[str, torch.Tensor] = dict(layer.named_parameters())
    values.update(layer.named_buffers())
    flat = [values[name] for name in graphs.names]
    params = flat[: graphs.n_params]
    call = _Call(graphs, x.device.type)
    if recompute:  # the forward's random state, for the replay (`_Call.saved_now`)
        call.replay = ([], x, RngState(x.device))
    # created first: run after Input (module docstring); a layer without parameters has no Weight node
    if params:
        stand_in = _Weight.apply(call, *params)
    else:
        stand_in = x.new_zeros((), dtype=graphs.out_dtype).expand(graphs.out_shape)
    from_input = _Input.apply(call, x, *[t.detach() for t in flat])
    out: torch.Tensor = _Join.apply(call, from_input, stand_in)
    return out
