"""Shadow copies made observable: `oobleck status` lists the placement of the plan in etcd, every
recovery says where each layer came from (a surviving replica, a shadow copy or the checkpoint),
TensorBoard shows the shadows' host memory, lag and traffic, and the goodput ledger charges the
wait for the shadow exchange to `shadows`."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oobleck_elastic import cluster_ops
from oobleck_elastic.config import load_config
from oobleck_elastic.engine.entry.reconfigure import LayerSources, Move
from oobleck_elastic.engine.entry.shadow_seeding import new_store
from oobleck_elastic.engine.step.shadows import SLOW_KEEPER_ENV
from oobleck_elastic.engine.telemetry.board import TAGS, ShadowFigures
from oobleck_elastic.engine.telemetry.metrics import Metrics
from oobleck_elastic.engine.telemetry.goodput import GoodputClock
from oobleck_elastic.etcd import connect
from oobleck_elastic.planning import place_shadows
from oobleck_elastic.records.goodput import MEANING, Category, Ledger, Origin, describe, ended_step
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.testing import layout_plan

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


class FakeTime:
    """A wall clock the test sets."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def shadowed_plan():
    """Two pipelines on four nodes, each layer on two of them; one shadow per layer elsewhere
    (largest first, on the node not holding it with the most room left: layer 3 on n0, then
    0 on n1, 1 on n3, 2 on n2, 4 on n2, 5 on n0)."""
    plan = layout_plan([[(0, 3), (3, 6)], [(0, 2), (2, 6)]], [4, 4], generation=3)
    placed = place_shadows(plan, 1, [MIB, MIB, MIB, 2 * MIB, MIB, MIB], 8 * MIB)
    return dataclasses.replace(plan, shadows=placed)


def test_oobleck_status_lists_the_shadow_placement(etcd_settings, run_id) -> None:
    client = connect(etcd_settings)
    keys = Keys("/oobleck", run_id)
    try:
        client.put_json(keys.plan, shadowed_plan().to_json())
        lines = cluster_ops.status(client, keys)
        at = next(i for i, line in enumerate(lines) if line.startswith("shadow copies"))
        assert lines[at : at + 6] == [
            "shadow copies (fault_tolerance.shadow_copies=1): every layer also in the host memory of 1 node(s) "
            "that do not hold it on their devices; any 2 simultaneous node losses leave a copy of every layer "
            "(1 without them)",
            "  host memory for shadows per node: most 3 MiB, least 1 MiB, of 8 MiB each (the plan's budgets)",
            "  n0: layers 3, 5 (3 MiB of 8 MiB)",
            "  n1: layers 0 (1 MiB of 8 MiB)",
            "  n2: layers 2, 4 (2 MiB of 8 MiB)",
            "  n3: layers 1 (1 MiB of 8 MiB)",
        ]
        # a plan without shadows: no line about them
        client.put_json(keys.plan, layout_plan([[(0, 3), (3, 6)], [(0, 6)]], [4, 4], generation=4).to_json())
        assert not [line for line in cluster_ops.status(client, keys) if "shadow" in line]
        # a plan that gives less than the config asks: its warnings, as the leader logged them
        short = "no shadow copies instead of fault_tolerance.shadow_copies=1: no node has room"
        plan = layout_plan([[(0, 6)]], [4], generation=5)
        client.put_json(keys.plan, dataclasses.replace(plan, warnings=(short,)).to_json())
        assert f"  warning: {short}" in cluster_ops.status(client, keys)
    finally:
        client.close()


# ----------------------------------------------------------------------------- the goodput ledger


def test_the_goodput_ledger_charges_the_shadow_exchange_to_shadows() -> None:
    """A step's seconds on the shadow exchange go to `shadows`, the rest to its outcome (a replay
    too); never more than the step itself; the report lists the category."""
    t = FakeTime(1010.0)
    clock = GoodputClock("node0", t)
    clock.entered(1, 0, rank0=True, origin=lambda: Origin(reported=None, start=1000.0, first_plan=1005.0))
    for index, (begin, end, outcome, shadows_s) in enumerate(
        [(1010.0, 1012.0, Category.USEFUL, 0.5), (1012.0, 1013.0, Category.REPLAYED, 0.25)]
    ):
        t.t = begin
        clock.began_step()
        t.t = end
        clock.ended_step(index, outcome, shadows_s)
    t.t = 1013.0
    clock.began_step()
    t.t = 1014.0
    clock.ended_step(1, Category.USEFUL, 3.0)  # more than the step took: the whole step, no more
    ledger = clock.snapshot()
    assert ledger is not None
    assert {c.value: ledger.get(c) for c in Category if ledger.get(c)} == {
        "waiting": 5.0,
        "startup": 5.0,
        "useful": 1.5,
        "replayed": 0.75,
        "shadows": 1.75,
    }
    assert ledger.total == 14.0 and ledger.done == 2
    assert ended_step(ledger, 1014.0, 2, Category.USEFUL, 1.0).seconds == ledger.seconds  # a step of no time
    lines = describe(ledger, start=1000.0, end=1014.0, closed=True)
    assert lines[4].split()[:4] == ["shadows", "1.75", "s", "12.5"]
    assert MEANING[Category.SHADOWS] in lines[4]
    back = Ledger.from_json(ledger.to_json())  # it travels with progress
    assert back.get(Category.SHADOWS) == 1.75 and back.total == ledger.total


# ----------------------------------------------------------------------------- where layers came from


