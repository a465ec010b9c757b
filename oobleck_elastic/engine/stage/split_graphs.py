"""A layer's compiled graphs with the backward split in two: input gradient (I) and weight
gradient (W), each compiled on its own, so that a zero-bubble schedule can run them apart.

Why: `torch.compile` of a whole layer gives autograd one node whose backward computes every
gradient at once, so torch's split backward would run it twice (I drops the weight gradients, W
computes the input gradient again). `trace` gets the layer's forward and backward graphs,
`split_backward` cuts the backward; each graph is compiled when first run, once per process per
kind of layer (compiled.py). docs/schedules.md.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx, nn

__all__ = ["Traced", "SplitBackward", "trace", "split_backward"]


@dataclass
class Traced:
    """A layer's forward and backward graphs, for inputs like the traced one."""

    forward: fx.GraphModule
    """(parameters..., buffers..., input) -> (output, saved...)."""
    backward: fx.GraphModule
    """(saved..., output gradient) -> one gradient (or None) per forward input."""
    names: list[str]
    """The parameters' then the buffers' names in the layer (the forward's inputs, in order)."""
    n_params: int
    """How many of `names` are parameters."""
    out_shape: torch.Size
    out_dtype: torch.dtype


def trace(layer: nn.Module, x: torch.Tensor) -> Traced:
    """The forward and backward graphs of `layer(x)` under the current autocast state: AOTAutograd
    traces the layer as a function of (parameters, buffers, input) (`torch.func.functional_call`,
    so any layer of any model), and inductor's min-cut partitioner cuts the joint graph into a
    forward (the output and what the backward needs) and a backward (one gradient per input)."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    params = dict(layer.named_parameters())
    buffers = dict(layer.named_buffers())
    names = [*params, *buffers]

    def fn(*flat: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, dict(zip(names, flat[:-1])), (flat[-1],))

    graphs: dict[str, fx.GraphModule] = {}

    def partition(joint: fx.GraphModule, inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        graphs["forward"], graphs["backward"] = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        return graphs["forward"], graphs["backward"]

    def keep(gm: fx.GraphModule, _inputs: Any) -> Callable:
        return make_boxed_func(gm)

    traced = aot_function(fn, fw_compiler=keep, bw_compiler=keep, partition_fn=partition)  # type: ignore[arg-type]
    out = traced(*params.values(), *buffers.values(), x)
    placeholders = [n for n in graphs["backward"].graph.nodes if n.op == "placeholder"]
    saved = len(_outputs(graphs["forward"])) - 1
    if len(placeholders) != saved + 1:  # saved symbolic sizes would be extra inputs: shapes are static here
        raise RuntimeError(
            f"{type(layer).__name__}: its backward graph takes {len(placeholders)} inputs, not the {saved} saved "
            "tensors and the output gradient; set training.compile=false"
        )
    return Traced(graphs["forward"], graphs["backward"], names, len(params), out.shape, out.dtype)


def _outputs(gm: fx.GraphModule) -> list[Any]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.args[0])


def _ancestors(roots: Sequence[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


@dataclass
class SplitBackward:
    """The backward cut into I and W (`split_backward`)."""

    input: Optional[fx.GraphModule]
    """(saved..., output gradient) -> (input gradient, boundary...); None when the input takes no
    gradient."""
    weight: fx.GraphModule
    """(W's inputs...) -> one gradient (or None) per parameter."""
    weight_inputs: list[tuple[str, int]]
    """W's inputs, in order: ("backward", i) the backward's i-th input, ("boundary", j) I's j-th
    boundary tensor."""
    weight_only: fx.GraphModule
    """(saved..., output gradient) -> one gradient (or None) per parameter."""


def _graph(
    source: fx.GraphModule, inputs: Sequence[fx.Node], outputs: Sequence[Any], keep: set[fx.Node]
) -> fx.GraphModule:
    """A graph of `source`'s nodes in `keep` that takes `inputs` and returns `outputs`."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(node.name) for node in inputs}
    for node in source.graph.nodes:
        if node in keep and node not in env and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    graph.eliminate_dead_code()
    return fx.GraphModule(source, graph)


def split_backward(traced: Traced) -> SplitBackward:
    """Cut `traced.backward` into I (the nodes the input gradient depends on; it also returns the
    boundary: the tensors it computed that the weight gradients use, typically each linear's
    output gradient) and W (the nodes only the weight gradients need, from the boundary and the
    backward inputs they use), and W alone (`weight_only`: every weight gradient from the
    backward's inputs, for a layer whose input takes no gradient). A node with several outputs
    (layer norm's backward) belongs to I when I needs one of them; W reads the others from the
    boundary."""
    backward = traced.backward
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    grads = _outputs(backward)
    dparams, dx = grads[: traced.n_params], grads[-1]
    weight_set = _ancestors(dparams)
    weight_only = _graph(backward, placeholders, dparams, weight_set)
    if not isinstance(dx, fx.Node):
        return SplitBackward(None, weight_only, [("backward", i) for i in range(len(placeholders))], weight_only)
    input_set = _ancestors([dx])
    # the other outputs of a multi-output node I runs come with it
    for node in list(input_set):
        input_set.update(u for u in node.users if u.op == "call_function" and u.target is operator.getitem)
    weight_alone = weight_set - input_set
    boundary = [
        node
        for node in backward.graph.nodes
        if node in weight_set
        and (node in input_set or node.op == "placeholder")
        and (any(u in weight_alone for u in node.users) or node in dparams)
    ]
    passed = [node for node in boundary if node.op != "placeholder"]
    return SplitBackward(
        input=_graph(backward, placeholders, [dx, *passed], input_set),
        weight=_graph(backward, boundary, dparams, weight_alone | set(boundary)),
        weight_inputs=[
            ("backward", placeholders.index(n)) if n.op == "placeholder" else ("boundary", passed.index(n))
            for n in boundary
        ],
        weight_only=weight_only,
    )
