"""The gradient sync starts while the backward still runs (engine/step/grad_sync.py).

Two gloo processes hold the same four layers (one holder set). Each runs a step of two
microbatches: the hooks post each layer's all-reduce as soon as that layer has been accumulated
for both microbatches, during the second backward, before `all_reduce()` is called; the sums are
the plain sums of both ranks' gradients. A layer whose gradient is assigned instead of
accumulated (as a zero-bubble schedule's weight pass does) is posted after the schedule, in the
set's order, and rank 1 finishing its layers in another order than rank 0 still posts them in
the same order (a mismatch would hang or mix up the sums).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import socket
from datetime import timedelta
from types import SimpleNamespace


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, case: str, results: "mp.Queue") -> None:  # type: ignore[name-defined]
    import torch
    import torch.distributed as dist
    from torch import nn

    from oobleck_elastic.engine.step.grad_sync import GradSync
    from oobleck_elastic.engine.entry.groups import Holders

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    torch.manual_seed(rank)
    layers = [nn.Linear(8, 8) for _ in range(4)]
    # the same layers without the sync's hooks: their gradients as accumulated, for the expected sums
    # (the synced layers' gradients become views of buffers whose all-reduce runs from their post on)
    plain = copy.deepcopy(layers)
    holders = Holders(layer={i: (0, 1) for i in range(4)}, tied=[])
    groups = SimpleNamespace(holders=holders, sets={(0, 1): dist.group.WORLD}, rank=rank, lane=0)
    sync = GradSync(groups, SimpleNamespace(layers=layers), range(4))  # type: ignore[arg-type]
    microbatches = 2
    sync.begin_step(microbatches)
    posted_after: list[int] = []

    def microbatch(stack: list, x: "torch.Tensor") -> None:
        h = x
        if case == "assigned" and rank == 1:  # layer 2's weights: assigned by hand, no accumulation hook
            for i, layer in enumerate(stack):
                h = (
                    torch.relu(layer(h))
                    if i != 2
                    else torch.relu(nn.functional.linear(h, layer.weight.detach(), layer.bias))
                )
            h.sum().backward()
            g = torch.ones_like(stack[2].weight)
            stack[2].weight.grad = g if stack[2].weight.grad is None else stack[2].weight.grad + g
        else:
            for layer in stack:
                h = torch.relu(layer(h))
            h.sum().backward()

    for _ in range(microbatches):
        x = torch.randn(3, 8)
        microbatch(plain, x)
        microbatch(layers, x)
        posted_after.append(len(sync._posted))
    sync.all_reduce()
    expected = []
    for layer in plain:
        row = []
        for p in layer.parameters():
            t = p.grad.clone()
            dist.all_reduce(t)
            row.append(t)
        expected.append(row)
    equal = all(torch.equal(p.grad, e) for layer, row in zip(layers, expected) for p, e in zip(layer.parameters(), row))
    # each layer's summed gradients are views of the one buffer its all-reduce summed in place
    one_buffer = all(len({p.grad.untyped_storage().data_ptr() for p in layer.parameters()}) == 1 for layer in layers)
    early = sync.posted_early
    results.put({"rank": rank, "posted_after": posted_after, "early": early, "equal": equal, "one_buffer": one_buffer})
    dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)


def run(case: str) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, case, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        out = [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return {o["rank"]: o for o in out}


def test_each_layer_is_reduced_as_soon_as_it_is_final_and_the_sums_are_exact() -> None:
    out = run("plain")
    for rank in (0, 1):
        assert out[rank]["equal"] and out[rank]["one_buffer"]
        # nothing after the first microbatch; all four layers during the second backward
        assert out[rank]["posted_after"] == [0, 4]
        assert out[rank]["early"] == 4


def test_a_layer_not_accumulated_is_reduced_after_the_schedule_and_holds_back_the_lower_ones() -> None:
    out = run("assigned")
    assert out[0]["equal"] and out[1]["equal"]
    assert out[0]["early"] == 4
    # rank 1: layer 3 final and posted; layer 2 never final by hook, so 1 and 0 wait behind it
    assert out[1]["posted_after"] == [0, 1] and out[1]["early"] == 1
