"""The local launcher's decisions, most without starting a job: worker threads, its command line,
targets, the config check before any node, when a kill may happen, why nodes failed; and the
one-line errors of examples/train.py and of a job's agents, with no restart of a start-up error."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from helpers import ROOT, eventually
from launcher.checks import failure_reason, kill_verdict, ops_commands, preflight, script_config
from launcher.local import LocalCluster, Roles, parse_at, resolve, worker_threads
from launcher.options import build_parser
from oobleck_elastic.checkpoint import CheckpointError, nothing_to_do
from oobleck_elastic.config import ConfigError
from oobleck_elastic.data.errors import DataError
from oobleck_elastic.engine.resilience.errors import JobFailed
from oobleck_elastic.engine.startup import ends_the_job, exit_code, one_line
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.records.read import read_closed
from oobleck_elastic.records.keys import Keys


def test_workers_share_the_cores_unless_omp_num_threads_is_set() -> None:
    assert worker_threads(2, 4, {}) == (
        1,
        "each worker computes on 1 thread(s): 2 core(s) over up to 4 worker(s) (set OMP_NUM_THREADS to choose)",
    )
    assert worker_threads(16, 4, {})[0] == 4
    assert worker_threads(16, 5, {})[0] == 3
    assert worker_threads(2, 1, {})[0] == 2
    threads, line = worker_threads(2, 4, {"OMP_NUM_THREADS": "2"})
    assert threads is None and line == "each worker computes on OMP_NUM_THREADS=2 thread(s), as set (2 core(s))"


def test_every_node_the_job_may_run_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("launcher.local.cores_available", lambda: 8)
    args = build_parser().parse_args(["--nodes", "2", "--max-nodes", "4", "--nproc-per-node", "2"])
    cluster = LocalCluster(args, ["examples/train.py"])
    assert cluster.threads == 1 and cluster.node_env()["OMP_NUM_THREADS"] == "1"  # 8 cores over 4 x 2 workers
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cluster = LocalCluster(argparse.Namespace(**{**vars(args), "nproc_per_node": 1}), ["examples/train.py"])
    assert cluster.threads is None and cluster.node_env()["OMP_NUM_THREADS"] == "3"


@pytest.mark.core
def test_help_and_a_missing_script() -> None:
    run = [sys.executable, "-m", "launcher.local"]
    help_ = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "--kill NODE@STEP" in help_.stdout
    missing = subprocess.run([*run, "--nodes", "2"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr.strip().endswith(
        "error: give the training script after --, e.g. -- examples/train.py --config CFG"
    )
    bad = subprocess.run(
        [*run, "--nodes", "two", "--", "examples/train.py"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "argument --nodes: invalid int value: 'two'" in bad.stderr


def test_a_target_is_a_number_a_node_id_or_a_role() -> None:
    assert parse_at("2@5") == (2, 5) and parse_at("node3@0") == ("node3", 0) and parse_at("leader@4") == ("leader", 4)
    for bad in ("two@5", "2", "boss@1", "node@1", "1@x"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not NODE@STEP: NODE a launcher number"):
            parse_at(bad)
    roles = Roles(ids={0: "node1", 1: "node0", 2: "node2", 3: "node3"}, leader="node0", rank0="node0")
    live = [0, 1, 2, 3]
    assert resolve("leader", live, roles) == (1, "", False) and resolve("rank0", live, roles) == (1, "", False)
    assert resolve("follower", live, roles) == (0, "", False)
    assert resolve("node2", live, roles) == (2, "", False) and resolve(3, live, roles) == (3, "", False)
    assert resolve(3, [0, 1, 2], roles) == (None, "there is no running node 3", False)
    assert resolve("node3", [0, 1, 2], roles) == (None, "no running node is node3", False)
    assert resolve("follower", [1], roles) == (None, "every running node is the leader or rank 0", False)
    unknown = Roles(ids={0: "node0"})
    assert resolve("leader", live, unknown) == (None, "the leader is not known yet", True)
    assert resolve("follower", live, unknown) == (None, "the leader, rank 0 or a node's id is not known yet", True)
    # a node whose id is not known yet may be the one named: ask again, do not drop the kill
    assert resolve("node5", live, unknown) == (None, "no running node is node5 yet", True)
    partly = Roles(ids={0: "node1"}, leader="node0", rank0="node1")
    assert resolve("leader", [0, 1], partly) == (None, "no running node is node0 yet", True)
    assert resolve("follower", [0, 1], partly)[2] is True
    assert roles.describe(1) == "node0, the leader and rank 0" and roles.describe(2) == "node2"
    assert Roles(ids={0: "node1"}, leader="node1", rank0="node0").describe(0) == "node1, the leader"
    assert unknown.describe(3) == ""


# ----------------------------------------------------------------------------- checks before and after a job


def test_the_config_is_read_from_the_script_arguments_as_the_handler_reads_it() -> None:
    script = ["examples/train.py", "--config", "a.yaml", "training.steps=3", "--flag", "x=1"]
    assert script_config(script) == ("a.yaml", ["training.steps=3", "x=1"])
    assert script_config(["s.py", "--config=b.yaml"]) == ("b.yaml", [])
    assert script_config(["s.py", "--config", "a.yaml"], "lease_ttl=2,config=c.yaml") == ("c.yaml", [])
    assert script_config(["s.py", "--steps", "3"]) == (None, [])
    assert preflight(["examples/probe.py", "--steps", "3"]) is None  # nothing to check: the handler says


def test_a_kill_waits_for_a_training_node_and_says_why_it_never_came() -> None:
    roster = ("node0", "node1")
    ok = dict(at=8, step=8, closed=False, node_id="node1", roster=roster)
    assert kill_verdict(**ok) == (True, "")
    assert kill_verdict(**{**ok, "step": 20}) == (True, "")
    assert kill_verdict(**{**ok, "step": None}) == (False, "the job never reported step 8")
    assert kill_verdict(**{**ok, "step": 7}) == (False, "the job never reported step 8 (its last was 7)")
    assert kill_verdict(**{**ok, "closed": True}) == (False, "the job closed first")
    assert kill_verdict(**{**ok, "node_id": None}) == (False, "the node's id is not known yet")
    for roster_ in (None, ("node0",)):
        assert kill_verdict(**{**ok, "roster": roster_}) == (
            False,
            "node1 holds no stage in the current plan (it is not training)",
        )


def test_the_last_line_names_why_nodes_failed() -> None:
    lines = [
        "some log line\n",
        "train.py: error: DataError: data.paths entry 'x' does not exist: fix the path\n",
        "E1125 18:40:14 api.py:1002] failed (exitcode: 1) local_rank: 0\n",
    ]
    assert failure_reason("DataError: closed why", "RuntimeError: recorded", lines) == "DataError: closed why"
    assert failure_reason(None, "RuntimeError: recorded", lines) == "RuntimeError: recorded"
    assert failure_reason(None, None, lines) == "DataError: data.paths entry 'x' does not exist: fix the path"
    tb = ["Traceback (most recent call last):\n", '  File "x.py"\n', "ValueError: bad value\n"]
    assert failure_reason(None, None, tb) == "ValueError: bad value"
    assert failure_reason(None, None, ["hello\n"]) == ""
    assert ops_commands("127.0.0.1:5", "r1") == [
        "oobleck status --endpoint 127.0.0.1:5 --run-id r1",
        "oobleck goodput --endpoint 127.0.0.1:5 --run-id r1",
    ]
    assert ops_commands("h:1", "r", "/p")[0] == "oobleck status --endpoint h:1 --run-id r --key-prefix /p"


def test_known_errors_are_one_line_and_end_the_job_only_before_its_first_step() -> None:
    assert one_line(DataError("a\n  b")) == "DataError: a b" and exit_code(DataError("x")) == 2
    assert exit_code(JobFailed("closed")) == 1 and exit_code(RuntimeError("a bug")) == 1
    assert one_line(ConfigError("bad key")) == "ConfigError: bad key" and exit_code(ConfigError("x")) == 2
    assert ends_the_job(DataError("x"), steps_done=None) and ends_the_job(CheckpointError("x"), steps_done=0)
    assert not ends_the_job(DataError("x"), steps_done=3)  # a late node must not end a training job
    assert not ends_the_job(JobFailed("x"), steps_done=None)  # closed already
    assert not ends_the_job(RuntimeError("a bug"), steps_done=None)  # a bug keeps its traceback and restarts


def test_an_agent_ends_a_closed_job_with_one_line_and_a_status_by_cause() -> None:
    """What `next_rendezvous` raises on a closed job is torch's RendezvousClosedError (never a
    SystemExit through a host program); its line and status are what torchrun ends with."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from oobleck_elastic.records.job import ClosedRecord
    from oobleck_elastic.rendezvous.exits import closed_error

    known = closed_error("r1", ClosedRecord(time=0.0, reason="DataError: no such file", failed=True, known_error=True))
    assert isinstance(known, RendezvousClosedError) and not isinstance(known, SystemExit)
    assert (known.line, known.status) == (
        "torchrun --rdzv-backend=oobleck: run r1 was closed as failed: DataError: no such file",
        2,
    )
    assert str(known) == known.line
    waiting = closed_error("r1", ClosedRecord(time=0.0, reason="x", failed=True), node="node3")
    assert waiting.line.startswith("torchrun --rdzv-backend=oobleck: run r1 was closed as failed while node node3")
    assert waiting.status == 1  # failed later, not by a known error at the start
    finished = closed_error("r1", ClosedRecord(time=0.0, reason="finished 20 steps"), node="node4")
    assert finished.status == 0  # a spare or a late joiner: nothing failed
    assert finished.line == (
        "torchrun --rdzv-backend=oobleck: run r1 was closed while node node4 waited to be admitted "
        "(finished 20 steps); nothing for this node to do"
    )


