"""`--rdzv-backend=oobleck` as a drop-in torchrun backend, through torch's public APIs.

- mode=restart (the default without a job config): agents started by `torch.distributed.run.main(args)`
  and by `elastic_launch`, in separate processes, give every worker of a round the same world: a
  plain gloo all-reduce of 1 sums to the world size over every node (with 1 + 2 workers, 3); a node
  that joins later restarts the others into a round of the new size (torchrun's semantics).
- mode=in_place (a job config in the rendezvous parameters): a plain script's `init_process_group`
  fails at once with one line that names the fix, instead of a world of one node; the devices per
  node come from the agent's WorkerSpec, not from the process's sys.argv.
- The in-place handler's shutdown(): False with etcd gone, the same again on a second call, the
  previous SIGTERM handler back and the notice thread gone; building either handler leaves
  TORCH_ELASTIC_WORKER_IDENTICAL as it was.
- The etcd backend's state is JSON, validated, and round-trips torch's state.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _NodeDesc,
    _RendezvousState,
)

from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.entry import create_handler
from oobleck_elastic.rendezvous.handler import NO_ENV_WORLD, OobleckRendezvousHandler
from oobleck_elastic.rendezvous.membership import live_nodes
from oobleck_elastic.rendezvous.options import launch_of
from oobleck_elastic.rendezvous.restart import EtcdRendezvousBackend, state_from_json, state_to_json

pytestmark = pytest.mark.core  # fast: make test runs it at every landing (tests/lanes.py)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/gpt2-tiny.yaml"

WORKER = """
import json, os, sys, time
import torch
import torch.distributed as dist

out = sys.argv[1]
tag = f"{os.environ['TORCHELASTIC_RESTART_COUNT']}-{os.environ['RANK']}-{os.getpid()}"
try:
    dist.init_process_group("gloo")
except Exception as err:
    with open(os.path.join(out, tag + ".error"), "w") as f:
        f.write(f"{type(err).__name__}: {err}")
    sys.exit(1)
t = torch.ones(1)
dist.all_reduce(t)
with open(os.path.join(out, tag + ".json"), "w") as f:
    json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
               "env_world": int(os.environ["WORLD_SIZE"])}, f)
wait_for = int(os.environ.get("DROPIN_WAIT_FOR_WORLD", "0"))
if dist.get_world_size() < wait_for:
    time.sleep(300)  # a round too small: torchrun restarts this worker when the next node joins
dist.destroy_process_group()
"""

AGENT = """
import json, sys
spec = json.loads(open(sys.argv[1]).read())
if spec["api"] == "main":
    from torch.distributed.run import main
    main(spec["args"])
else:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    config = LaunchConfig(**spec["config"])
    elastic_launch(config, sys.executable)(*spec["args"])
