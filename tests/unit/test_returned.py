"""Where the next generation takes each layer from (rendezvous/publish.py `choose_sources`), on
made-up plans: a node declared lost while alive that came back is a source, and only a real loss
of every copy goes to shadows or disk."""

from __future__ import annotations

from dataclasses import replace

from oobleck_elastic.engine.entry.reconfigure import LayerSources, Move
from oobleck_elastic.planning import Plan
from oobleck_elastic.planning.plan.plan import ShadowPlacement
from oobleck_elastic.records.control import NodeRecord, NodeState
from oobleck_elastic.rendezvous.publish import Source, choose_sources, maybe_alive, returned_nodes, with_donors
from oobleck_elastic.testing import layout_plan

# generation 1: two pipelines of two stages, n0 and n2 hold layers 0-2, n1 and n3 layers 3-5
OLD = layout_plan([[(0, 3), (3, 6)], [(0, 3), (3, 6)]], [2, 2], generation=1)


def on(plan: Plan, *nodes: str) -> Plan:
    """`plan` with its nodes renamed, in rank order, to `nodes`."""
    names = dict(zip(plan.nodes, nodes, strict=True))
    pipelines = tuple(
        replace(
            p,
            nodes=tuple(names[n] for n in p.nodes),
            stages=tuple(replace(s, node=names[s.node]) for s in p.stages),
        )
        for p in plan.pipelines
    )
    return replace(plan, nodes=tuple(names[n] for n in plan.nodes), pipelines=pipelines)


# generation 2 on the survivors n0 and n2: two one-stage pipelines
NEW = on(layout_plan([[(0, 6)], [(0, 6)]], [2, 2], generation=2), "n0", "n2")


def record(node: str, state: NodeState = NodeState.UP) -> NodeRecord:
    index = int(node[1:])
    return NodeRecord(
        node_id=node, index=index, host="h", devices=1, agent_pid=1, state=state, since=0.0, lease_id=index + 1
    )


def test_a_kill_plus_a_false_death_takes_the_layers_from_the_returned_node() -> None:
    # n1 killed (proven dead), n3 declared lost while alive and back: its layers 3-5 count again
    choice = choose_sources(NEW, OLD, returned=["n3"])
    assert choice.sources == (Source.REPLICA,) * 3 + (Source.RETURNED,) * 3
    assert choice.returned == ("n3",) and choice.awaited == ()
    assert choice.layers(Source.RETURNED) == (3, 4, 5)


def test_a_returned_node_is_no_source_where_a_replica_survives() -> None:
    # n1 alive in the plan holds 3-5: the returned n3 is not needed, so it is no donor
    plan = on(layout_plan([[(0, 3), (3, 6)]], [4], generation=2), "n0", "n1")
    choice = choose_sources(plan, OLD, returned=["n3"])
    assert set(choice.sources) == {Source.REPLICA} and choice.returned == ()


def test_a_holder_that_may_still_come_back_is_waited_for() -> None:
    choice = choose_sources(NEW, OLD, maybe_alive=["n3"])
    assert choice.layers(Source.WAIT) == (3, 4, 5) and choice.awaited == ("n3",)


def test_only_a_real_loss_of_every_copy_goes_to_disk() -> None:
    # both holders of 3-5 proven dead (neither back nor maybe alive): the checkpoint
    choice = choose_sources(NEW, OLD)
    assert choice.layers(Source.DISK) == (3, 4, 5) and choice.awaited == () and choice.returned == ()


def test_shadows_serve_before_a_wait_and_after_a_returned_node() -> None:
    shadows = ShadowPlacement(
        copies=1,
        layers=(("n1",),) * 3 + (("n0",),) * 3,  # n0 keeps the shadows of 3-5
        layer_bytes=(1,) * 6,
        budgets=tuple((n, 10) for n in OLD.nodes),
    )
    old = replace(OLD, shadows=shadows)
    waiting = choose_sources(NEW, old, maybe_alive=["n3"])
    assert waiting.layers(Source.SHADOW) == (3, 4, 5) and waiting.awaited == ()
    back = choose_sources(NEW, old, returned=["n3"])
    assert back.layers(Source.RETURNED) == (3, 4, 5) and back.returned == ("n3",)