def test_nothing_to_do_when_the_newest_checkpoint_is_at_the_last_step(tmp_path: Path) -> None:
    assert nothing_to_do(tmp_path / "none", 20) is None
    step = tmp_path / "step-00000020"
    step.mkdir()
    assert nothing_to_do(tmp_path, 20) is None  # no manifest: not a complete checkpoint
    (step / "manifest.json").write_text("{}")
    assert nothing_to_do(tmp_path, 20) is None  # a manifest that does not parse
    manifest = {"schema_version": 1, "step": 20, "layers": [], "layer_names": [], "hf_names": []}
    (step / "manifest.json").write_text(json.dumps({**manifest, "data_cursor": {}, "config": {}}))
    assert nothing_to_do(tmp_path, 20) == (
        f"nothing to do: checkpoint step-00000020 in {tmp_path} is already at training.steps=20; raise "
        "training.steps, point checkpoint.dir elsewhere or set checkpoint.resume=false"
    )
    assert nothing_to_do(tmp_path, 21) is None  # one step left


ONE_LINE_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ONE_LINE_ENV)


@pytest.mark.slow
def test_a_run_with_nothing_to_do_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    """A single-process run of 2 steps, then the same command again: the second has nothing to
    do; so has the launcher, before starting etcd or any node. A bad data path is one line too."""
    train_ = [sys.executable, "examples/train.py", "--config", "configs/gpt2-tiny.yaml"]
    args = ["training.steps=2", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}"]
    first = _run([*train_, *args])
    assert first.returncode == 0, first.stderr[-3000:]
    want = (
        f"nothing to do: checkpoint step-00000002 in {tmp_path / 'ckpt'} is already at training.steps=2; "
        "raise training.steps, point checkpoint.dir elsewhere or set checkpoint.resume=false"
    )
    again = _run([*train_, *args])
    assert again.returncode == 2 and again.stderr == f"train.py: error: ConfigError: {want}\n", again.stderr[-3000:]
    launched = _run([sys.executable, "-m", "launcher.local", "--nodes", "2", "--", *train_[1:], *args])
    assert (launched.returncode, launched.stdout) == (2, ""), launched.stdout[-3000:]
    assert launched.stderr == f"launcher.local: error: ConfigError: {want}\n"
    bad = _run([*train_, "data.tokenizer=hf", f"data.tokenizer_path={tmp_path / 'x.json'}"])
    assert bad.returncode == 2 and bad.stderr == (
        f"train.py: error: DataError: data.tokenizer_path '{tmp_path / 'x.json'}' does not exist: give the "
        "directory of a tokenizer saved with save_pretrained, or a tokenizers JSON file (Tokenizer.save)\n"
    )