"""


def _agent(tmp_path: Path, name: str, spec: dict, env: dict) -> subprocess.Popen:
    script, spec_file = tmp_path / "agent.py", tmp_path / f"{name}.json"
    script.write_text(AGENT)
    spec_file.write_text(json.dumps(spec))
    log = open(tmp_path / f"{name}.log", "w")
    # sys.argv of the agent process is [agent.py, spec.json, --config, <missing>]: nothing torchrun-like
    return subprocess.Popen(
        [sys.executable, str(script), str(spec_file), "--config", "/nonexistent.yaml"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) | {"file": p.name} for p in sorted(out.glob("*.json"))]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TORCH_ELASTIC_WORKER_IDENTICAL", None)
    return env


def _main_spec(endpoint: str, run_id: str, nnodes: str, nproc: int, worker: Path, out: Path) -> dict:
    return {
        "api": "main",
        "args": [
            "--rdzv-backend=oobleck",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            "--rdzv-conf=last_call_timeout=1,join_timeout=120",
            "--monitor-interval=0.5",
            str(worker),
            str(out),
        ],
    }


def _launch_spec(endpoint: str, run_id: str, nnodes: tuple[int, int], nproc: int, worker: Path, out: Path) -> dict:
    return {
        "api": "launch",
        "config": {
            "min_nodes": nnodes[0],
            "max_nodes": nnodes[1],
            "nproc_per_node": nproc,
            "run_id": run_id,
            "rdzv_backend": "oobleck",
            "rdzv_endpoint": endpoint,
            "rdzv_configs": {"last_call_timeout": 1, "join_timeout": 120},
            "monitor_interval": 0.5,
            "max_restarts": 0,
        },
        "args": ["-u", str(worker), str(out)],
    }


def test_plain_all_reduce_sums_over_every_node(tmp_path: Path, etcd_server, run_id) -> None:
    """Two agents, one through torch.distributed.run.main(args) with 1 worker, one through
    elastic_launch with 2: every worker is in one world of 3 and the all-reduce of 1 gives 3."""
    worker, out = tmp_path / "worker.py", tmp_path / "out"
    worker.write_text(WORKER)
    out.mkdir()
    procs = [
        _agent(tmp_path, "a", _main_spec(etcd_server.endpoint, run_id, "2:2", 1, worker, out), _env()),
        _agent(tmp_path, "b", _launch_spec(etcd_server.endpoint, run_id, (2, 2), 2, worker, out), _env()),
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
        logs = "".join((tmp_path / f"{n}.log").read_text()[-3000:] for n in "ab")
        assert codes == [0, 0], logs
        results = _results(out)
        assert sorted(r["rank"] for r in results) == [0, 1, 2], logs
        assert {(r["world"], r["sum"], r["env_world"]) for r in results} == {(3, 3.0, 3)}
        assert "usage:" not in logs  # nobody parsed the agent process's own sys.argv
    finally:
        _stop(procs)


@pytest.mark.slow
def test_a_late_node_restarts_every_plain_worker_into_a_bigger_world(tmp_path: Path, etcd_server, run_id) -> None:
    """--nnodes=2:3: two agents start a round of 2; a third joins, num_nodes_waiting() becomes
    positive on the others, torchrun restarts their workers (a membership change, not counted
    against max_restarts), and the next round's all-reduce sums to 3 on every worker."""
    worker, out = tmp_path / "worker.py", tmp_path / "out"
    worker.write_text(WORKER)
    out.mkdir()
    env = dict(_env(), DROPIN_WAIT_FOR_WORLD="3")
    procs = [_agent(tmp_path, n, _main_spec(etcd_server.endpoint, run_id, "2:3", 1, worker, out), env) for n in "ab"]
    try:
        deadline = time.monotonic() + 180
        while len(_results(out)) < 2 and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        first = _results(out)
        assert {(r["world"], r["sum"]) for r in first} == {(2, 2.0)}, first
        procs.append(_agent(tmp_path, "c", _main_spec(etcd_server.endpoint, run_id, "2:3", 1, worker, out), env))
        codes = [p.wait(timeout=240) for p in procs]
        logs = "".join((tmp_path / f"{n}.log").read_text()[-3000:] for n in "abc")
        assert codes == [0, 0, 0], logs
        final = [r for r in _results(out) if r["world"] == 3]
        assert sorted(r["rank"] for r in final) == [0, 1, 2] and {r["sum"] for r in final} == {3.0}, logs
        # the first two nodes' workers were stopped and started again (new pids) by a membership change
        pid = lambda r: r["file"].rsplit("-", 1)[1]  # noqa: E731
        assert len(_results(out)) == 5 and not {pid(r) for r in first} & {pid(r) for r in final}
    finally:
        _stop(procs)


def _in_place_params(endpoint: str, run_id: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="oobleck",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
        config=str(CONFIG),
        lease_ttl="2",
        settle="0.1",
        last_call_timeout="0.3",
        **conf,
    )


