"""The profile the planner uses comes from the devices that train.

- Workers (`WorkerContext.share_profile`): one worker per device kind wins a put-if-absent claim
  bound to its node's lease, measures, and publishes `profiles/<device>`; everyone else returns
  at once; a failed measurement gives the claim back; a restarted worker takes its own claim over.
- Leader (`OobleckRendezvousHandler` + `Leader`) without `planning.profile_path`: the first nodes
  are admitted before any plan exists (their handlers return, so their workers can start and
  measure), generation 1 follows once a valid profile is in etcd, that profile is pinned for every
  later leader, malformed ones are logged once, and no profile within
  `fault_tolerance.rendezvous_timeout_s` closes the job as failed with one error.
- `planning.device_memory_gb` defaults to the profiled device's memory (the planner, `oobleck plan`).

All against the real etcd fixture; measurements are replaced by a synthetic profile so that the
tests stay fast on a shared CPU.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.distributed.elastic.rendezvous import RendezvousClosedError
from torch.distributed.elastic.rendezvous import RendezvousParameters

from helpers import TINY_PROFILE_OVERRIDES, tiny_profile
from oobleck_elastic.testing import uniform_profile
from oobleck_elastic import cli
from oobleck_elastic.config import ConfigError, load_config
from oobleck_elastic.etcd import EtcdClient, EtcdSettings, connect
from oobleck_elastic.planning import (
    LayerProfile,
    ModelProfile,
    Plan,
    PlanningError,
    ProfileError,
    build_templates,
    device_memory,
    templates_for,
)
from oobleck_elastic.planning.profile import cache as profile_cache
from oobleck_elastic.rendezvous.handler import OobleckRendezvousHandler
from oobleck_elastic.records.keys import Keys, sanitise
from oobleck_elastic.rendezvous.membership import Member, read_events
from oobleck_elastic.records.control import ProfileClaim
from oobleck_elastic.rendezvous.worker import WorkerContext

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "gpt2-tiny.yaml"
GIB = 1024**3


def synthetic_profile(*, gib_per_layer: float = 0.4, memory: int | None = None, name: str = "l") -> ModelProfile:
    """6 layers (gpt2-tiny's flat list) of `gib_per_layer` GiB params+grads+AdamW each."""
    return uniform_profile(
        gib_per_layer=gib_per_layer, name=name, key={"device": "cpu", "seq_len": 64}, device_memory_bytes=memory
    )


# ---------------------------------------------------------------------------------------- device memory
def test_device_memory_defaults_to_the_profiled_device_and_the_config_overrides_it() -> None:
    assert load_config(None).planning.device_memory_gb is None
    measured = synthetic_profile(memory=3 * GIB)
    measured.key["device_name"] = "Fake GPU"
    cfg = load_config(CONFIG, ["planning.device_memory_gb=null", "planning.memory_margin=0"])
    assert device_memory(cfg, measured) == (3.0, "the profiled device (Fake GPU)")
    tset = templates_for(cfg, measured)
    assert tset.device_memory_gb == 3.0 and tset.n0 == 1  # the 2.4 GiB model fits on one 3 GiB device

    cfg.planning.device_memory_gb = 1.25  # an explicit value wins over the device's
    tset = templates_for(cfg, measured)
    assert (tset.device_memory_gb, tset.memory_source, tset.n0) == (1.25, "planning.device_memory_gb", 2)

    cfg.planning.device_memory_gb = None
    with pytest.raises(
        PlanningError,
        match=r"^planning.device_memory_gb is not set and the profile records no "
        r"device memory .*set planning.device_memory_gb",
    ):
        templates_for(cfg, synthetic_profile())
    with pytest.raises(ConfigError, match="'planning.device_memory_gb' must be > 0"):
        load_config(CONFIG, ["planning.device_memory_gb=0"])


def test_a_model_too_big_for_the_measured_device_says_so() -> None:
    with pytest.raises(PlanningError) as err:
        build_templates(
            synthetic_profile(gib_per_layer=4.0),
            gpus_per_node=1,
            device_memory_gb=2.0,
            memory_source="the profiled device (Fake GPU)",
        )
    text = str(err.value)
    assert (
        "GiB usable of the 2.00 GiB of the profiled device (Fake GPU) (planning.device_memory_gb is not set)" in text
        and "use devices with more memory or lower training.microbatch_size" in text
    )


def test_profile_json_records_device_memory_and_stays_backward_compatible(tmp_path: Path) -> None:
    old = synthetic_profile().to_json()
    assert "device_memory_bytes" not in old  # CPU profiles and old files: the field is absent
    assert ModelProfile.from_json(old).device_memory_bytes is None
    new = synthetic_profile(memory=80 * GIB)
    new.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json").device_memory_bytes == 80 * GIB
    for bad in (0, -1, 1.5, "80", True):
        with pytest.raises(ProfileError, match="device_memory_bytes must be a positive integer"):
            ModelProfile.from_json({**old, "device_memory_bytes": bad})
    with pytest.raises(ProfileError, match="'layers' must be a list"):
        ModelProfile.from_json({"layers": 3})


def test_cpu_profiles_record_no_device_memory(tmp_path: Path) -> None:
    cfg = load_config(
        CONFIG,
        [
            f"data.cache_dir={tmp_path}",
            "planning.profile_repeats=1",
            "planning.profile_warmup=0",
            "data.seq_len=16",
            "training.microbatch_size=1",
            "training.global_batch_size=8",
        ],
    )
    prof = profile_cache.load_or_profile(cfg, device="cpu", log=lambda _: None)
    assert prof.device_memory_bytes is None and profile_cache.device_memory_bytes("cpu") is None
    assert profile_cache.device_label("cpu").startswith("cpu ")
    assert sanitise("cuda NVIDIA H100 80GB HBM3") == "cuda-nvidia-h100-80gb-hbm3" and sanitise("//") == "unknown"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_profile_is_timed_with_events_and_records_the_device_memory(tmp_path: Path) -> None:
    cfg = load_config(CONFIG, [f"data.cache_dir={tmp_path}", "planning.device_memory_gb=null"])
    prof = profile_cache.load_or_profile(cfg, device="cuda:0", log=lambda _: None)
    assert prof.device_memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert prof.key["timer"] == "cuda_events" and all(p.forward_s > 0 and p.backward_s > 0 for p in prof.layers)
    assert templates_for(cfg, prof).memory_source.startswith("the profiled device (")


def test_oobleck_plan_says_where_the_memory_figure_comes_from(tmp_path: Path, capsys) -> None:
    measured = synthetic_profile(memory=2 * GIB)
    measured.key["device_name"] = "Fake GPU"
    measured.save(tmp_path / "measured.json")
    synthetic_profile().save(tmp_path / "cpu.json")

    def plan(profile: str, *extra: str) -> int:
        return cli.main(
            [
                "plan",
                "--config",
                str(CONFIG),
                "--nodes",
                "2",
                "--profile",
                str(tmp_path / profile),
                *extra,
                "planning.memory_margin=0",
            ]
        )

    assert plan("measured.json", "planning.device_memory_gb=null") == 0
    assert "2 GiB each (from the profiled device (Fake GPU))" in capsys.readouterr().out
    assert plan("measured.json", "planning.device_memory_gb=1.25") == 0
    assert "1.25 GiB each (from planning.device_memory_gb)" in capsys.readouterr().out
    assert plan("measured.json", "--json", "planning.device_memory_gb=null") == 0
    assert json.loads(capsys.readouterr().out)["device_memory"] == {
        "gib": 2.0,
        "source": "the profiled device (Fake GPU)",
    }
    assert plan("cpu.json", "planning.device_memory_gb=null") == 2
    assert "error: planning.device_memory_gb is not set" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- workers
class FakeMeasure:
    """Stands in for profile_cache.load_or_profile: counts calls, can block or fail."""

    def __init__(self, profile: ModelProfile) -> None:
        self.profile, self.calls = profile, 0
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()
        self.error: Exception | None = None
        self.during: Callable[[], None] | None = None

    def __call__(self, cfg: Any, *, device: Any, log: Any = None, **_: Any) -> ModelProfile:
        self.calls += 1
        self.entered.set()
        if self.during is not None:
            self.during()
        assert self.release.wait(10)
        if self.error is not None:
            raise self.error
        return self.profile


@pytest.fixture
def fake(monkeypatch) -> FakeMeasure:
    f = FakeMeasure(synthetic_profile(memory=2 * GIB))
    monkeypatch.setattr(profile_cache, "load_or_profile", f)
    return f


@pytest.fixture
def etcd(etcd_server) -> EtcdClient:
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    yield client
    client.close()


def worker(etcd: EtcdClient, run_id: str, node: str, local_rank: int = 0) -> WorkerContext:
    return WorkerContext(client=etcd, keys=Keys("/oobleck", run_id), node_id=node, local_rank=local_rank)


CPU = torch.device("cpu")


def job(*overrides: str):
    return load_config(CONFIG, list(overrides))


def test_one_worker_per_device_kind_measures_and_the_others_return_at_once(etcd, run_id, fake) -> None:
    first, second, third = (worker(etcd, run_id, f"node{i}") for i in range(3))
    keys, label = first.keys, profile_cache.device_label(CPU)
    fake.release.clear()
    t = threading.Thread(target=first.share_profile, args=(job(), CPU))
    t.start()
    assert fake.entered.wait(10)  # node0 holds the claim and is measuring
    claim, _ = etcd.get_json(keys.profile_claim(label))
    assert claim["node"] == "node0" and claim["local_rank"] == 0
    t0 = time.monotonic()
    second.share_profile(job(), CPU)  # lost the claim: returns at once, measures nothing
    assert time.monotonic() - t0 < 1.0 and fake.calls == 1
    assert etcd.get_json(keys.device_profile(label))[0] is None
    fake.release.set()
    t.join(10)
    published = ModelProfile.from_json(etcd.get_json(keys.device_profile(label))[0])
    assert published.layers == fake.profile.layers and published.device_memory_bytes == 2 * GIB
    assert keys.device_profile(label) == keys.root + "profiles/" + sanitise(label)
    assert etcd.get_json(keys.profile_claim(label))[0]["node"] == "node0"  # kept: it goes with node0's lease
    third.share_profile(job(), CPU)  # a profile of this kind exists: nothing to do
    assert fake.calls == 1


def test_nothing_is_measured_with_a_profile_file_or_a_pinned_profile(etcd, run_id, fake, tmp_path) -> None:
    w = worker(etcd, run_id, "node0")
    w.share_profile(job(f"planning.profile_path={tiny_profile(tmp_path / 'p.json')}"), CPU)
    assert fake.calls == 0 and not list(etcd.get_prefix_json(w.keys.root))
    etcd.put_json(w.keys.profile, synthetic_profile().to_json())  # the job already plans from one
    w.share_profile(job(), CPU)
    assert fake.calls == 0


def test_a_failed_measurement_gives_the_claim_back(etcd, run_id, fake) -> None:
    a, b = worker(etcd, run_id, "node0"), worker(etcd, run_id, "node1")
    label = profile_cache.device_label(CPU)
    fake.error = RuntimeError("CUDA out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        a.share_profile(job(), CPU)
    assert etcd.get_json(a.keys.profile_claim(label))[0] is None
    fake.error = None
    b.share_profile(job(), CPU)  # the next worker that comes by measures it
    assert fake.calls == 2 and etcd.get_json(a.keys.device_profile(label))[0] is not None


def test_the_claim_is_bound_to_the_node_lease_and_a_restarted_worker_takes_it_over(etcd, run_id, fake) -> None:
    keys = Keys("/oobleck", run_id)
    member = Member(etcd, keys, devices=1, lease_ttl_s=5)
    member.register()
    try:
        w = worker(etcd, run_id, member.node_id)
        label = profile_cache.device_label(CPU)
        seen: dict[str, Any] = {}

        def look() -> None:
            seen["lease"] = etcd.get(keys.profile_claim(label)).lease

        fake.during = look
        # the same worker's earlier run (torchrun restarted it) left its claim behind
        etcd.put_json(
            keys.profile_claim(label),
            ProfileClaim(node=member.node_id, local_rank=0, pid=1, time=1.0).to_json(),
            lease=member.lease,
        )
        w.share_profile(job(), CPU)
        assert fake.calls == 1 and seen["lease"] == member.lease
        assert etcd.get_json(keys.device_profile(label))[0] is not None
    finally:
        member.close(revoke=True)


def test_a_malformed_profile_in_etcd_is_measured_again(etcd, run_id, fake, caplog) -> None:
    w = worker(etcd, run_id, "node0")
    label = profile_cache.device_label(CPU)
    etcd.put_json(w.keys.device_profile(label), {"layers": "nope"})
    caplog.set_level(logging.WARNING)
    w.share_profile(job(), CPU)
    assert fake.calls == 1 and "ignoring profile in etcd key" in caplog.text
    assert ModelProfile.from_json(etcd.get_json(w.keys.device_profile(label))[0]).num_layers == 6


# ---------------------------------------------------------------------------------------- leader
class Nodes:
    """Simulated agents (one handler each, rendezvous in threads) with no planning.profile_path."""

    def __init__(
        self, endpoint: str, run_id: str, *, min_nodes: int, max_nodes: int, extra: list[str], nproc: int = 1
    ) -> None:
        self.endpoint, self.run_id, self.extra, self.nproc = endpoint, run_id, extra, nproc
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.client = connect(EtcdSettings(endpoint=endpoint))
        self.keys = Keys("/oobleck", run_id)
        self.boxes: list[dict] = []

    def start(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            params = RendezvousParameters(
                backend="oobleck",
                endpoint=self.endpoint,
                run_id=self.run_id,
                min_nodes=self.min_nodes,
                max_nodes=self.max_nodes,
                lease_ttl="1",
                settle="0.1",
                last_call_timeout="0.3",
            )
            argv = ["torchrun", f"--nproc-per-node={self.nproc}", "train.py", "--config", str(CONFIG), *self.extra]
            box: dict = {"handler": OobleckRendezvousHandler(params, argv=argv)}

            def run(box: dict = box) -> None:
                try:
                    box["info"] = box["handler"].next_rendezvous()
                except BaseException as err:  # noqa: BLE001 - the test inspects it (SystemExit too)
                    box["error"] = err

            box["thread"] = threading.Thread(target=run, daemon=True)
            box["thread"].start()
            out.append(box)
        self.boxes += out
        return out

    def plan(self) -> Plan | None:
        data, _ = self.client.get_json(self.keys.plan)
        return Plan.from_json(data) if data is not None else None

    def wait(self, check: Callable[[], Any], timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"condition not met within {timeout}s; plan: {self.plan() and self.plan().to_json()}")

    def publish(self, profile: ModelProfile, device: str = "cpu Fake") -> None:
        """What the measuring worker does once it is done."""
        self.client.put_json(self.keys.device_profile(device), profile.to_json())

    def leader(self) -> OobleckRendezvousHandler:
        return next(b["handler"] for b in self.boxes if b["handler"].leader.is_leader.is_set())

    def close(self) -> None:
        for box in self.boxes:
            h = box["handler"]
            if h.member is not None and not h.member._stop.is_set():
                h.shutdown()
        self.client.close()


@pytest.fixture
def nodes_factory(etcd_server, run_id):
    saved = dict(os.environ)
    made: list[Nodes] = []

    def make(*, min_nodes: int = 2, max_nodes: int = 4, extra: tuple[str, ...] = (), nproc: int = 1) -> Nodes:
        n = Nodes(
            etcd_server.endpoint,
            run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            extra=[*TINY_PROFILE_OVERRIDES, *extra],
            nproc=nproc,
        )
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()
    os.environ.clear()
    os.environ.update(saved)


def joined(boxes: list[dict], timeout: float = 10.0) -> None:
    for box in boxes:
        box["thread"].join(timeout)
        assert "info" in box, box.get("error", "rendezvous did not return")


def test_first_nodes_are_admitted_before_the_plan_and_planned_from_the_workers_profile(nodes_factory, caplog) -> None:
    caplog.set_level(logging.INFO, logger="oobleck_elastic.rendezvous")
    c = nodes_factory(min_nodes=2, max_nodes=4)
    first = c.start(2)
    joined(first)  # admitted with no plan: their workers start and can measure the profile
    assert c.plan() is None and os.environ["OOBLECK_GENERATION"] == "0"
    assert all(b["handler"].num_nodes_waiting() == 0 for b in first)
    late = c.start(1)  # arrives while the first nodes wait for the profile: admitted too
    joined(late)
    time.sleep(0.5)
    assert c.plan() is None
    c.publish(synthetic_profile())
    plan = c.wait(c.plan)
    assert plan.generation == 1 and plan.nodes == ("node0", "node1", "node2")
    assert len(plan.pipelines) == 1 and len(plan.pipelines[0].stages) == 3  # n0 = 2 at 1.25 GiB: one 3-stage
    pinned = ModelProfile.from_json(c.client.get_json(c.keys.profile)[0])
    assert pinned.layers == synthetic_profile().layers
    waits = [e for _, e in read_events(c.client, c.keys) if e.kind == "waiting"]
    assert len(waits) == 1 and "measures the profile" in waits[0].detail
    lines = [
        r.getMessage()
        for r in caplog.records
        if "profile" in r.getMessage() and r.name.endswith((".leader", ".profile_wait"))
    ]
    assert len(lines) == 1, lines  # one line when the wait starts; the next only after ~10 s


def test_every_later_leader_plans_from_the_pinned_profile(nodes_factory) -> None:
    c = nodes_factory(min_nodes=3, max_nodes=3)
    joined(c.start(3))
    c.publish(synthetic_profile())  # n0 = 2 nodes
    c.wait(c.plan)
    c.publish(synthetic_profile(gib_per_layer=0.01, name="other"), device="cuda Other")  # n0 = 1, published later
    old = c.leader()
    old.leader.stop()
    old.member.close(revoke=False)  # crashed: its lease expires within the TTL
    old._stopping.set()  # and answers no pings
    old.view.close()
    plan = c.wait(lambda: (p := c.plan()) is not None and p.generation == 2 and p, timeout=15)
    assert len(plan.nodes) == 2 and [len(p.nodes) for p in plan.pipelines] == [2]  # planned with n0 = 2
    assert c.leader() is not old and c.leader().planner.pinned.layers[0].name == "l0"


def test_malformed_and_mismatching_profiles_are_logged_once_and_ignored(nodes_factory, caplog) -> None:
    caplog.set_level(logging.WARNING)
    c = nodes_factory(min_nodes=2, max_nodes=2)
    c.client.put(c.keys.device_profile("cpu Broken"), b"{not json")
    wrong = synthetic_profile()
    wrong.layers.pop()  # 5 layers: not gpt2-tiny's 6
    c.publish(wrong, device="cpu Wrong")
    shape = synthetic_profile()
    shape.key["seq_len"] = 32
    c.publish(shape, device="cpu Shape")
    joined(c.start(2))
    time.sleep(1.0)
    assert c.plan() is None
    for name, why in (
        ("cpu-broken", "not valid JSON"),
        ("cpu-wrong", "5 layers but model.num_layers=4 gives 6"),
        ("cpu-shape", "measured with seq_len=32 but the job has 64"),
    ):
        hits = [
            r
            for r in caplog.records
            if r.getMessage().startswith("ignoring profile in etcd key") and r.getMessage().split(":")[0].endswith(name)
        ]
        assert len(hits) == 1 and why in hits[0].getMessage(), [r.getMessage() for r in caplog.records]
    c.publish(synthetic_profile())
    assert c.wait(c.plan).generation == 1


def test_no_profile_within_the_rendezvous_timeout_fails_the_job_with_one_error(nodes_factory, caplog) -> None:
    caplog.set_level(logging.INFO)
    c = nodes_factory(min_nodes=2, max_nodes=2, extra=("fault_tolerance.rendezvous_timeout_s=1.5",))
    joined(c.start(2))
    closed = c.wait(lambda: c.client.get_json(c.keys.closed)[0], timeout=10)
    assert closed["failed"] is True
    assert closed["reason"].startswith(
        "no worker published a profile of its device within 2s (fault_tolerance.rendezvous_timeout_s)"
    )
    assert "set planning.profile_path" in closed["reason"] and c.plan() is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no worker published a profile" in errors[0].getMessage()
    w = worker(c.client, c.run_id, "node0")
    assert w.failure_of_job() == closed["reason"]  # what makes the workers exit with this error
    late = c.start(1)[0]
    late["thread"].join(10)
    # closed as failed: the late agent exits with the reason in one line, restarting nothing
    err = late.get("error")
    assert isinstance(err, RendezvousClosedError) and err.status == 1, err  # torch's type; failed, not a setting
    assert f"run {c.run_id} was closed as failed: no worker published a profile" in str(err)


def test_a_cpu_profile_without_device_memory_fails_the_job_naming_the_setting(nodes_factory) -> None:
    c = nodes_factory(min_nodes=2, max_nodes=2, extra=("planning.device_memory_gb=null",))
    joined(c.start(2))
    c.publish(synthetic_profile())  # measured on a CPU: no device memory recorded
    closed = c.wait(lambda: c.client.get_json(c.keys.closed)[0], timeout=10)
    assert closed["failed"] is True and c.plan() is None
    assert closed["reason"].startswith(
        "cannot plan this job with any number of nodes: planning.device_memory_gb is "
        "not set and the profile records no device memory"
    )


def test_with_a_profile_file_the_first_plan_needs_no_worker(nodes_factory, tmp_path) -> None:
    c = nodes_factory(min_nodes=2, max_nodes=2, extra=(f"planning.profile_path={tiny_profile(tmp_path / 'p.json')}",))
    joined(c.start(2))
    plan = c.plan()  # published before any handler returned, as before
    assert plan is not None and plan.generation == 1 and plan.nodes == ("node0", "node1")
    assert not [e for _, e in read_events(c.client, c.keys) if e.kind == "waiting"]
    assert not list(c.client.get_prefix_json(c.keys.profiles))


def test_tensor_parallel_auto_pins_the_profile_of_the_degree_it_chose(nodes_factory, tmp_path) -> None:
    """planning.tensor_parallel=auto with one profile file per degree: the leader plans every
    degree for the job's nodes, pins the best one's profile for every later leader, and the plan
    says its degree. Here tp=2 layers run 4x faster (and one 2-device stage per node still fits)."""
    tiny_profile(tmp_path / "p-tp1.json")
    fast = ModelProfile.load(tiny_profile(tmp_path / "p-tp2.json", tensor_parallel=2))
    fast.layers = [
        LayerProfile(**{**vars(layer), "forward_s": layer.forward_s / 4, "backward_s": layer.backward_s / 4})
        for layer in fast.layers
    ]
    fast.save(tmp_path / "p-tp2.json")
    c = nodes_factory(
        min_nodes=2,
        max_nodes=2,
        nproc=2,
        extra=("planning.tensor_parallel=auto", f"planning.profile_path={tmp_path / 'p-tp{tp}.json'}"),
    )
    joined(c.start(2))
    plan = c.plan()
    assert plan is not None and plan.tensor_parallel == 2 and plan.world_size == 4
    assert [(s.local_rank, s.rank) for p in plan.pipelines for s in p.stages] == [(0, 0), (0, 2)]
    pinned = ModelProfile.from_json(c.client.get_json(c.keys.profile)[0])
    assert pinned.tensor_parallel == 2 and pinned.layers[0].forward_s == fast.layers[0].forward_s
