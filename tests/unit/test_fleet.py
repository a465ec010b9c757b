"""A mixed fleet planned from the config's device classes (planning/fleet.py, `oobleck plan --classes`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oobleck_elastic.cli import main
from oobleck_elastic.config import ConfigError, load_config
from oobleck_elastic.planning import PlanningError, load_profiles, plan_job
from oobleck_elastic.planning.fleet import (
    FleetPlan,
    class_speed,
    fleet_json,
    parse_class_counts,
    plan_fleet,
    scaled_profile,
)
from oobleck_elastic.planning.templates.templates import memory_limit_bytes

ROOT = Path(__file__).resolve().parents[2]
GPT3 = str(ROOT / "configs" / "gpt3-175b.yaml")


def _gpt3(*overrides: str):
    cfg = load_config(GPT3, ["planning.tensor_parallel=8", *overrides])
    return cfg, load_profiles(cfg)


def _assert_within_memory(fp: FleetPlan, cfg) -> None:
    """Every stage of the plan fits its class's devices (the template's 1F1B memory, or the
    simulated schedule's), and names its class."""
    for p in fp.plan.pipelines:
        (c,) = {s.device_class for s in p.stages}
        assert c in fp.counts and all(n.startswith(f"{c}-") for n in p.nodes)
        ts = fp.templates[c]
        limit = memory_limit_bytes(ts.device_memory_gb, cfg.planning.memory_margin)
        assert all(s.memory_bytes <= limit for s in ts[p.template_nodes].stages), (c, p.template_nodes)