def test_in_place_mode_refuses_the_env_world_and_takes_nproc_from_the_agent(
    tmp_path: Path, etcd_server, run_id, monkeypatch
) -> None:
    """elastic_launch with the job config in the rendezvous parameters (in place): each plain
    worker's init_process_group raises with NO_ENV_WORLD (no world of one node), the node record
    counts the launch's 2 devices (sys.argv names 7 and a missing config, and is not read), and the
    SIGTERM handler is torchrun's again after the launch."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    monkeypatch.setattr(sys, "argv", ["torchrun", "--nproc-per-node=7", "x.py", "--config", "/nonexistent.yaml"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TORCH_ELASTIC_WORKER_IDENTICAL", raising=False)
    saved = dict(os.environ)
    worker, out = tmp_path / "worker.py", tmp_path / "out"
    worker.write_text(WORKER)
    out.mkdir()
    before = signal.getsignal(signal.SIGTERM)
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    devices: list[int] = []

    def watch() -> None:  # the node record exists while the agent runs
        deadline = time.monotonic() + 120
        while not devices and time.monotonic() < deadline:
            devices.extend(r.devices for r in live_nodes(client, Keys("/oobleck", run_id)))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        run_id=run_id,
        rdzv_backend="oobleck",
        rdzv_endpoint=etcd_server.endpoint,
        rdzv_configs={"config": str(CONFIG), "lease_ttl": 2, "settle": 0.1, "last_call_timeout": 0.3},
        monitor_interval=0.5,
        max_restarts=0,
    )
    try:
        with pytest.raises(ChildFailedError):
            elastic_launch(config, sys.executable)("-u", str(worker), str(out))
        watcher.join(10)
        errors = sorted(p.read_text() for p in out.glob("*.error"))
        assert errors == [f"ValueError: invalid literal for int() with base 10: '{NO_ENV_WORLD}'"] * 2
        assert devices == [2]
        assert signal.getsignal(signal.SIGTERM) == before
        assert not [t for t in threading.enumerate() if t.name == "oobleck-preempt"]
    finally:
        client.close()
        os.environ.clear()
        os.environ.update(saved)


def test_building_a_handler_leaves_worker_identical_alone(etcd_server, run_id, monkeypatch) -> None:
    for value in (None, "0"):
        if value is None:
            monkeypatch.delenv("TORCH_ELASTIC_WORKER_IDENTICAL", raising=False)
        else:
            monkeypatch.setenv("TORCH_ELASTIC_WORKER_IDENTICAL", value)
        in_place = create_handler(_in_place_params(etcd_server.endpoint, run_id))
        restart = create_handler(
            RendezvousParameters(
                backend="oobleck", endpoint=etcd_server.endpoint, run_id=run_id + "r", min_nodes=1, max_nodes=1
            )
        )
        assert isinstance(in_place, OobleckRendezvousHandler) and isinstance(restart, DynamicRendezvousHandler)
        assert os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL") == value
        in_place.shutdown()


def test_the_launch_is_read_from_the_parameters_not_from_another_programs_argv(
    etcd_server, run_id, monkeypatch, capsys
) -> None:
    params = RendezvousParameters(
        backend="oobleck", endpoint=etcd_server.endpoint, run_id=run_id, min_nodes=1, max_nodes=2
    )
    for argv in (["pytest", "-q", "--weird"], ["torchrun", "--rdzv-id=other", "x.py", "--config", "/missing.yaml"]):
        monkeypatch.setattr(sys, "argv", argv)
        launch = launch_of(params)
        assert (launch.config, launch.nproc) == (None, None)
    assert capsys.readouterr().err == ""  # no usage line printed for arguments that are not torchrun's
    own = [
        "torchrun",
        "--rdzv-backend=oobleck",
        f"--rdzv-endpoint={etcd_server.endpoint}",
        f"--rdzv-id={run_id}",
        "--nproc-per-node=3",
        "train.py",
        "--config",
        "cfg.yaml",
        "training.steps=5",
    ]
    monkeypatch.setattr(sys, "argv", own)  # this rendezvous's own torchrun command line: read, as before
    launch = launch_of(params)
    assert (launch.config, launch.overrides, launch.nproc) == ("cfg.yaml", ["training.steps=5"], 3)
    with_conf = RendezvousParameters(
        backend="oobleck",
        endpoint=etcd_server.endpoint,
        run_id=run_id,
        min_nodes=1,
        max_nodes=2,
        config="job.yaml",
        nproc_per_node="2",
    )
    launch = launch_of(with_conf)
    assert (launch.config, launch.nproc) == ("job.yaml", 2)


def test_shutdown_without_etcd_returns_false_twice_and_gives_sigterm_back(own_etcd, run_id, caplog) -> None:
    saved = dict(os.environ)
    before = signal.getsignal(signal.SIGTERM)
    handler = OobleckRendezvousHandler(_in_place_params(own_etcd.endpoint, run_id, etcd_outage="5"))
    try:
        handler.next_rendezvous()  # admitted (the profile is still to be measured): registered, watching SIGTERM
        assert signal.getsignal(signal.SIGTERM) != before
        assert [t for t in threading.enumerate() if t.name == "oobleck-preempt"]
        own_etcd.stop()
        with caplog.at_level(logging.WARNING):
            assert handler.shutdown() is False
            assert handler.shutdown() is False  # idempotent: no error, the same answer, nothing done again
        said = [r.getMessage() for r in caplog.records if "shutdown: etcd did not answer" in r.getMessage()]
        assert len(said) == 1, said
        assert signal.getsignal(signal.SIGTERM) == before
        assert not [t for t in threading.enumerate() if t.name == "oobleck-preempt"]
        assert os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE") == saved.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    finally:
        signal.signal(signal.SIGTERM, before)
        os.environ.clear()
        os.environ.update(saved)


def test_shutdown_with_etcd_revokes_the_lease_and_returns_true(etcd_server, run_id) -> None:
    saved = dict(os.environ)
    handler = OobleckRendezvousHandler(_in_place_params(etcd_server.endpoint, run_id))
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        handler.next_rendezvous()
        keys = Keys("/oobleck", run_id)
        assert len(live_nodes(client, keys)) == 1
        assert handler.shutdown() is True and handler.shutdown() is True
        assert live_nodes(client, keys) == []
    finally:
        client.close()
        os.environ.clear()
        os.environ.update(saved)


def test_the_backend_state_is_validated_json_that_round_trips(etcd_settings, run_id) -> None:
    state = _RendezvousState()
    a, b = _NodeDesc("10.0.0.1", 11, 0), _NodeDesc("10.0.0.2", 12, 1)
    now = datetime.now(timezone.utc)
    state.round, state.complete, state.deadline = 3, True, now + timedelta(seconds=5)
    state.participants, state.wait_list, state.redundancy_list = {a: 0, b: 1}, {b}, set()
    state.last_heartbeats = {a: now, b: now}
    back = state_from_json(json.loads(json.dumps(state_to_json(state))), "k")
    assert vars(back) == vars(state)
    client = connect(etcd_settings)
    key = Keys("/oobleck", run_id).torchrun_state
    try:
        client.put(key, json.dumps({"schema_version": 1, "round": "x"}))
        with pytest.raises(RendezvousStateError, match=f"malformed rendezvous state at {key}"):
            EtcdRendezvousBackend(client, key).get_state()
        client.put(key, b"\x80pickle")
        with pytest.raises(RendezvousStateError, match=f"the rendezvous state at {key} is not JSON"):
            EtcdRendezvousBackend(client, key).get_state()
    finally:
        client.close()


def test_a_notice_with_nothing_to_drain_is_answered_as_torchrun_answers_it(monkeypatch) -> None:
    """applies() False: no drain, no grace: the same signal comes back as torchrun's
    SignalException in the main thread; uninstall() gives the previous handler back."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from oobleck_elastic.rendezvous.preempt import PreemptionWatch

    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    previous = signal.getsignal(signal.SIGUSR1)
    drained: list[str] = []
    watch = PreemptionWatch(
        [signal.SIGUSR1], grace_s=600, node="node3", drain=drained.append, alive=lambda: True, applies=lambda: False
    )
    try:
        watch.install()
        with pytest.raises(SignalException) as err:
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(600):
                time.sleep(0.1)
        assert err.value.sigval == signal.SIGUSR1 and drained == []
        watch.uninstall()
        watch.uninstall()
        assert signal.getsignal(signal.SIGUSR1) == previous
        assert os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    finally:
        signal.signal(signal.SIGUSR1, previous)