def test_a_layer_in_a_later_chunk_comes_from_its_surviving_holder() -> None:
    """Zero-bubble with two chunks per device: n0 and n2 run layers 0-1 and 3, n1 and n3 layer 2
    and 4-5 (a stage's start/end are its first chunk's only). n0 and n1 are lost: n2 and n3
    still hold every layer, 3-5 included, so nothing comes from a shadow or the disk."""
    chunked = [(0, 2), (2, 3), (3, 4), (4, 6)]
    old = layout_plan([chunked, chunked], [2, 2], generation=1, schedule="zero-bubble", chunks=2)
    new = on(layout_plan([[(0, 6)], [(0, 6)]], [2, 2], generation=2), "n2", "n3")
    assert choose_sources(new, old).sources == (Source.REPLICA,) * 6


def test_a_draining_donor_is_a_replica() -> None:
    choice = choose_sources(NEW, OLD, donors=["n1"], returned=["n3"])
    assert set(choice.sources) == {Source.REPLICA} and choice.returned == ()


def test_returned_and_maybe_alive_nodes_from_the_records() -> None:
    records = [record("n0"), record("n2"), record("n3", NodeState.RETURNED)]
    assert returned_nodes(OLD, records) == ("n3",)
    # n1's record vanished and nobody declared it lost: its lease expired, it may come back
    assert maybe_alive(OLD, NEW, records, lambda n: n == "n3") == ("n1",)
    # declared lost by a detector (fenced): a refused liveness connection, or a missed ping
    assert maybe_alive(OLD, NEW, records, lambda n: n in ("n1", "n3")) == ()
    # nodes with a live record are not waited for (one left out alive: a straggler)
    everyone = [record("n0"), record("n1"), record("n2"), record("n3")]
    assert maybe_alive(OLD, NEW, everyone, lambda n: False) == ()


def test_the_plan_names_the_returned_donor_and_keeps_it_through_json() -> None:
    records = [record("n0"), record("n2"), record("n3", NodeState.RETURNED)]
    plan, choice = with_donors(replace(NEW, donors=()), OLD, records, {}, lambda n: n in ("n1", "n3"))
    assert choice is not None and choice.returned == ("n3",)
    assert plan.donors == ("n3",) and plan.returned == ("n3",)
    assert Plan.from_json(plan.to_json()) == plan
    assert "returned" not in NEW.to_json()  # only when set
    # both records vanished, nobody declared either lost: the re-plan waits for them
    records = [record("n0"), record("n2")]
    waiting, choice = with_donors(NEW, OLD, records, {}, lambda n: False)
    assert choice is not None and choice.awaited == ("n1", "n3") and waiting.donors == ()


def test_an_entry_counts_the_layers_a_returned_node_sent() -> None:
    moves = (
        Move(src="n3", dst="n0", layers=(3, 4, 5), bytes=3_000_000),
        Move(src="n2", dst="n0", layers=(1,), bytes=1_000_000),
    )
    sources = LayerSources.of_moves(6, moves, returned=("n3",))
    assert sources.returned == (3, 4, 5) and sources.replica == (0, 1, 2)
    assert (sources.returned_bytes, sources.replica_bytes) == (3_000_000, 1_000_000)
    assert sources.fields()["returned"] == {"layers": 3, "bytes": 3_000_000}
    assert sources.describe() == (
        "layers by source: 3 from replicas (1.0 MB moved), 3 from returned nodes (3.0 MB), "
        "0 from shadows (0.0 MB), 0 from disk (0.0 MB read)"
    )
    assert "returned" not in LayerSources.of_moves(6, moves).describe()


def test_the_entry_takes_the_returned_donors_layers_only_at_the_committed_step() -> None:
    from oobleck_elastic.engine.entry.reconfigure import plan_transfers

    plan = replace(NEW, donors=("n3",), returned=("n3",))
    survivors = {("n0", 0): range(0, 3), ("n2", 0): range(0, 3)}
    # the returned n3 is at the agreed step: layers 3-5 come from it, nothing is lost
    transfers, lost = plan_transfers({**survivors, ("n3", 0): range(3, 6)}, plan)
    donor = plan.donor_rank("n3", 0)
    assert lost == [] and {t.layer for t in transfers if t.src == donor} == {3, 4, 5}
    # behind the agreed step its workers count as holding nothing (`_agree_on_layouts`): lost
    _, lost = plan_transfers(survivors, plan)
    assert lost == [3, 4, 5]