@pytest.mark.core
def test_a_misspelt_key_stops_the_launcher_before_any_node() -> None:
    res = _run(
        [sys.executable, "-m", "launcher.local", "--nodes", "2", "--", "examples/train.py"]
        + ["--config", "configs/gpt2-tiny.yaml", "data.tokenizr=hf"],
        timeout=120,
    )
    assert (res.returncode, res.stdout) == (2, "")  # no etcd, no node: the launcher printed nothing else
    assert res.stderr == (
        "launcher.local: error: configs/gpt2-tiny.yaml: unknown key 'data.tokenizr': did you mean 'data.tokenizer'?\n"
    )


AGENT_ERRORS = {
    # the handler loads the config before it connects to etcd: a misspelt key is a setting to change (2)
    "config": (
        ["data.tokenizr=hf"],
        2,
        "torchrun --rdzv-backend=oobleck: error: configs/gpt2-tiny.yaml: unknown key 'data.tokenizr': "
        "did you mean 'data.tokenizer'?\n",
    ),
    # a config that loads, an endpoint where no etcd listens (1)
    "etcd": (
        [],
        1,
        "torchrun --rdzv-backend=oobleck: error: cannot reach etcd at 127.0.0.1:1: ConnectionFailedError: "
        "etcd connection failed\n",
    ),
}


