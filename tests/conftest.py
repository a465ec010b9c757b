"""Shared fixtures: one etcd server per test session on a free loopback port.

- `etcd_server`: the running `EtcdServer`. It is stopped by PID at session end, including after failures.
- `etcd_settings`: `EtcdSettings` for that server (timeout 5 s).
- `own_etcd`: a server of the test's own (to stall, kill or restart), stopped by PID at the end.
- `run_id`: a unique id per test; put it in key prefixes so tests sharing the server don't collide.

Every worker the tests start checks NCCL's rules on gloo (`OOBLECK_NCCL_RULES=1`,
oobleck_elastic/engine/resilience/nccl_rules.py, docs/nccl.md); `OOBLECK_NCCL_RULES=0 pytest ...`
turns it off.

Also `--extended-shard i/K` (tests/lanes.py): the rotating shard of extended tests `make test` runs
(with it, a jobs test not marked `core` is extended too), balanced by tests/durations.json, which
`--store-durations` refreshes with the times of the tests run.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from lanes import extended_shard, load_durations, parse_shard, rotate, store_durations
from oobleck_elastic.etcd.settings import EtcdSettings
from oobleck_elastic.etcd.server import EtcdServer
from oobleck_elastic.engine.resilience.nccl_rules import RULES_ENV

os.environ.setdefault(RULES_ENV, "1")  # inherited by every job, node and rank a test starts


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    data_dir = tmp_path_factory.mktemp("etcd") / "data"
    # --unsafe-no-fsync: test data is throw-away; saves a disk flush per write.
    server = EtcdServer(data_dir=str(data_dir), extra_args=["--unsafe-no-fsync"])
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_settings(etcd_server: EtcdServer) -> EtcdSettings:
    return EtcdSettings(endpoint=etcd_server.endpoint)


@pytest.fixture
def run_id() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(data_dir=str(tmp_path / "own-etcd"), extra_args=["--unsafe-no-fsync"])
    server.start()
    try:
        yield server
    finally:
        if server.pid is not None:
            try:
                os.kill(server.pid, signal.SIGCONT)  # a test may have left it stopped
            except ProcessLookupError:
                pass
        server.stop()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended-shard",
        default=None,
        metavar="i/K",
        help="mark the i-th of K shards of the extended tests 'in_shard' (make test runs them: -m '... or in_shard')",
    )
    parser.addoption(
        "--store-durations",
        action="store_true",
        help="merge the durations of the tests run into tests/durations.json (the shards' balance)",
    )


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("--store-durations") and _measured:
        store_durations(_measured)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the marker must be there when it filters
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    text = config.getoption("--extended-shard")
    if not text:
        return
    shard = parse_shard(text)
    rotate(items, Path(__file__).resolve().parent)
    chosen = extended_shard(items, shard, load_durations())
    for item in chosen:
        item.add_marker(pytest.mark.in_shard)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"extended shard {text} ({len(chosen)} tests): " + ", ".join(it.nodeid for it in chosen))
