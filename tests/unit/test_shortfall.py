"""Asked for, given, or said: what a plan gives less than the config asks is a warning the leader
logs, TensorBoard's plan text and `oobleck status` show, a refusal before the launch when the
nodes can never give it, and a failure at the start under `fault_tolerance.strict`."""

from __future__ import annotations

import dataclasses

from launcher.checks import node_shortfall, preflight
from oobleck_elastic.engine.telemetry.metrics import describe_plan
from oobleck_elastic.rendezvous.decide import shortfall_line, strict_refusal
from oobleck_elastic.testing import layout_plan

SHORT = (
    "1 pipeline(s) instead of f+1=2 (fault_tolerance.f=1): only 1 nodes (n0=1); a failure may need a checkpoint restore"
)


def _plan(generation: int, warnings: tuple[str, ...]):
    return dataclasses.replace(layout_plan([[(0, 6)]], [4], generation=generation), warnings=warnings)


def test_the_launch_refuses_shadow_copies_its_nodes_can_never_place_and_warns_of_too_few_pipelines() -> None:
    assert node_shortfall(1, 3, 4, False) == (None, [])  # 3 copies on 4 nodes may fit: the planner decides
    refusal, warnings = node_shortfall(1, 5, 4, False)
    assert warnings == [] and refusal == (
        "fault_tolerance.shadow_copies=5 needs at least 6 nodes (each copy on a node that does not hold the layer); "
        "this launch starts at most 4: lower fault_tolerance.shadow_copies below 4 (`oobleck plan --nodes 4` shows "
        "what fits) or start more nodes"
    )
    assert node_shortfall(1, 4, 4, False)[0] is not None  # one node at least holds the layer
    assert node_shortfall(1, 0, 1, False) == (
        None,
        [
            "warning: fault_tolerance.f=1 asks for f+1=2 pipelines, each on nodes of its own; this launch starts at "
            "most 1 node(s): the job trains 1 pipeline(s), and a node's failure needs a checkpoint"
        ],
    )
    assert node_shortfall(1, 0, 1, True) == (
        "fault_tolerance.strict: fault_tolerance.f=1 asks for f+1=2 pipelines, each on nodes of its own; this launch "
        "starts at most 1 node(s): start more nodes or lower fault_tolerance.f",
        [],
    )
    assert node_shortfall(2, 0, 3, True) == (None, [])


def test_the_preflight_reads_the_keys_from_the_script_and_says_its_warnings() -> None:
    said: list[str] = []
    script = ["examples/train.py", "--config", "configs/gpt2-tiny.yaml"]
    assert preflight(script, nodes=1, warn=said.append) is None and len(said) == 1
    assert preflight([*script, "fault_tolerance.shadow_copies=5"], nodes=4, warn=said.append).startswith(
        "fault_tolerance.shadow_copies=5 needs at least 6 nodes"
    )
    assert preflight([*script, "fault_tolerance.strict=true"], nodes=2, warn=said.append) is None and len(said) == 1


def test_a_first_plan_that_gives_less_fails_only_under_strict_and_a_later_one_never() -> None:
    short, full = _plan(1, (SHORT,)), _plan(1, ())
    assert strict_refusal(short, first=True, strict=False) is None
    assert strict_refusal(full, first=True, strict=True) is None
    assert strict_refusal(_plan(3, (SHORT,)), first=False, strict=True) is None  # after losses: the best left
    assert strict_refusal(short, first=True, strict=True) == (
        f"fault_tolerance.strict: generation 1 gives less than the config asks: {SHORT}; change the keys named, "
        "start more nodes, or set fault_tolerance.strict=false to train with less"
    )


def test_the_leader_line_and_the_boards_plan_text_name_what_is_missing() -> None:
    plan = _plan(2, (SHORT, "no shadow copies instead of fault_tolerance.shadow_copies=1: no room"))
    assert shortfall_line(_plan(2, ())) is None
    assert shortfall_line(plan) == (
        f"generation 2 gives less than the config asks: {SHORT}; "
        "no shadow copies instead of fault_tolerance.shadow_copies=1: no room"
    )
    text = describe_plan(plan).splitlines()
    assert text[-2:] == [
        f"warning: {SHORT}",
        "warning: no shadow copies instead of fault_tolerance.shadow_copies=1: no room",
    ]
    assert not [line for line in describe_plan(_plan(2, ())).splitlines() if "warning" in line]
