"""Preemption notices (rendezvous/preempt.py): a signal to a node's agent drains the node; it hands
its layers over and exits 0, and the launcher reports it as preempted. A notice to every holder
of some layers at once still needs no checkpoint (none exists during the run)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

import subprocess
import sys

from launcher.options import build_parser
from oobleck_elastic.config import ConfigError, load_config
from oobleck_elastic.rendezvous.preempt import NOTICE_ENV, SIGNALS_ENV, PreemptionWatch
from helpers import assert_same, at_step, run_job, tiny_profile

pytestmark = pytest.mark.core  # fast: make test runs it at every landing (tests/lanes.py)

ROOT = Path(__file__).resolve().parents[2]


def test_bad_signal_names_grace_and_launcher_specs_are_one_line_errors(capsys) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["fault_tolerance.preempt_signals=[SIGTERM,SIGKILL]"])
    assert str(err.value) == (
        "<defaults>: 'fault_tolerance.preempt_signals': 'SIGKILL' cannot be a preemption notice; "
        "give signal names such as SIGTERM or SIGUSR1 (not SIGINT, SIGKILL or SIGSTOP)"
    )
    with pytest.raises(ConfigError, match="'fault_tolerance.preempt_grace_s' must be > 0 \\(got -1.0\\)"):
        load_config(None, ["fault_tolerance.preempt_grace_s=-1"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--preempt", "1@3:-5"])
    assert "'1@3:-5' is not NODE@STEP[:GRACE] with GRACE > 0 seconds (e.g. 1@5:30)" in capsys.readouterr().err
    assert build_parser().parse_args(["--preempt", "1@3"]).preempt == [(1, 3, 60.0)]


def test_a_notice_drains_once_and_gives_up_after_the_grace(monkeypatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    previous = signal.getsignal(signal.SIGUSR1)
    drained, gave_up = [], threading.Event()
    watch = PreemptionWatch(
        [signal.SIGUSR1],
        grace_s=0.3,
        node="node7",
        drain=lambda d: drained.append(d) or True,
        alive=lambda: True,
        give_up=gave_up.set,
    )
    try:
        watch.install()
        assert os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second notice changes nothing
        assert gave_up.wait(5) and time.monotonic() - watch.noticed >= 0.3
        assert drained == [
            "preemption notice (SIGUSR1): hands its layers over and leaves within 0.3 s "
            "(fault_tolerance.preempt_grace_s)"
        ]
    finally:
        signal.signal(signal.SIGUSR1, previous)


WORKER = """
import sys, time
from oobleck_elastic.rendezvous.preempt import guard_worker
print([s.name for s in guard_worker()], flush=True)
for _ in range(400):
    time.sleep(0.05)
print("still running", flush=True)
"""


def test_a_worker_survives_a_notice_its_agent_recorded_and_dies_of_any_other(tmp_path: Path) -> None:
    """Slurm signals every process of a step: a worker must not die of the notice its agent drains
    the node for (rendezvous/preempt.py: guard_worker), yet torchrun's own SIGTERM must still stop it."""
    notice = tmp_path / "notice"
    env = {**os.environ, NOTICE_ENV: str(notice), SIGNALS_ENV: "SIGTERM,SIGUSR1"}

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "['SIGTERM', 'SIGUSR1']"
        return proc

    proc = start()  # no notice recorded: the signal is torchrun stopping its workers
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM and time.monotonic() - t0 < 5
    notice.write_text("SIGTERM")  # the agent recorded a notice: the worker goes on
    proc = start()
    try:
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.5)
        assert proc.poll() is None
        notice.unlink()  # the agent gave up: torchrun's SIGTERM stops the worker again
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.extended  # `make stress` (in CI) drains a node beside busy loops, against the reference
@pytest.mark.slow
def test_a_preempted_node_hands_over_and_exits_0(tmp_path: Path, etcd_server, run_id) -> None:
    """`--preempt 1@3`: node 1's agent gets SIGTERM at step 3; the node is drained, not lost."""
    profile = tiny_profile(tmp_path / "profile.json")
    out, job, ref = run_job(tmp_path, etcd_server, run_id, ["--nodes", "4", "--preempt", "1@3:60"], 8, profile)
    assert "preemption notice to node 1 (SIGTERM to its agent" in out, out[-4000:]
    assert "preemption notice (SIGTERM): draining" in out, out[-4000:]
    assert "[launcher] node 1 was preempted: it left the job and exited 0" in out
    assert "0 killed on purpose, 1 preempted, 0 failed" in out
    assert "communication failed" not in out and "step abandoned" not in out, out[-4000:]
    assert_same(job, ref)


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
@pytest.mark.slow
def test_a_wave_of_notices_to_every_holder_of_some_layers_needs_no_checkpoint(
    tmp_path: Path, etcd_server, run_id
) -> None:
    """Two 2-stage pipelines; both nodes running a second stage (the only holders of those layers)
    get SIGTERM at once. No checkpoint exists during the run (the only one is written at the end),
    so the job can only finish with the reference weights by receiving the layers from them."""
    from oobleck_elastic.planning import Plan
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.rendezvous.membership import live_nodes

    profile = tiny_profile(tmp_path / "profile.json")
    keys = Keys("/oobleck", run_id)
    noticed: list[str] = []

    def notify_the_second_stages(client) -> None:
        plan = Plan.from_json(client.get_json(keys.plan)[0])
        pids = {r.node_id: r.agent_pid for r in live_nodes(client, keys)}
        for node in (p.stages[-1].node for p in plan.pipelines):
            noticed.append(node)
            os.kill(pids[node], signal.SIGTERM)

    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4"],
        12,
        profile,
        during=at_step(etcd_server.endpoint, keys, 4, notify_the_second_stages),
    )
    assert len(noticed) == 2
    assert out.count("preemption notice (SIGTERM): draining") == 2, out[-4000:]
    assert "as a donor" in out and "no surviving copy" not in out and "communication failed" not in out, out[-4000:]
    assert_same(job, ref)