SLEEPER = """
import sys, time
open(sys.argv[1], "w").write("started")
time.sleep(600)
"""


def test_sigterm_stops_an_in_place_agent_whose_workers_do_not_use_the_worker_context(
    tmp_path: Path, etcd_server, run_id
) -> None:
    """A plain worker never reports ready: SIGTERM to its agent stops it as torchrun would (a
    SignalException), before fault_tolerance.preempt_grace_s (60) would have passed."""
    worker, started = tmp_path / "sleeper.py", tmp_path / "started"
    worker.write_text(SLEEPER)
    spec = _launch_spec(etcd_server.endpoint, run_id, (1, 1), 1, worker, started)
    spec["config"]["rdzv_configs"] = {"config": str(CONFIG), "lease_ttl": 2, "last_call_timeout": 0.3}
    spec["args"] = ["-u", str(worker), str(started)]
    proc = _agent(tmp_path, "a", spec, _env())
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), (tmp_path / "a.log").read_text()[-3000:]
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=45)  # a drain would wait out the 60 s grace
        log = (tmp_path / "a.log").read_text()
        assert rc != 0 and "SIGTERM: nothing to drain" in log and "SignalException" in log, log[-3000:]
    finally:
        _stop([proc])


def test_train_py_refuses_a_torchrun_world_it_was_not_started_in_place_for(tmp_path: Path) -> None:
    """examples/train.py in a world of 2 without the in-place backend (e.g. mode=restart) would
    train alone on every node: it exits 2 with one line instead."""
    env = dict(_env(), WORLD_SIZE="2", RANK="0")
    for name in ("OOBLECK_RUN_ID", "OOBLECK_ETCD_ENDPOINT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    res = subprocess.run(
        [sys.executable, "examples/train.py", "--config", str(CONFIG)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip() == (
        "train.py: error: started in a torchrun world of 2 processes, not by --rdzv-backend=oobleck in place: "
        "give torchrun --rdzv-backend=oobleck (and this --config), or run one process"
    )
