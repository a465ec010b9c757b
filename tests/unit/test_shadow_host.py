"""The shadows' host data path (engine/step/shadow_host.py, engine/step/shadows.py), in one process:

- `fill_flat` writes the layout the keeper reads: per parameter a presence flag, then the gradient
  (zeros and flag 0 for a parameter without one), equal to a reference built with `torch.cat`.
- Two `ShadowLink`s of a made-up plan (a holder and its keeper), their point-to-point ops delivered
  in-process: the host buffers are allocated once and reused every step (same `data_ptr`), new ones
  only when the previous step's traffic may still read them; after three steps, one of them with a
  parameter without a gradient, the keeper's shadows equal the holder's layers bit for bit,
  parameters and AdamW state, the keeper's update on 2 threads and the holder's on 1.
- `update_threads` on made-up inputs, and its error for a malformed `OOBLECK_SHADOW_THREADS`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.config import load_config
from oobleck_elastic.engine.entry.shadow_seeding import new_store
from oobleck_elastic.engine.step.optim import apply_update, build_optimizer
from oobleck_elastic.engine.step.shadow_host import THREADS_ENV, fill_flat, flat_numel, update_threads
from oobleck_elastic.engine.step.shadows import ShadowLink, routes
from oobleck_elastic.models import build_layer_model
from oobleck_elastic.planning.tolerance.shadows import place_shadows
from oobleck_elastic.testing import node_plan

ROOT = Path(__file__).resolve().parents[2]

PLAN = node_plan(1, [[("n0", 0, 3), ("n1", 3, 6)], [("n2", 0, 3), ("n3", 3, 6)]], [4, 4])
PLAN = dataclasses.replace(PLAN, shadows=place_shadows(PLAN, 1, [1] * 6, 100))


def config():
    return load_config(ROOT / "configs/gpt2-tiny.yaml", ["data.seq_len=16", "training.optimizer.eps=1e-6"])


def reference_flat(layer: torch.nn.Module) -> torch.Tensor:
    """The layout, built the way the engine built it before the buffers were reused."""
    parts = []
    for p in layer.parameters():
        parts.append(torch.tensor([0.0 if p.grad is None else 1.0]))
        parts.append((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float())
    return torch.cat(parts)


def test_fill_flat_writes_the_layout_the_keeper_reads() -> None:
    layer = build_layer_model(config().model, seed=0, owned=[1], device="cpu").held(1)
    params = list(layer.parameters())
    for i, p in enumerate(params):
        p.grad = None if i == 1 else torch.randn_like(p)
    out = torch.full((flat_numel(layer),), 7.0)
    assert torch.equal(fill_flat(layer, out), reference_flat(layer))
    assert out[1 + params[0].numel()] == 0.0  # the second parameter's presence flag
    with pytest.raises(ValueError, match=r"^a buffer of 3 torch.float32 for a layer of \d+ fp32 elements$"):
        fill_flat(layer, torch.zeros(3))


@dataclasses.dataclass
class Done:
    """A completed point-to-point op (what `batch_isend_irecv` returns, delivered in-process)."""

    def wait(self, timeout: Any = None) -> None:
        pass


class Wire:
    """`dist.P2POp` and `dist.batch_isend_irecv` in one process: the sends are kept by
    (sender, receiver, order) and each receive is filled from its send when it is posted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.me = -1
        monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: (op, tensor, peer))
        monkeypatch.setattr(dist, "batch_isend_irecv", self.post)

    def post(self, ops: list) -> list:
        for op, tensor, peer in ops:
            if op is dist.isend:
                self.sent.setdefault((self.me, peer), []).append(tensor.clone())
            else:
                tensor.copy_(self.sent[(peer, self.me)].pop(0))
        return [Done() for _ in ops]