@pytest.mark.core
@pytest.mark.parametrize("cause", sorted(AGENT_ERRORS))
def test_an_agent_that_cannot_start_exits_with_one_line(cause: str) -> None:
    """Under torchrun of one's own (no launcher): a handler that cannot be built ends the agent with
    one line and its status, not a traceback through torchrun."""
    overrides, status, line = AGENT_ERRORS[cause]
    res = _run(
        [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=oobleck", "--rdzv-endpoint=127.0.0.1:1"]
        + ["--rdzv-id=x", "--nnodes=1", "--nproc-per-node=1"]
        + ["examples/train.py", "--config", "configs/gpt2-tiny.yaml", *overrides],
        timeout=120,
    )
    assert (res.returncode, res.stdout, res.stderr) == (status, "", line)


def _gone(pid: int) -> bool:
    """The process exited (or is a zombie nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_a_deterministic_start_up_error_is_not_restarted_and_the_kept_etcd_tells_why(tmp_path: Path) -> None:
    """Two nodes whose workers fail building the dataset (a directory with no JSONL file passes the
    launcher's check, which reads no directory): each worker runs once, each agent exits 2 with one
    line instead of restarting it, the launcher's last line names the error, and --keep-etcd
    leaves etcd running with the job's closed record in it."""
    empty = tmp_path / "empty"
    empty.mkdir()
    run_id = f"launch-{uuid.uuid4().hex[:6]}"
    res = _run(
        [sys.executable, "-m", "launcher.local", "--nodes", "2", "--run-id", run_id, "--keep-etcd", "--kill", "1@3"]
        + ["--log-dir", str(tmp_path / "runs")]
        + ["--rdzv-conf", "lease_ttl=2,settle=0.2,last_call_timeout=1", "--", "examples/train.py"]
        + ["--config", "configs/gpt2-tiny.yaml", "data.source=jsonl", f"data.paths=[{empty}]"]
        + [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}"]
    )
    kept = re.search(r"kept the embedded etcd running \(--keep-etcd\): pid (\d+), endpoint (\S+), ", res.stdout)
    pid = int(kept.group(1)) if kept else None
    try:
        error = f"DataError: data.paths entry '{empty}' has no non-empty *.jsonl/*.json files for data.source=jsonl"
        out = res.stdout
        assert res.returncode == 2, out[-4000:]  # each agent exited 2: a known error, a setting to change
        # the terminal says what both nodes said once; each node's log has its own lines
        assert out.count(f"train.py: error: {error}\n") == 1, out[-4000:]
        assert out.count(f"torchrun --rdzv-backend=oobleck: run {run_id} was closed as failed: {error}\n") == 1
        for k in (0, 1):
            log = (tmp_path / "runs" / run_id / "nodes" / f"{k}.log").read_text()
            assert log.count(f"train.py: error: {error}\n") == 1, log  # one worker per node, started once
            assert log.count(f"torchrun --rdzv-backend=oobleck: run {run_id} was closed as failed: {error}\n") == 1
        assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
        assert (
            out.splitlines()[-1] == f"[launcher] done: 2 node(s), 0 killed on purpose, 0 preempted, 2 failed: {error}"
        )
        assert "[launcher] --kill 1@3 not done: the job never reported step 3; nothing was done to any node\n" in out
        assert "killed node" not in out
        assert pid is not None and kept is not None, out[-4000:]
        endpoint = kept.group(2)
        assert f"oobleck status --endpoint {endpoint} --run-id {run_id}; oobleck goodput" in out
        os.kill(pid, 0)  # still running after the launcher exited
        client = connect(EtcdSettings(endpoint=endpoint))
        try:
            closed = read_closed(client, Keys("/oobleck", run_id))
        finally:
            client.close()
        assert closed is not None and closed.failed and closed.known_error and closed.reason == error
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            scratch = re.search(rf"stop it with: kill {pid}; rm -r (\S+)\n", res.stdout)
            assert scratch is not None, res.stdout[-2000:]
            eventually(lambda: _gone(pid))
            shutil.rmtree(scratch.group(1))


@pytest.mark.slow
def test_a_spare_never_admitted_exits_0_with_one_line_when_the_job_finishes(tmp_path: Path, etcd_server) -> None:
    """Three nodes for a job of at most two: the third waits as a spare and the job finishes
    without it. Its agent exits 0 with one line (it used to print torch's RendezvousClosedError
    traceback and exit 1, so the launcher counted a failure where nothing failed)."""
    from helpers import run_job, tiny_profile

    run_id = uuid.uuid4().hex[:8]
    out, _, _ = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "3", "--min-nodes", "2", "--max-nodes", "2"],
        5,
        tiny_profile(tmp_path / "profile.json"),
        reference=False,
    )
    line = f"torchrun --rdzv-backend=oobleck: run {run_id} was closed while node node2 waited to be admitted"
    assert out.count(line) == 1 and "Traceback" not in out, out[-3000:]
    assert out.rstrip().endswith("done: 3 node(s), 0 killed on purpose, 0 preempted, 0 failed"), out[-3000:]
