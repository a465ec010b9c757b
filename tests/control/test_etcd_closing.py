"""etcd clients are closed explicitly, gRPC calls and threads included (etcd/closing.py): `close()`
ends every watch and keep-alive stream the client ever opened (the replaced ones too), leaves no
call in flight on its channels and is idempotent; a request after it fails with a line that says
so; and a client a process forgot to close is closed by the exit hook while every thread still
runs, so that nothing with a lock is left to the garbage collector of a finalizing interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from oobleck_elastic.etcd import EtcdError, EtcdSettings, connect
from oobleck_elastic.etcd.closing import open_clients

ROOT = Path(__file__).resolve().parents[2]


def _stream_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("pyetcd_watch_", "oobleck-keepalive")))


def test_close_ends_every_stream_and_call_and_is_idempotent(etcd_server) -> None:
    before = _stream_threads()
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    channels = [ep.channel for ep in client.raw.endpoints.values()]
    lease = client.grant_lease(5)
    assert client.refresh_lease(lease) > 0
    client._keepalive.reset()  # a second keep-alive stream: the first one's reader may still run
    assert client.refresh_lease(lease) > 0
    client.watch("/closing/a", lambda r: None, start_revision=1)
    client._new_watch_stream()  # the watch stream is replaced (as after a stuck watch or new token)
    client.watch("/closing/b", lambda r: None, start_revision=1)
    assert len(_stream_threads()) >= len(before) + 2
    assert client in open_clients()

    client.close()
    assert _stream_threads() == before
    assert [ch._call_state.managed_calls for ch in channels] == [0] * len(channels)
    assert client.closed and client not in open_clients()
    client.close()  # a second close does nothing
    with pytest.raises(EtcdError) as err:
        client.get("/closing/a")
    assert str(err.value) == (f"the etcd client of {etcd_server.endpoint} was closed (this process is shutting down)")


def test_a_client_left_open_is_closed_at_exit_while_the_threads_still_run(etcd_server) -> None:
    """The probe's own exit hook is registered first, so it runs last (atexit is last-in, first-out):
    after closing.py's. It finds no stream thread and no call in flight."""
    script = textwrap.dedent(
        f"""
        import atexit, threading

        def probe():
            names = sorted(t.name for t in threading.enumerate()
                           if t.name.startswith(("pyetcd_watch_", "oobleck-keepalive")))
            print("threads at exit:", names)
            print("calls in flight at exit:", [ch._call_state.managed_calls for ch in channels])

        atexit.register(probe)
        from oobleck_elastic.etcd import EtcdSettings, connect
        client = connect(EtcdSettings(endpoint={etcd_server.endpoint!r}))
        channels = [ep.channel for ep in client.raw.endpoints.values()]
        client.refresh_lease(client.grant_lease(5))
        client.watch("/closing/exit", lambda r: None, start_revision=1)
        print("open:", sorted(t.name.split("_")[0] for t in threading.enumerate() if t.name != "MainThread"
                              and t.name.startswith(("pyetcd_watch_", "oobleck-keepalive"))))
        """
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "open: ['oobleck-keepalive', 'pyetcd']" in res.stdout, res.stdout + res.stderr[-3000:]
    assert "threads at exit: []" in res.stdout, res.stdout
    assert "calls in flight at exit: [0]" in res.stdout, res.stdout
