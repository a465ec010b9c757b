"""The agent's hang watch (rendezvous/hang.py) outliving its heartbeat directory: the agent removes
the directory at exit (atexit) while the watch's daemon thread may still run."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

from oobleck_elastic.config import FaultToleranceConfig
from oobleck_elastic.rendezvous.hang import HangWatch


def test_a_removed_heartbeat_directory_ends_the_watch_quietly(tmp_path: Path, monkeypatch) -> None:
    raised: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    directory = tmp_path / "hb"
    directory.mkdir()
    watch = HangWatch(directory, ft=FaultToleranceConfig(), node="node0", record=lambda *a: None, interval_s=0.02)
    watch.start()
    time.sleep(0.1)
    shutil.rmtree(directory)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(t.name == "oobleck-hang-watch" for t in threading.enumerate()):
        time.sleep(0.02)
    assert not any(t.name == "oobleck-hang-watch" for t in threading.enumerate())
    assert raised == []