def test_the_shipped_classes_plan_1024_nodes_and_leave_out_the_class_too_slow_to_help(capsys) -> None:
    assert (
        main(["plan", "--config", GPT3, "--classes", "h100=512,a100=384,v100=128", "planning.tensor_parallel=8"]) == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan for 1024 node(s) of 3 class(es): 96 pipeline(s), step 4.514 s, 340.3 samples/s")
    rows = {line.split()[0]: line.split() for line in out[3:6]}
    assert rows["h100"][1:3] == ["512", "512"] and rows["h100"][3] == "3.17x"
    assert rows["a100"][1:3] == ["384", "384"] and rows["v100"][1:3] == ["128", "0"]
    assert rows["v100"][6] == "14"  # 32 GiB devices need more nodes for one replica than 80 GiB ones (6)
    assert (
        "warning: class v100 left out: its fastest pipeline takes 7.202 s for one microbatch, longer than "
        "the step of 4.514 s the other classes make without it"
    ) in out
    assert out[-1] == (
        "against 2058 node(s) of a100 alone (the same peak FLOP/s): 269.7 samples/s; the mixed fleet's MFU is "
        "1.262x theirs (gap -26.2 %)"
    )


@pytest.mark.parametrize(
    "classes,schedule",
    [("h100=512,a100=384,v100=128", "1f1b"), ("v100=40,a100=7", "1f1b"), ("h100=9,v100=30", "auto")],
)
def test_every_emitted_plan_fits_each_class_memory_and_uses_the_batch(classes: str, schedule: str) -> None:
    batch = 1536 if schedule == "1f1b" else 16  # simulated schedules: a batch the simulator plans in seconds
    cfg, profiles = _gpt3(f"planning.schedule={schedule}", f"training.global_batch_size={batch}")
    fp = plan_fleet(cfg, parse_class_counts(classes, cfg), profiles)
    _assert_within_memory(fp, cfg)
    assert sum(p.microbatches for p in fp.plan.pipelines) == batch and len(fp.plan.pipelines) >= 2
    assert len(fp.plan.nodes) == sum(fp.counts.values())
    out = json.loads(json.dumps(fleet_json(fp)))
    assert {c: r["nodes"] for c, r in out["classes"].items()} == fp.counts
    assert {s["device_class"] for p in out["plan"]["pipelines"] for s in p["stages"]} <= set(fp.counts)


@pytest.mark.parametrize("nodes", [24, 30])
def test_one_class_plans_as_the_job_planner_does_and_a_split_of_it_no_faster(nodes: int) -> None:
    cfg, profiles = _gpt3("planning.classes.b.peak_tflops=312", "planning.classes.b.device_memory_gb=80")
    one = plan_job(load_config(GPT3, ["planning.tensor_parallel=8"]), nodes=nodes, profile=profiles).plan
    fp = plan_fleet(cfg, {"a100": nodes}, profiles)
    assert fp.plan.est_step_time_s == one.est_step_time_s
    assert [p.template_nodes for p in fp.plan.pipelines] == [p.template_nodes for p in one.pipelines]
    assert [p.microbatches for p in fp.plan.pipelines] == [p.microbatches for p in one.pipelines]
    # the same devices split into two classes: no pipeline may span both, so never faster
    split = plan_fleet(cfg, {"a100": nodes // 2, "b": nodes - nodes // 2}, profiles)
    assert split.plan.est_step_time_s >= one.est_step_time_s


def test_a_class_speed_comes_from_its_measured_ratio_or_the_peaks_and_scales_every_time() -> None:
    cfg, profiles = _gpt3("planning.classes.v100.speed=0.5")
    assert class_speed(cfg, "v100") == (0.5, "planning.classes.v100.speed")
    assert class_speed(cfg, "h100") == (pytest.approx(989 / 312), "peak 989 / 312 TFLOP/s of a100")
    assert class_speed(cfg, "a100") == (1.0, "the profiled class")
    base = profiles[8]
    fast = scaled_profile(base, 2.0)
    for a, b in zip(base.layers, fast.layers):
        assert b.forward_s == a.forward_s / 2 and b.backward_s == a.backward_s / 2
        assert b.recomputed_backward_s == pytest.approx(a.recomputed_backward_s / 2)
        assert (b.param_bytes, b.activation_bytes) == (a.param_bytes, a.activation_bytes)
    assert fast.key["speed"] == 2.0


def test_bad_classes_are_refused_in_one_line_naming_the_class_and_the_key(capsys) -> None:
    cfg, profiles = _gpt3()
    with pytest.raises(PlanningError) as err:
        parse_class_counts("h100=4,b200=2", cfg)
    assert str(err.value) == (
        "--classes: class 'b200' is not defined: planning.classes defines a100, h100, v100; add "
        "planning.classes.b200.peak_tflops (and its memory and devices) to the config"
    )
    with pytest.raises(PlanningError, match="'h100=x' is not NAME=COUNT"):
        parse_class_counts("h100=x", cfg)
    with pytest.raises(PlanningError, match="class 'h100' is given twice"):
        parse_class_counts("h100=1,h100=2", cfg)
    nobase, _ = _gpt3("planning.profiled_class=null")
    with pytest.raises(PlanningError) as err:
        plan_fleet(nobase, {"h100": 8}, profiles)
    assert str(err.value) == (
        "class h100 has no profile_path of its own and planning.profiled_class is not set: name the class "
        "the profile was measured on (planning.profiled_class), or give planning.classes.h100.speed"
    )
    tiny, _ = _gpt3("planning.classes.v100.device_memory_gb=2")
    with pytest.raises(PlanningError) as err:
        plan_fleet(tiny, {"a100": 8, "v100": 8}, profiles)
    assert str(err.value).startswith("class v100 (planning.classes.v100): the model cannot fit even with one layer")
    assert "of planning.classes.v100.device_memory_gb=2 (memory_margin 0.1): raise planning.classes.v100." in str(
        err.value
    )
    wide, _ = _gpt3("planning.classes.v100.gpus_per_node=16")
    with pytest.raises(PlanningError, match=r"classes with \[8, 16\] devices per node: mixed node sizes are not"):
        plan_fleet(wide, {"a100": 12, "v100": 30}, profiles)
    with pytest.raises(ConfigError) as cerr:
        load_config(GPT3, ["planning.profiled_class=b200", "planning.classes.h100.speed=0"])
    assert "'planning.classes.h100.speed' must be > 0 (got 0.0)" in str(cerr.value)
    assert "'planning.profiled_class' is 'b200' but planning.classes defines a100, h100, v100" in str(cerr.value)
    assert main(["plan", "--config", GPT3, "--classes", "h100=4", "--nodes", "5", "planning.tensor_parallel=8"]) == 2
    assert capsys.readouterr().err.strip() == (
        "oobleck plan: error: --nodes 5 but --classes adds up to 4: drop --nodes"
    )


def test_a_node_declares_its_class_by_rdzv_conf_or_environment_and_a_wrong_one_is_refused(monkeypatch) -> None:
    from oobleck_elastic.rendezvous.options import device_class_of

    cfg, _ = _gpt3()
    monkeypatch.delenv("OOBLECK_DEVICE_CLASS", raising=False)
    assert device_class_of({"device_class": "h100"}, cfg) == "h100"
    monkeypatch.setenv("OOBLECK_DEVICE_CLASS", "v100")
    assert device_class_of({}, cfg) == "v100" and device_class_of({"device_class": "a100"}, cfg) == "a100"
    with pytest.raises(ValueError) as err:
        device_class_of({"device_class": "b200"}, cfg)
    assert str(err.value) == (
        "--rdzv-conf device_class=b200: the job config's planning.classes defines a100, h100, v100; add "
        "planning.classes.b200, or give one of them"
    )
    monkeypatch.delenv("OOBLECK_DEVICE_CLASS")
    with pytest.raises(ValueError, match="defines device classes \\(a100, h100, v100\\) but this node declares none"):
        device_class_of({}, cfg)
    plain = load_config(None, [])
    assert device_class_of({}, plain) == ""


def test_the_local_launcher_gives_each_node_its_class_and_waits_for_the_full_plan_on_request() -> None:
    from launcher.checks import plan_is_full
    from launcher.local import LocalCluster
    from launcher.options import build_parser

    args = build_parser().parse_args(["--nodes", "3", "--device-classes", "fast,slow", "--paced-speeds", "1,0.5"])
    cluster = LocalCluster(args, ["examples/train.py"])
    assert [cluster.node_env(i)["OOBLECK_DEVICE_CLASS"] for i in range(4)] == ["fast", "slow", "slow", "slow"]
    assert [cluster.node_env(i)["OOBLECK_PACED_SPEED"] for i in range(3)] == ["1", "0.5", "0.5"]
    assert "OOBLECK_DEVICE_CLASS" not in LocalCluster(build_parser().parse_args([]), ["x.py"]).node_env(0)
    ids = {0: "node0", 1: "node1", 2: "node2"}
    assert plan_is_full(("node0", "node1", "node2"), ids, [0, 1, 2])
    assert not plan_is_full(("node0", "node1"), ids, [0, 1, 2])  # node2 not in the plan yet
    assert plan_is_full(("node0", "node1"), ids, [0, 1])  # node2 killed: not waited for
    assert not plan_is_full(("node0", "node1"), {0: "node0"}, [0, 1])  # node 1's id not known yet
    assert not plan_is_full(None, ids, [0])


def test_a_paced_device_pads_by_the_speed_the_plan_assumed_over_its_own() -> None:
    from oobleck_elastic.engine.stage.paced import node_factor

    assert node_factor(2.0, 1.0, None) == 2.0  # as the plan assumed
    assert node_factor(2.0, 1.0, 0.5) == 4.0  # a plan blind to classes: the slow device is slower than planned
    assert node_factor(2.0, 0.5, 0.5) == 2.0  # its class planned at its speed
    assert node_factor(0.0, 0.5, 0.25) == 0.0  # not paced
    with pytest.raises(ValueError, match="OOBLECK_PACED_SPEED=0: give a speed > 0"):
        node_factor(1.0, 1.0, 0.0)


def test_a_class_profile_that_cannot_be_read_and_a_node_of_the_wrong_size_are_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    from oobleck_elastic.rendezvous.options import class_devices_problem

    cfg, profiles = _gpt3(f"planning.classes.h100.profile_path={tmp_path / 'missing-tp{tp}.json'}")
    with pytest.raises(PlanningError) as err:
        plan_fleet(cfg, {"h100": 8, "a100": 8}, profiles)
    assert str(err.value).startswith("class h100 (planning.classes.h100.profile_path): none of the profile files")
    sized, _ = _gpt3("planning.classes.h100.gpus_per_node=8")
    assert class_devices_problem(sized, "h100", 8) is None and class_devices_problem(sized, "a100", 4) is None
    assert class_devices_problem(sized, "h100", 4) == (
        "this node has 4 device(s) (--nproc-per-node) but its class h100 declares "
        "planning.classes.h100.gpus_per_node=8: make them agree"
    )
    assert class_devices_problem(sized, "", 4) is None


def test_a_class_profile_path_in_a_config_file_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "job.yaml").write_text(
        "planning:\n  profiled_class: a\n  classes:\n    a: {speed: 1}\n    b: {profile_path: profiles/b.json}\n"
    )
    cfg = load_config(tmp_path / "cfgs" / "job.yaml", ["planning.classes.c.profile_path=rel.json"])
    assert cfg.planning.classes["b"].profile_path == str(tmp_path / "cfgs" / "profiles" / "b.json")
    assert cfg.planning.classes["a"].profile_path is None
    assert cfg.planning.classes["c"].profile_path == "rel.json"  # an override: relative to the working directory
