"""Shadow copies made observable: `oobleck status` lists the placement of the plan in etcd, every
recovery says where each layer came from (a surviving replica, a shadow copy or the checkpoint),
TensorBoard shows the shadows' host memory, lag and traffic, and the goodput ledger charges the
wait for the shadow exchange to `shadows`."""

from __future__ import annotations

import dataclasses

from oobleck_elastic import ops
from oobleck_elastic.engine.generation.reconfigure import LayerSources, Move
from oobleck_elastic.engine.telemetry.goodput import GoodputClock
from oobleck_elastic.etcd import connect
from oobleck_elastic.planning import place_shadows
from oobleck_elastic.records.goodput import MEANING, Category, Ledger, Origin, describe, ended_step
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.testing import layout_plan

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
        lines = ops.status(client, keys)
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
        assert not [line for line in ops.status(client, keys) if "shadow" in line]
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