def test_buffers_are_reused_and_the_shadows_stay_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config()
    assert [r for r in routes(PLAN) if r[1] == 0] == [(0, 0, 1), (2, 0, 1)]  # rank 0 sends 0 and 2 to rank 1
    holder = build_layer_model(cfg.model, seed=cfg.training.seed, owned=[0, 1, 2], device="cpu")
    optimizer = build_optimizer([p for i in (0, 1, 2) for p in holder.held(i).parameters()], cfg.training)
    keeper_model = build_layer_model(cfg.model, seed=cfg.training.seed, owned=[3, 4, 5], device="cpu")
    store = new_store(cfg, generation=1, step=-1, layers=[0, 2], kept=None, incoming=[])
    store.threads = 2  # the holder runs on 1: the fused CPU AdamW gives the same bits
    wire = Wire(monkeypatch)
    sender, keeper = ShadowLink(PLAN, 0, None), ShadowLink(PLAN, 1, None)
    assert sender.sends == [(0, 1), (2, 1)] and keeper.receives == [(0, 0), (2, 0)]
    sender.receives = []  # rank 0 keeps layers 3 and 5 too: that traffic is not this test's
    gen = torch.Generator().manual_seed(0)
    no_grad = next(iter(holder.held(2).parameters()))  # no gradient at step 1
    pointers: list[tuple[list[int], list[int]]] = []
    for step in range(3):
        params = [p for i in (0, 1, 2) for p in holder.held(i).parameters()]
        for p in params:
            p.grad = None if (step == 1 and p is no_grad) else torch.randn(p.shape, generator=gen) * 1e-2
        final = sender.begin(holder)
        final(list(holder.held(0).parameters()))  # layer 0's sums written first: copied early
        assert sender.staging.copied == {0}
        wire.me = 0
        posted = sender.post(holder, None)
        wire.me = 1
        got = keeper.post(keeper_model, store).wait()
        posted.wait()
        assert set(got) == {0, 2}
        for i in (0, 2):
            assert torch.equal(got[i], reference_flat(holder.held(i)))
        pointers.append(
            ([sender.staging.buffers[i].data.data_ptr() for i in (0, 2)], [got[i].data_ptr() for i in (0, 2)])
        )
        norm2 = float(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None))
        store.received(step, got)
        store.apply(step, norm2, cfg, background=True)
        apply_update(optimizer, params, step, norm2, cfg.training)
    store.settle()
    assert pointers[0] == pointers[1] == pointers[2]  # the same buffers every step
    assert (sender.staging.allocated, keeper.received_allocated) == (2, 2)
    for i in (0, 2):
        for (name, shadow), p in zip(store.layer_model.held(i).named_parameters(), holder.held(i).parameters()):
            assert torch.equal(shadow, p), (i, name)
            kept, held = store.optimizer.state[shadow], optimizer.state[p]
            assert kept.keys() == held.keys() and all(torch.equal(kept[k], held[k]) for k in kept), (i, name)
    # the parameter without a gradient at step 1 was skipped there: 2 AdamW steps, on both sides
    shadow_of = dict(zip(holder.held(2).parameters(), store.layer_model.held(2).parameters()))
    assert float(optimizer.state[no_grad]["step"]) == float(store.optimizer.state[shadow_of[no_grad]]["step"]) == 2.0

    # a step whose traffic was left in flight (no wait): the next one writes new buffers
    final = sender.begin(holder)
    wire.me = 0
    sender.post(holder, None)
    before = sender.staging.buffers[0].data.data_ptr()
    sender.begin(holder)
    sender.post(holder, None)
    assert sender.staging.buffers[0].data.data_ptr() != before and sender.staging.allocated == 4


@pytest.mark.parametrize(
    "cpus, local, override, expected",
    [
        (2, 4, None, 1),
        (2, 1, None, 1),
        (16, 8, None, 1),
        (32, 8, None, 2),
        (128, 8, None, 4),
        (2, 4, "3", 3),
        (96, 8, " ", 4),
    ],
)
def test_update_threads(cpus: int, local: int, override: Optional[str], expected: int) -> None:
    assert update_threads(cpus, local, override) == expected


def test_a_malformed_thread_count_says_what_to_set() -> None:
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError) as err:
            update_threads(8, 1, bad)
        assert str(err.value) == f"{THREADS_ENV}={bad!r}: must be a whole number of threads >= 1, e.g. 2"
