"""Host-memory shadow copies, the planning side (planning/tolerance/shadows.py).

- The placement property: with s shadow copies of each layer, on nodes that do not hold it on
  their devices, every loss of up to f + s nodes leaves a copy of every layer; checked against
  a reference of its own by enumerating EVERY loss set of small plans (4-8 nodes, f=1, s=0,1,2,
  planner-made and hand-made, spares and devices of several chunks included), and by sampling
  loss sets of a 200-node plan.
- `tolerated_losses` is exactly the largest such k (the smallest loss set that takes a layer is
  one size larger), and `survives` agrees with the reference on every loss set.
- Budgets are respected; impossible placements raise with messages that say what to change.
- s = 0 is today's behaviour: no shadows, plans and their JSON unchanged, `oobleck plan`
  unchanged; the plan's JSON carries shadows when set and rejects malformed ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path
from typing import Optional

import pytest

from oobleck_elastic.cli import main
from oobleck_elastic.config import FaultToleranceConfig, PlanningConfig, load_config
from oobleck_elastic.planning import (
    Plan,
    PlanningError,
    ShadowPlacement,
    build_templates,
    host_memory,
    layer_copies,
    make_plan,
    place_shadows,
    shadow_bytes,
    survives,
    tolerated_losses,
    with_shadows,
)
from oobleck_elastic.testing import TINY_PROFILE_OVERRIDES, layout_plan, tiny_profile, uniform_profile

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3
LAYER = int(0.4 / 4 * GIB) * 3  # one shadow of uniform_profile's layer: params + AdamW's two states


# ----------------------------------------------------------------------------- a reference


def on_devices(plan: Plan, layer: int) -> set[str]:
    """The nodes running `layer`, read from the stages directly: every chunk of a stage with
    chunks (its `start`/`end` are then only the first chunk's)."""
    return {
        s.node for p in plan.pipelines for s in p.stages for u, v in (s.chunks or ((s.start, s.end),)) if u <= layer < v
    }


def reference_holders(plan: Plan, shadows: Optional[ShadowPlacement]) -> list[set[str]]:
    """Each layer's holders, read from the stages and the shadow lists directly."""
    return [on_devices(plan, i) | set(shadows.layers[i] if shadows else ()) for i in range(plan.num_layers)]


def assert_well_placed(plan: Plan, shadows: ShadowPlacement, s: int, budget: dict[str, int]) -> None:
    """s distinct shadows per layer, on plan nodes not holding it on their devices, within budget."""
    used = dict.fromkeys(plan.nodes, 0)
    for layer, nodes in enumerate(shadows.layers):
        assert len(nodes) == len(set(nodes)) == s
        assert set(nodes) <= set(plan.nodes) - on_devices(plan, layer)
        for node in nodes:
            used[node] += shadows.layer_bytes[layer]
    assert all(used[n] <= budget[n] for n in plan.nodes)
    assert used == shadows.load()


def enumerate_losses(plan: Plan, shadows: Optional[ShadowPlacement]) -> int:
    """Checks `survives` against the reference on EVERY subset of the plan's nodes; returns the
    size of the smallest loss set that takes some layer (len(nodes) + 1 if none does)."""
    holders = reference_holders(plan, shadows)
    smallest = len(plan.nodes) + 1
    for k in range(len(plan.nodes) + 1):
        for lost in itertools.combinations(plan.nodes, k):
            alive = all(h - set(lost) for h in holders)
            assert survives(plan, shadows, lost) == alive, lost
            if not alive:
                smallest = min(smallest, k)
    return smallest


def small_plans() -> list[tuple[str, Plan]]:
    """Planner-made plans on 4-8 nodes (1 and 2 devices per node) and hand-made ones whose
    pipelines split the layers differently, one with spares."""
    plans = []
    for g in (1, 2):
        ts = build_templates(uniform_profile(6), gpus_per_node=g, device_memory_gb=1.25)
        for n in range(4, 9):
            plans.append((f"g{g}-n{n}", make_plan(ts, nodes=[f"n{i}" for i in range(n)], num_microbatches=8,
                                                  microbatch_size=1, f=1)))  # fmt: skip
    mixed = layout_plan([[(0, 6)], [(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]], [4, 4, 4], generation=1)
    plans.append(("mixed", mixed))
    two = layout_plan([[(0, 1), (1, 6)], [(0, 5), (5, 6)]], [4, 4], generation=1)
    plans.append(("spares", dataclasses.replace(two, nodes=(*two.nodes, "s0", "s1"), spares=("s0", "s1"))))
    # devices holding several chunks, whose later chunks lie outside the first one's start..end:
    # interleaved zero-bubble as the demo's plan has it (two pipelines of two devices), and zbv
    chunked = [[(0, 2), (2, 3), (3, 4), (4, 6)], [(0, 1), (1, 2), (2, 4), (4, 6)]]
    plans.append(("zero-bubble-chunks", layout_plan(chunked, [4, 4], generation=1, schedule="zero-bubble", chunks=2)))
    plans.append(("zbv", layout_plan(chunked, [4, 4], generation=1, schedule="zbv", chunks=2)))
    return plans


SMALL = small_plans()


# ----------------------------------------------------------------------------- the property


@pytest.mark.parametrize("s", [0, 1, 2])
@pytest.mark.parametrize("name, plan", SMALL, ids=[name for name, _ in SMALL])
def test_every_loss_of_up_to_f_plus_s_nodes_leaves_every_layer(name: str, plan: Plan, s: int) -> None:
    budget = dict.fromkeys(plan.nodes, 100 * LAYER)
    device_copies = min(layer_copies(plan))
    if len(plan.nodes) - max(len(h) for h in reference_holders(plan, None)) < s:
        with pytest.raises(PlanningError, match=r"^fault_tolerance\.shadow_copies=\d needs"):
            place_shadows(plan, s, [LAYER] * plan.num_layers, budget)
        return
    shadows = place_shadows(plan, s, [LAYER] * plan.num_layers, budget)
    assert_well_placed(plan, shadows, s, budget)
    smallest = enumerate_losses(plan, shadows)
    assert device_copies >= plan.f + 1  # every plan here meets f, so the shadows add exactly s
    assert tolerated_losses(plan, shadows) == smallest - 1 == device_copies + s - 1 >= plan.f + s
    assert layer_copies(plan, shadows.extra()) == [c + s for c in layer_copies(plan)]
    assert [len(h) for h in reference_holders(plan, shadows)] == layer_copies(plan, shadows.extra())


@pytest.mark.parametrize("seed", range(6))
def test_uneven_layers_and_budgets_are_placed_within_budget_or_refused(seed: int) -> None:
    """Random layer sizes and per-node budgets: a placement keeps every budget and the loss
    property; a refusal says which layer found no room."""
    rng = random.Random(seed)
    placed = refused = 0
    for _ in range(40):
        _, plan = rng.choice(SMALL)
        s = rng.choice([1, 2])
        if len(plan.nodes) - max(len(h) for h in reference_holders(plan, None)) < s:
            continue
        sizes = [rng.randint(1, 10) for _ in range(plan.num_layers)]
        budget = {n: rng.randint(0, 30) for n in plan.nodes}
        try:
            shadows = place_shadows(plan, s, sizes, budget)
        except PlanningError as err:
            assert str(err).startswith("no node has host memory for shadow copy "), err
            refused += 1
            continue
        placed += 1
        assert_well_placed(plan, shadows, s, budget)
        assert tolerated_losses(plan, shadows) == enumerate_losses(plan, shadows) - 1 >= plan.f + s
    assert placed and refused  # both paths were taken


def test_without_shadows_the_plan_tolerates_its_device_copies_minus_one() -> None:
    for _, plan in SMALL:
        assert tolerated_losses(plan) == enumerate_losses(plan, None) - 1 == min(layer_copies(plan)) - 1


def test_a_200_node_plan_survives_sampled_losses_of_f_plus_s_nodes() -> None:
    f, s = 2, 2
    ts = build_templates(uniform_profile(24), gpus_per_node=1, device_memory_gb=1.25)
    plan = make_plan(ts, nodes=[f"n{i}" for i in range(200)], num_microbatches=64, microbatch_size=1, f=f)
    assert min(layer_copies(plan)) >= f + 1
    budget = dict.fromkeys(plan.nodes, 2 * LAYER)
    shadows = place_shadows(plan, s, shadow_bytes(uniform_profile(24).layers), budget)
    assert_well_placed(plan, shadows, s, budget)
    holders = reference_holders(plan, shadows)
    k = min(len(h) for h in holders) - 1
    assert tolerated_losses(plan, shadows) == k >= f + s
    rng = random.Random(7)
    for trial in range(3000):
        if trial % 2:  # anywhere
            lost = set(rng.sample(plan.nodes, f + s))
        else:  # aimed at one layer: all but one of its holders, the rest anywhere
            target = sorted(rng.choice(holders))
            lost = set(rng.sample(target, len(target) - 1))
            lost |= set(rng.sample(sorted(set(plan.nodes) - set(target)), max(0, f + s - len(lost))))
        assert survives(plan, shadows, lost) and all(h - lost for h in holders), sorted(lost)
    weakest = min(holders, key=len)
    assert not survives(plan, shadows, weakest) and len(weakest) == k + 1  # one more loss can take a layer
    # the shadows spread: 48 shadows over 200 nodes, none on a node twice while another has none
    count = {n: sum(n in nodes for nodes in shadows.layers) for n in plan.nodes}
    assert max(count.values()) == 1 and sum(count.values()) == s * plan.num_layers


# ----------------------------------------------------------------------------- budgets and errors


def test_budgets_are_respected_and_the_load_spreads() -> None:
    plan = layout_plan([[(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]], [4, 4], generation=1)
    sizes = [300, 100, 100, 100, 100, 200]
    shadows = place_shadows(plan, 1, sizes, {"n0": 1000, "n1": 1000, "n2": 1000, "n3": 1000, "n4": 0})
    # largest layer first, each to the node with the most room left that does not hold it (ties: plan order);
    # n4 has no budget and gets nothing
    assert shadows.layers == (("n1",), ("n3",), ("n2",), ("n2",), ("n3",), ("n0",))
    assert_well_placed(plan, shadows, 1, shadows.budget())
    assert shadows.load() == {"n0": 200, "n1": 300, "n2": 200, "n3": 200, "n4": 0}
    assert shadows.by_node() == {"n1": [0], "n3": [1, 4], "n2": [2, 3], "n0": [5]}
    # 6 equal shadows on 5 nodes with room for two each: the most loaded node has two, the fewest possible
    # (greedy: n4, which holds layers 4-5, is left without one, as the ties went to the others first)
    even = place_shadows(plan, 1, [100] * 6, 200)
    assert sorted(even.load().values()) == [0, 100, 100, 200, 200]
    with pytest.raises(PlanningError, match=r"^no node has host memory for shadow copy 1 of 1 of layer 5 \(100 bytes"):
        place_shadows(plan, 1, [100] * 6, 150)  # room for one each: 5 shadows fit, not 6
    # 5 layers, room for one shadow per node: greedy alone puts layers 0-3 on n1, n3, n2, n0 and leaves
    # layer 4 (held by n1, n4) no node; the repair hands layer 3 from n0 to n4 and puts layer 4 on n0
    five = layout_plan([[(0, 3), (3, 5)], [(0, 2), (2, 4), (4, 5)]], [4, 4], generation=1, num_layers=5)
    tight = place_shadows(five, 1, [100] * 5, 100)
    assert tight.layers == (("n1",), ("n3",), ("n2",), ("n4",), ("n0",))
    assert_well_placed(five, tight, 1, tight.budget())


def test_too_few_nodes_not_holding_a_layer() -> None:
    plan = layout_plan([[(0, 3), (3, 6)], [(0, 3), (3, 6)]], [4, 4], generation=1)
    with pytest.raises(PlanningError) as err:
        place_shadows(plan, 3, [LAYER] * 6, 100 * LAYER)
    assert str(err.value) == (
        "fault_tolerance.shadow_copies=3 needs 3 nodes that do not hold layer 0 on their devices, but 2 of the "
        "plan's 4 nodes running stages hold it, leaving 2: lower fault_tolerance.shadow_copies to 2 or add nodes"
    )
    assert tolerated_losses(plan, place_shadows(plan, 2, [LAYER] * 6, 100 * LAYER)) == 3


def test_a_budget_too_small_names_the_layer_its_bytes_and_the_best_node() -> None:
    plan = layout_plan([[(0, 3), (3, 6)], [(0, 3), (3, 6)]], [4, 4], generation=1)
    sizes = [GIB] * 5 + [3 * GIB]
    with pytest.raises(PlanningError) as err:
        place_shadows(plan, 1, sizes, {"n0": 2 * GIB, "n1": GIB, "n2": 2 * GIB, "n3": GIB})
    # layer 5 (3 GiB) goes first; n0 and n2 (2 GiB) do not hold it, but have too little
    assert str(err.value) == (
        "no node has host memory for shadow copy 1 of 1 of layer 5 (3 GiB of weights and optimizer state): of "
        "the nodes that do not hold it on their devices, n0 has the most left, 2 GiB of its 2 GiB budget "
        "(planning.host_memory_gb): raise planning.host_memory_gb, add nodes or lower fault_tolerance.shadow_copies"
    )
    with pytest.raises(PlanningError) as err:  # layers 0 and 1 fill n1 and n3, the only nodes not holding 0-2
        place_shadows(plan, 2, [GIB] * 6, int(2.5 * GIB), budget_source="the memory available on this machine")
    assert str(err.value) == (
        "no node has host memory for shadow copy 1 of 2 of layer 2 (1 GiB of weights and optimizer state): of "
        "the nodes that do not hold it on their devices, n1 has the most left, 0.5 GiB of the 2.5 GiB of the "
        "memory available on this machine: set planning.host_memory_gb, use nodes with more host memory, add "
        "nodes or lower fault_tolerance.shadow_copies"
    )
    with pytest.raises(PlanningError, match=r"^no host-memory budget for node\(s\) n3$"):
        place_shadows(plan, 1, [1] * 6, {"n0": 9, "n1": 9, "n2": 9})
    with pytest.raises(PlanningError, match=r"^5 layer sizes for a plan of 6 layers$"):
        place_shadows(plan, 1, [1] * 5, 9)


# ----------------------------------------------------------------------------- s = 0, the plan's JSON


def test_zero_shadow_copies_is_todays_behaviour(tmp_path: Path, capsys) -> None:
    plan = SMALL[0][1]
    none = place_shadows(plan, 0, [LAYER] * plan.num_layers, 0)
    assert none.layers == ((),) * plan.num_layers and none.extra() == {}
    assert tolerated_losses(plan, none) == tolerated_losses(plan) == min(layer_copies(plan)) - 1
    assert "shadows" not in plan.to_json() and plan.shadows is None
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", [])
    assert cfg.fault_tolerance.shadow_copies == 0 and cfg.planning.host_memory_gb is None
    assert with_shadows(cfg, plan, uniform_profile(6)) is plan
    prof = tiny_profile(tmp_path / "p.json")
    args = ["plan", "--config", str(ROOT / "configs/gpt2-tiny.yaml"), "--nodes", "4", "--profile", str(prof)]
    assert main([*args, *TINY_PROFILE_OVERRIDES]) == 0
    assert "shadow" not in capsys.readouterr().out
    assert main([*args, "--json", *TINY_PROFILE_OVERRIDES]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "shadows" not in out["plan"] and "host_memory" not in out


def test_the_plan_json_carries_its_shadows_and_rejects_bad_ones() -> None:
    plan = layout_plan([[(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]], [4, 4], generation=1)
    placed = dataclasses.replace(plan, shadows=place_shadows(plan, 2, [LAYER] * 6, 10 * LAYER))
    placed.check()
    data = json.loads(json.dumps(placed.to_json()))
    assert data["shadows"]["copies"] == 2 and Plan.from_json(data) == placed

    def broken(mutate) -> str:
        bad = json.loads(json.dumps(data))
        mutate(bad["shadows"])
        with pytest.raises(PlanningError) as err:
            Plan.from_json(bad)
        return str(err.value)

    on_device = plan.pipelines[0].stages[0].node  # n0 holds layers 0-2
    assert on_device == "n0" and on_device not in data["shadows"]["layers"][0]
    assert broken(lambda s: s["layers"][0].__setitem__(0, on_device)) == (
        "plan generation 1: shadow copies: layer 0 on n0, which holds it on its devices"
    )
    first = data["shadows"]["layers"][0]
    assert broken(lambda s: s["layers"].__setitem__(0, [first[0], first[0]])) == (
        f"plan generation 1: shadow copies: layer 0 has {[first[0], first[0]]}, not 2 distinct nodes"
    )
    assert broken(lambda s: s["layers"][0].__setitem__(0, "x")) == (
        "plan generation 1: shadow copies: layer 0 on x, which is not a node of the plan"
    )
    assert broken(lambda s: s["layers"].pop()) == (
        "plan generation 1: shadow copies: 5 layers placed and 6 sized, but the plan has 6"
    )
    assert broken(lambda s: s["budget_bytes"].__setitem__(first[0], 0)) == (
        f"plan generation 1: shadow copies: {first[0]} keeps {2 * LAYER / GIB:.4g} GiB, over its budget of 0 GiB"
    )
    assert broken(lambda s: s.pop("budget_bytes")) == "malformed plan: shadows: KeyError: 'budget_bytes'"
    assert broken(lambda s: s.__setitem__("copies", -1)) == (
        "malformed plan: shadows: ValueError: shadows.copies: -1 is not an integer >= 0"
    )


def test_a_shadow_on_a_device_holder_is_refused() -> None:
    plan = layout_plan([[(0, 3), (3, 6)], [(0, 3), (3, 6)]], [4, 4], generation=1)
    good = place_shadows(plan, 1, [1] * 6, 10)
    layers = list(good.layers)
    layers[0] = ("n0",)  # n0 runs layers 0-2
    with pytest.raises(PlanningError, match=r"^plan generation 1: shadow copies: layer 0 on n0, which holds it"):
        dataclasses.replace(plan, shadows=dataclasses.replace(good, layers=tuple(layers))).check()


def test_a_device_holds_every_layer_of_its_chunks() -> None:
    """With chunks a stage's `start`/`end` are only its first chunk's: n0 also runs layer 3 and
    n1 layers 4-5 (the demo's zero-bubble plan has such devices). A shadow there would be a keeper
    sending itself its own gradients each step (gloo: "Pair is not connected"); it is never placed,
    and refused when given; the copies count every chunk."""
    plan = layout_plan([[(0, 2), (2, 3), (3, 4), (4, 6)]], [8], generation=1, schedule="zero-bubble", chunks=2)
    assert [(s.start, s.end, s.layers()) for s in plan.pipelines[0].stages] == [(0, 2, (0, 1, 3)), (2, 3, (2, 4, 5))]
    assert layer_copies(plan) == [1] * 6
    shadows = place_shadows(plan, 1, [1] * 6, 10)
    assert shadows.layers == (("n1",), ("n1",), ("n0",), ("n1",), ("n0",), ("n0",))
    layers = list(shadows.layers)
    layers[3] = ("n0",)  # n0 runs layer 3 in its second chunk
    with pytest.raises(PlanningError, match=r"^plan generation 1: shadow copies: layer 3 on n0, which holds it"):
        dataclasses.replace(plan, shadows=dataclasses.replace(shadows, layers=tuple(layers))).check()


# ----------------------------------------------------------------------------- config and `oobleck plan`


def test_config_fields_are_validated() -> None:
    assert FaultToleranceConfig(shadow_copies=-1).validate() == [
        "'fault_tolerance.shadow_copies' must be >= 0 (got -1): 0 keeps no copy in host memory"
    ]
    assert PlanningConfig(host_memory_gb=0).validate() == [
        "'planning.host_memory_gb' must be > 0 (got 0); leave it unset to measure it"
    ]
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", ["planning.host_memory_gb=12.5"])
    assert host_memory(cfg) == (12.5, "planning.host_memory_gb")
    gib, source = host_memory(load_config(ROOT / "configs/gpt2-tiny.yaml", []))
    assert gib > 0 and source == "the memory available on this machine (planning.host_memory_gb unset)"


def test_a_job_with_shadow_copies_starts_but_not_with_tensor_parallelism() -> None:
    from oobleck_elastic.config import ConfigError
    from oobleck_elastic.engine.startup import check_start

    check_start(load_config(ROOT / "configs/gpt2-tiny.yaml", ["fault_tolerance.shadow_copies=1"]))
    with pytest.raises(ConfigError) as err:
        check_start(
            load_config(
                ROOT / "configs/gpt2-tiny.yaml",
                [
                    "fault_tolerance.shadow_copies=1",
                    "planning.tensor_parallel=2",
                    "planning.gpus_per_node=2",
                    "planning.profile_path=profile-tp{tp}.json",
                ],
            )
        )
    assert str(err.value) == (
        "fault_tolerance.shadow_copies=1 with tensor parallelism: training keeps shadow copies only with "
        "planning.tensor_parallel=1 (a keeper would need every lane's shards); set planning.tensor_parallel=1 or "
        "fault_tolerance.shadow_copies=0"
    )


def test_spares_keep_no_shadow() -> None:
    """A spare has no worker in the generation: shadows go to nodes running stages, and a
    placement naming a spare is refused."""
    two = layout_plan([[(0, 1), (1, 6)], [(0, 5), (5, 6)]], [4, 4], generation=1)
    plan = dataclasses.replace(two, nodes=(*two.nodes, "s0", "s1"), spares=("s0", "s1"))
    placed = place_shadows(plan, 1, [LAYER] * 6, 100 * LAYER)
    assert not {n for nodes in placed.layers for n in nodes} & {"s0", "s1"}
    bad = dataclasses.replace(placed, layers=(("s0",), *placed.layers[1:]))
    with pytest.raises(PlanningError) as err:
        bad.check(plan)
    assert str(err.value) == "plan generation 1: shadow copies: layer 0 on s0, a spare (no worker to keep it)"


def test_a_job_keeps_as_many_shadows_as_fit_after_losses() -> None:
    """Two nodes that both hold every layer leave no node for a shadow: a job's re-plan keeps none
    and says why; `oobleck plan` (fewer=False) refuses."""
    from oobleck_elastic.planning import with_shadows

    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", ["fault_tolerance.shadow_copies=1", "planning.host_memory_gb=1"])
    plan = layout_plan([[(0, 6)], [(0, 6)]], [4, 4], generation=2)
    profile = uniform_profile(6, gib_per_layer=0.004)
    kept = with_shadows(cfg, plan, profile, fewer=True)
    assert kept.shadows is None
    assert kept.warnings[-1] == (
        "no shadow copies instead of fault_tolerance.shadow_copies=1: fault_tolerance.shadow_copies=1 needs 1 "
        "nodes that do not hold layer 0 on their devices, but 2 of the plan's 2 nodes running stages hold it, "
        "leaving 0: lower fault_tolerance.shadow_copies to 0 or add nodes"
    )
    with pytest.raises(PlanningError):
        with_shadows(cfg, plan, profile)
    four = layout_plan([[(0, 3), (3, 6)], [(0, 3), (3, 6)]], [4, 4], generation=2)
    cfg3 = load_config(
        ROOT / "configs/gpt2-tiny.yaml", ["fault_tolerance.shadow_copies=3", "planning.host_memory_gb=1"]
    )
    fewer = with_shadows(cfg3, four, profile, fewer=True)
    assert fewer.shadows is not None and fewer.shadows.copies == 2
    assert fewer.warnings[-1].startswith("2 shadow copies of each layer instead of fault_tolerance.shadow_copies=3: ")


def test_shadow_bytes_are_weights_and_optimizer_state_of_every_lane() -> None:
    layers = uniform_profile(3, gib_per_layer=0.4).layers  # params 0.1 GiB, AdamW states 0.2 GiB
    assert shadow_bytes(layers) == [LAYER] * 3
    assert shadow_bytes(layers, tensor_parallel=4) == [4 * LAYER] * 3


def test_oobleck_plan_shows_the_shadows(tmp_path: Path, capsys) -> None:
    prof = tiny_profile(tmp_path / "p.json")
    args = ["plan", "--config", str(ROOT / "configs/gpt2-tiny.yaml"), "--nodes", "4", "--profile", str(prof)]
    shadow = ["fault_tolerance.shadow_copies=1", "planning.host_memory_gb=2", *TINY_PROFILE_OVERRIDES]
    assert main([*args, *shadow]) == 0
    text = capsys.readouterr().out
    shadows = text[text.index("shadow copies") :].split("\n\n")[0]  # the section, up to the next one
    assert shadows.splitlines() == [
        "shadow copies (fault_tolerance.shadow_copies=1): every layer also in the host memory of 1 node(s) that "
        "do not hold it on their devices; any 2 simultaneous node losses leave a copy of every layer (1 without "
        "them)",
        "  host memory for shadows per node: most 0.6 GiB, least 0.3 GiB, of 2 GiB each (planning.host_memory_gb)",
        "  node0: layers 3, 5 (0.6 GiB of 2 GiB)",
        "  node1: layers 0, 2 (0.6 GiB of 2 GiB)",
        "  node2: layers 4 (0.3 GiB of 2 GiB)",
        "  node3: layers 1 (0.3 GiB of 2 GiB)",
    ]
    assert main([*args, "--json", *shadow]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_memory"] == {"gib": 2.0, "source": "planning.host_memory_gb"} and out["tolerated_losses"] == 2
    plan = Plan.from_json(out["plan"])
    assert plan.shadows is not None and tolerated_losses(plan, plan.shadows) == 2
    assert main([*args, "fault_tolerance.shadow_copies=1", "planning.host_memory_gb=0.5", *TINY_PROFILE_OVERRIDES]) == 2
    assert capsys.readouterr().err.strip() == (
        "oobleck plan: error: no node has host memory for shadow copy 1 of 1 of layer 2 (0.3 GiB of weights and "
        "optimizer state): of the nodes that do not hold it on their devices, node1 has the most left, 0.2 GiB of "
        "its 0.5 GiB budget (planning.host_memory_gb): raise planning.host_memory_gb, add nodes or lower "
        "fault_tolerance.shadow_copies"
    )