def test_a_recovery_says_where_each_layer_came_from() -> None:
    """From the entry's moves: a layer a keeper sent is `shadow`, every other one `replica` (kept
    in place or moved), with the bytes each source sent; after a restore every layer is `disk`,
    with the bytes of the layer files every worker read."""
    moves = (
        Move(src="n2", dst="n0", layers=(0, 1), bytes=3_000_000, from_shadow=True),
        Move(src="n3", dst="n1", layers=(1,), bytes=1_500_000),
        Move(src="n3", dst="n0", layers=(2,), bytes=1_200_000, from_shadow=True),
        Move(src="n1", dst="n0", layers=(4, 5), bytes=2_000_000),
    )
    sources = LayerSources.of_moves(6, moves)
    assert sources == LayerSources(replica=(3, 4, 5), shadow=(0, 1, 2), replica_bytes=3_500_000, shadow_bytes=4_200_000)
    assert sources.fields() == {
        "replica": {"layers": 3, "bytes": 3_500_000},
        "returned": {"layers": 0, "bytes": 0},
        "shadow": {"layers": 3, "bytes": 4_200_000},
        "disk": {"layers": 0, "bytes": 0},
    }
    assert sources.describe() == (
        "layers by source: 3 from replicas (3.5 MB moved), 3 from shadows (4.2 MB), 0 from disk (0.0 MB read)"
    )
    assert LayerSources.of_moves(6, ()) == LayerSources(replica=tuple(range(6)))  # nothing moved: all kept
    # a restore: layer i's file read by each of its 2 holders (one per pipeline)
    restored = LayerSources.of_restore(shadowed_plan(), [10, 20, 30, 40, 50, 60])
    assert restored == LayerSources(disk=tuple(range(6)), disk_bytes=2 * 210)
    assert restored.describe().endswith("0 from shadows (0.0 MB), 6 from disk (0.0 MB read)")


# ----------------------------------------------------------------------------- TensorBoard


def test_tensorboard_shows_the_shadows_host_memory_lag_and_traffic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real store of two layers: its host bytes are measured at creation (no AdamW state yet)
    and after each update (parameters and both moments), never waiting for a background update;
    the figures carry the plan's total, the lag and the traffic, and the writer puts them under
    `shadows/`, every tag documented."""
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", ["data.seq_len=16"])
    store = new_store(cfg, generation=1, step=-1, layers=[1, 2], kept=None, incoming=[])
    params = store.params
    weights = sum(p.numel() * p.element_size() for p in params)
    assert store.host_bytes == weights == store.nbytes()
    grads = {
        i: torch.cat([torch.cat([torch.ones(1), torch.full((p.numel(),), 1e-3)]) for p in layer.parameters()])
        for i in store.layers
        for layer in [store.layer_model.held(i)]
    }
    store.received(0, grads)
    store.apply(0, 1.0, cfg, background=True)
    store.settle()
    assert store.host_bytes == store.nbytes() > 3 * weights  # the moments, and AdamW's step counters
    steps = sum(
        v.numel() * v.element_size() for p in params for k, v in store.optimizer.state[p].items() if k == "step"
    )
    assert store.host_bytes == 3 * weights + steps

    plan = shadowed_plan()
    figures = ShadowFigures.of(0, plan, store, traffic_bytes=123_456, seconds=0.25)
    assert figures == ShadowFigures(
        host_bytes=store.host_bytes, job_planned_bytes=7 * MIB, lag_steps=0, traffic_bytes=123_456, seconds=0.25
    )
    # the lag is measured when the next step's gradients come (`catch_up`): a settled update gives
    # 0; a slowed keeper (the OOBLECK_SLOW_KEEPER drill) still applying step 1 when step 2's come gives 1
    store.catch_up()
    assert (store.settled_step, store.lag_steps) == (0, 0)
    monkeypatch.setenv(SLOW_KEEPER_ENV, "0.5")
    slow = new_store(cfg, generation=1, step=0, layers=[1, 2], kept=None, incoming=[])
    assert slow.slow_s == 0.5 and slow.settled_step == 0
    slow.received(1, grads)
    slow.apply(1, 1.0, cfg, background=True)
    began = time.monotonic()
    slow.catch_up()
    assert time.monotonic() - began > 0.1  # it waited for the running update
    assert (slow.step, slow.settled_step, slow.lag_steps) == (1, 1, 1)
    lagging = ShadowFigures.of(1, plan, slow, traffic_bytes=654_321, seconds=0.5)
    assert lagging is not None and lagging.lag_steps == 1
    monkeypatch.setenv(SLOW_KEEPER_ENV, "soon")
    with pytest.raises(ValueError, match="OOBLECK_SLOW_KEEPER='soon': must be SECONDS >= 0"):
        new_store(cfg, generation=1, step=0, layers=[1, 2], kept=None, incoming=[])
    assert ShadowFigures.of(0, plan, None, traffic_bytes=0, seconds=0.0).host_bytes == 0  # the writer keeps none
    assert ShadowFigures.of(0, layout_plan([[(0, 6)]], [8], generation=1), store, traffic_bytes=0, seconds=0) is None

    metrics = Metrics(tmp_path / "tb", enabled=True, samples_per_step=8, tokens_per_step=128, total_steps=4)
    metrics.shadows(figures, 0)
    metrics.shadows(lagging, 1)
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0}).Reload()
    written = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    assert set(written) <= set(TAGS) and all(t.startswith("shadows/") for t in written)
    assert written["shadows/host_gb"] == [(n, pytest.approx(store.host_bytes / 1e9)) for n in (1, 2)]
    assert written["shadows/host_gb_job_planned"] == [
        (1, pytest.approx(7 * MIB / 1e9)),
        (2, pytest.approx(7 * MIB / 1e9)),
    ]
    assert written["shadows/lag_steps"] == [(1, 0.0), (2, 1.0)]
    assert written["shadows/traffic_bytes"] == [(1, 123_456.0), (2, 654_321.0)]
    assert written["shadows/seconds"] == [(1, 0.25), (2, 0.5)]
