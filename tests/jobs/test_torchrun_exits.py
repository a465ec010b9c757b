"""How an agent under plain torchrun ends, and what a program embedding torch's agent gets: a known
error at the start is one line and status 2 whatever `--max-restarts` is (no restart, no torch
banner); a closed job is torch's `RendezvousClosedError` to a host program, and one quiet line
with status 0 to the torchrun CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.records.job import ClosedRecord
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.read import read_closed

pytestmark = pytest.mark.core  # fast: make test runs it at every landing (tests/lanes.py)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _torchrun_args(endpoint: str, run_id: str, max_restarts: int, *overrides: str) -> list[str]:
    return [
        "--rdzv-backend=oobleck",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=lease_ttl=2,settle=0.1,last_call_timeout=0.3",
        "--nnodes=1",
        "--nproc-per-node=1",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        "examples/train.py",
        "--config",
        "configs/gpt2-tiny.yaml",
        *overrides,
    ]


@pytest.mark.parametrize("max_restarts", [0, 3])
def test_a_known_error_at_the_start_ends_plain_torchrun_with_one_line_and_status_2(
    tmp_path: Path, etcd_server, run_id, max_restarts: int
) -> None:
    missing = tmp_path / "no-such-data"
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run"]
        + _torchrun_args(
            etcd_server.endpoint,
            run_id,
            max_restarts,
            "data.source=jsonl",
            f"data.paths=[{missing}]",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"logging.tensorboard_dir={tmp_path / 'tb'}",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        closed = read_closed(client, Keys("/oobleck", run_id))
    finally:
        client.close()
    assert closed is not None and closed.failed and closed.known_error, closed
    assert closed.reason.startswith("DataError: ") and str(missing) in closed.reason, closed
    err = res.stderr
    assert res.returncode == 2, err[-4000:]
    assert err.count(f"train.py: error: {closed.reason}\n") == 1, err[-4000:]  # the worker ran once: no restart
    assert err.endswith(f"torchrun --rdzv-backend=oobleck: run {run_id} was closed as failed: {closed.reason}\n"), err[
        -4000:
    ]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-4000:]


EMBEDDED = """
import sys
import torch.distributed.run
from torch.distributed.elastic.rendezvous import RendezvousClosedError
try:
    torch.distributed.run.main(sys.argv[1:])
except RendezvousClosedError as err:
    print(f"caught {type(err).__name__}: {err}", flush=True)
    sys.exit(7)
print("not caught", flush=True)
"""


def test_a_closed_job_is_torchs_closed_error_to_a_host_program_and_a_quiet_exit_to_the_cli(
    tmp_path: Path, etcd_server, run_id
) -> None:
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        record = ClosedRecord(time=time.time(), reason="finished 20 steps")
        client.put_json(Keys("/oobleck", run_id).closed, record.to_json())
    finally:
        client.close()
    args = _torchrun_args(etcd_server.endpoint, run_id, 0, f"checkpoint.dir={tmp_path / 'ckpt'}")
    line = f"torchrun --rdzv-backend=oobleck: run {run_id} was closed (finished 20 steps); nothing for this node to do"
    host = tmp_path / "host.py"
    host.write_text(EMBEDDED)
    embedded = subprocess.run(
        [sys.executable, str(host), *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV
    )
    assert (embedded.returncode, embedded.stdout) == (7, f"caught JobClosed: {line}\n"), embedded.stderr[-3000:]
    cli = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert (cli.returncode, cli.stdout) == (0, ""), cli.stderr[-3000:]
    assert cli.stderr.endswith(f"{line}\n") and "Traceback" not in cli.stderr, cli.stderr[-3000:]
