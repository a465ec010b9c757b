"""The local launcher's terminal view, node log files and run id (launcher/output.py, local.py)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from launcher.checks import job_name
from launcher.local import LocalCluster
from launcher.options import build_parser
from launcher.output import Terminal
from oobleck_elastic.engine.telemetry.board import run_name

pytestmark = pytest.mark.core  # fast: make test runs it at every landing (tests/lanes.py)

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = "2026-11-28 06:23:15,188 INFO gen 1 step {s}/20 node node0: loss 4.1, 0.9 s/step (0.9 s since the last)"


def test_the_terminal_leaves_out_per_node_details_and_shortens_times() -> None:
    t = Terminal(verbose=False)
    entered = "2026-11-28 06:23:14,858 INFO gen 1 step 0 node node3 rank 3: entered from generation 0 (0.288 s)"
    assert t.node_line(3, entered, 0.0) is None
    assert t.node_line(0, "2026-11-28 06:23:14,962 INFO gen 1 step 0 node n1 rank 2: memory on entering: x", 0) is None
    assert t.node_line(0, "2026-11-28 06:23:14,351 INFO profiling layer 3/10 block.1: fwd 1 ms", 0.0) is None
    summary = "2026-11-28 06:23:14,351 INFO profiling layers 3-9/10 block.1..block.7: identical to block.0, x"
    assert t.node_line(0, summary, 0.0) == "06:23:14 profiling layers 3-9/10 block.1..block.7: identical to block.0, x"
    warning = "2026-11-28 06:23:16,370 WARNING gen 1 step 8 node node3: communication failed (x)"
    assert t.node_line(3, warning, 0.0) == "06:23:16 WARNING gen 1 step 8 node node3: communication failed (x)"


def test_a_line_several_nodes_say_is_shown_once_but_progress_lines_always() -> None:
    t = Terminal(verbose=False)
    gone = "{n}: node node2's agent is gone (its liveness socket vm:42263 closed)"
    assert t.node_line(0, gone.format(n="node node1"), 0.0) is not None
    assert t.node_line(2, gone.format(n="leader node0"), 1.0) is None  # another node, the same words
    assert t.node_line(3, gone.format(n="node node3"), 40.0) is not None  # long after: news again
    # rank 0 moves to another node after a failure: its progress lines are not repeats
    assert t.node_line(0, PROGRESS.format(s=8), 2.0) is not None
    assert t.node_line(2, PROGRESS.format(s=9).replace("node0", "node2"), 3.0) is not None
    assert t.node_line(2, PROGRESS.format(s=10).replace("node0", "node2"), 4.0) is not None


def test_verbose_shows_every_line_as_printed() -> None:
    t = Terminal(verbose=True)
    entered = "2026-11-28 06:23:14,858 INFO gen 1 step 0 node node3 rank 3: entered from generation 0"
    assert t.node_line(3, entered, 0.0) == entered


def test_the_run_id_and_tensorboard_run_carry_the_job_name() -> None:
    script = ["examples/train.py", "--config", "configs/gpt2-demo.yaml"]
    assert job_name(script) == "gpt2-demo"
    assert job_name([*script, "name=my job/1"]) == "my-job-1"  # a name fit for a directory
    assert job_name(["examples/train.py"]) is None
    cluster = LocalCluster(build_parser().parse_args([]), script)
    assert cluster.run_id.startswith("gpt2-demo-") and len(cluster.run_id) == len("gpt2-demo-") + 6
    assert run_name(cluster.run_id, now=0).startswith(f"{cluster.run_id}/")
    given = LocalCluster(build_parser().parse_args(["--run-id", "exp7", "--log-dir", "out"]), script)
    assert given.run_id == "exp7" and given.folder == Path("out/exp7")


@pytest.mark.parametrize("verbose", [False, True])
def test_each_node_s_output_is_kept_in_its_log_file(
    etcd_server, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verbose: bool
) -> None:
    """Nodes that print and exit (no torchrun): each one's lines land in nodes/K.log whole, the
    terminal leaves out the details, and the last lines name the run's folder."""
    args = ["--nodes", "2", "--endpoint", etcd_server.endpoint, "--run-id", run_id, "--log-dir", str(tmp_path)]
    out = io.StringIO()
    cluster = LocalCluster(build_parser().parse_args(args + (["-v"] if verbose else [])), ["x.py"], out=out)
    said = (
        "import os; print('2026-11-28 06:23:14,858 INFO gen 1 step 0 node n rank 0: entered from generation 0'); "
        "print('2026-11-28 06:23:15,188 INFO gen 1 step 1/2 node n: loss 5.0, pid', os.getpid())"
    )
    monkeypatch.setattr(cluster, "torchrun_command", lambda: [sys.executable, "-c", said])
    assert cluster.run() == 0
    folder = tmp_path / run_id
    for n in cluster.nodes:
        log = (folder / "nodes" / f"{n.number}.log").read_text()
        assert "entered from generation 0" in log and f"loss 5.0, pid {n.proc.pid}\n" in log
    text = out.getvalue()
    assert ("entered from generation" in text) == verbose
    assert f"[node 0] 06:23:15 gen 1 step 1/2 node n: loss 5.0, pid {cluster.nodes[0].proc.pid}" in text or verbose
    last = text.splitlines()[-2:]
    assert f"{folder / 'nodes'}/K.log" in last[0] and last[1].startswith("[launcher] done: 2 node(s)")
    assert "[launcher] done: 2 node(s)" in (folder / "launcher.log").read_text()
