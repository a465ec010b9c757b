"""Liveness sockets: the leader learns that a node's agent died the moment the node's kernel
closed the agent's sockets, with no collective failing first and no ping to wait for.

Only a refused connect is a death; a timeout gives no verdict (left to the roll call and the
lease), and an agent that said goodbye in etcd left (`rendezvous.detect`). The story:
docs/liveness.md.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

LIVENESS_LOST = "its agent's liveness socket closed and refused a new connection: the agent died"
"""The detail of a `lost` event whose node was found dead this way (`evidence` adds the time)."""


def evidence(closed_ago: Optional[float]) -> str:
    """A `lost` event's detail for a node found dead by its liveness socket, `closed_ago` seconds
    after its connection closed (its last sign of life); None: the monitor held no connection to
    it (the address answered the last leader), so it cannot tell."""
    if closed_ago is None:
        return f"{LIVENESS_LOST}; last sign of life not known here (it answered the last leader)"
    return f"{LIVENESS_LOST}; last sign of life {closed_ago:.1f}s earlier (its connection closed then)"


BYE = b"B"
"""What an agent that leaves cleanly writes to its watchers before closing (a dead one cannot)."""


def parse_address(address: str) -> Optional[tuple[str, int]]:
    """(host, port) of "host:port", or None when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


class LivenessServer:
    """An agent's listening socket: accepts connections and keeps them open until closed."""

    def __init__(self, host: str) -> None:
        self._sock = socket.create_server((host, 0), backlog=1024)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        """What peers connect to ("host:port")."""
        self._peers: list[socket.socket] = []
        self._closed = False
        self._goodbye = True
        self._lock = threading.Lock()  # a connection accepted while close() runs is closed like the others
        threading.Thread(target=self._accept, name="oobleck-liveness", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if not self._closed:
                    self._peers.append(conn)  # kept open: its closing is the signal
                    continue
            self._close_peers([conn], goodbye=self._goodbye)  # accepted as close() ran
            return

    def close(self, *, goodbye: bool = True) -> None:
        """A clean exit: every watcher is told (`BYE`) before the sockets close, so that leaving
        is not taken for dying. `goodbye=False` closes them as a killed process's kernel does."""
        with self._lock:
            self._closed, self._goodbye = True, goodbye
            peers, self._peers = self._peers, []
        self._close_peers(peers, goodbye=goodbye)
        self._close_peers(self._backlog(), goodbye=goodbye)
        try:  # wakes the accepting thread; a bare close() would leave the port listening under it
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass

    def _backlog(self) -> list[socket.socket]:
        """The connections the kernel completed that the accepting thread (slow on a loaded
        machine) has not taken yet: closing the listening socket would reset them, unwarned."""
        conns = []
        try:
            self._sock.setblocking(False)
            while True:
                conns.append(self._sock.accept()[0])
        except OSError:  # BlockingIOError: none left
            pass
        return conns

    @staticmethod
    def _close_peers(peers: list[socket.socket], *, goodbye: bool) -> None:
        for peer in peers:
            if goodbye:
                try:
                    peer.sendall(BYE)
                except OSError:
                    pass
            try:
                peer.close()
            except OSError:
                pass


IDLE_S = 1.0
"""The longest a monitor's thread sleeps with nothing to do."""


class LivenessMonitor:
    """Connections to other agents' `LivenessServer`s; reports the nodes found dead."""

    def __init__(
        self,
        *,
        on_dead: Optional[Callable[[str], None]] = None,
        connect_timeout_s: float = 0.25,
        retry_s: float = 1.0,
        name: str = "liveness",
    ) -> None:
        self.on_dead = on_dead
        self.connect_timeout_s, self.retry_s, self.name = connect_timeout_s, retry_s, name
        self._lock = threading.Lock()
        self._targets: dict[str, tuple[str, int]] = {}
        self._socks: dict[str, socket.socket] = {}
        self._next_try: dict[str, float] = {}
        self._dead: set[str] = set()
        self._reported: set[str] = set()
        self._reached: dict[str, tuple[str, int]] = {}  # only an address that answered before proves a death
        self._left: set[str] = set()  # agents that said goodbye
        self._closed_at: dict[str, float] = {}  # when a connection was last seen closed (monotonic)
        self._warned: set[str] = set()
        self._selector = selectors.DefaultSelector()
        # a new target, or close(), wakes the thread at once; otherwise it sleeps in select() until
        # a watched connection closes or a retry is due (at most IDLE_S): no polling while idle
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full buffer of unread wake-ups must not block watch()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._synced = threading.Condition()
        self._sync_asked = self._sync_done = 0  # `sync` calls made, and answered by a whole round
        self._thread = threading.Thread(target=self._run, name=f"oobleck-{name}", daemon=True)
        self._thread.start()

    def watch(self, targets: dict[str, str]) -> None:
        """Watch these nodes (node -> "host:port"); others are dropped. Cheap when unchanged."""
        parsed = {n: a for n, addr in targets.items() if (a := parse_address(addr)) is not None}
        with self._lock:
            if parsed == self._targets:
                return
            self._targets = parsed
            self._dead &= set(parsed)
            self._left &= set(parsed)
        self._wake()

    def vouch(self, addresses: dict[str, str]) -> None:
        """Take these (node -> "host:port") as having answered before: another monitor reached
        them (a new leader's, from the old leader's `liveness_answered` record)."""
        with self._lock:
            for node, address in addresses.items():
                parsed = parse_address(address)
                if parsed is not None:
                    self._reached.setdefault(node, parsed)

    def answered(self) -> set[str]:
        """The nodes whose current address accepted a connection of this monitor at least once
        (at those, and only those, a refused connection is a death)."""
        with self._lock:
            return {node for node, addr in self._reached.items() if self._targets.get(node) == addr}

    def closed_ago(self, node: str) -> Optional[float]:
        """Seconds since this monitor saw its connection to `node` close (the agent's last sign of
        life it knows of; a node id is never reused); None when it never saw one close."""
        with self._lock:
            at = self._closed_at.get(node)
        return time.monotonic() - at if at is not None else None

    def take_dead(self) -> set[str]:
        """Nodes found dead since the last call (each reported once)."""
        with self._lock:
            new = self._dead - self._reported
            self._reported |= new
            return new

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=2.0)
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except OSError:  # closed, or its buffer full of wake-ups not read yet: awake anyway
            pass

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._connect_missing()
            with self._synced:
                asked = self._sync_asked  # a sync asked before this poll is answered by this round
            pending = asked > self._sync_done
            for key, _ in self._selector.select(timeout=0.0 if pending else self._sleep_s()):
                if key.data is None:  # woken: read the wake-ups, then look at the targets again
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except OSError:
                        pass
                else:
                    self._closed(key.data)
            with self._synced:
                self._sync_done = asked
                self._synced.notify_all()

    def sync(self, timeout_s: float = 0.5) -> bool:
        """Return once every connection that had closed when called has had its verdict (the
        thread finished a round whose poll began after this call), or after `timeout_s`. An agent that
        acts on one death (a deputy on the leader's) sees who died with it. False: timed out."""
        if self._stop.is_set() or threading.current_thread() is self._thread:
            return False
        with self._synced:
            self._sync_asked += 1
            ticket = self._sync_asked
        self._wake()  # a poll that began before the ticket returns; the next one does not block
        with self._synced:
            return self._synced.wait_for(lambda: self._sync_done >= ticket and not self._stop.is_set(), timeout_s)

    def _sleep_s(self) -> float:
        """Until the next retry of a target not connected yet, at most IDLE_S (the targets that
        `_connect_missing` tries: not the dead nor those that left, whose old retry times are past)."""
        with self._lock:
            skip = self._dead | self._left
            waiting = [
                t for n, t in self._next_try.items() if n in self._targets and n not in self._socks and n not in skip
            ]
        return max(0.0, min([IDLE_S, *(t - time.monotonic() for t in waiting)]))

    def _connect_missing(self) -> None:
        with self._lock:
            targets = dict(self._targets)
            dead = self._dead | self._left
        for node in [n for n in self._socks if n not in targets]:
            self._drop(node)
        now = time.monotonic()
        for node, addr in targets.items():
            if node in self._socks or node in dead or now < self._next_try.get(node, 0.0):
                continue
            self._attempt(node, addr)

    def _attempt(self, node: str, addr: tuple[str, int]) -> None:
        """Connect to `node`: connected (watched), refused (dead), or no verdict (try later)."""
        try:
            sock = socket.create_connection(addr, timeout=self.connect_timeout_s)
        except ConnectionRefusedError:
            if self._reached.get(node) == addr:
                self._found_dead(node, addr)
            else:  # never reached there: a wrong address proves nothing about the agent
                self._next_try[node] = time.monotonic() + self.retry_s
                if node not in self._warned:
                    self._warned.add(node)
                    log.warning(
                        "%s: node %s refuses connections at its liveness address %s:%d (is --local-addr "
                        "set to an address the other nodes reach?); its death is detected by lease and "
                        "ping only",
                        self.name,
                        node,
                        *addr,
                    )
            return
        except OSError as err:
            self._next_try[node] = time.monotonic() + self.retry_s
            log.debug("%s: no connection to node %s at %s:%d (%s); trying again later", self.name, node, *addr, err)
            return
        sock.setblocking(False)
        self._reached[node] = addr
        self._socks[node] = sock
        self._selector.register(sock, selectors.EVENT_READ, node)

    def _closed(self, node: str) -> None:
        """The connection to `node` became readable: the agent never writes, so it closed."""
        sock = self._socks.get(node)
        if sock is None:
            return
        try:
            data = sock.recv(16)
        except BlockingIOError:
            return
        except OSError:
            data = b""  # reset: closed as well
        if BYE in data:  # the agent left cleanly (shut down, drained): no verdict, stop watching it
            self._drop(node)
            with self._lock:
                self._left.add(node)
            log.info("%s: node %s's agent left cleanly", self.name, node)
            return
        if data:
            return  # bytes nobody should send: ignore them
        self._drop(node)
        with self._lock:
            addr = self._targets.get(node)
            self._closed_at[node] = time.monotonic()
        if addr is not None:
            self._attempt(node, addr)  # closed is not dead yet: refused is

    def _drop(self, node: str) -> None:
        sock = self._socks.pop(node, None)
        if sock is not None:
            self._selector.unregister(sock)
            sock.close()

    def _found_dead(self, node: str, addr: tuple[str, int]) -> None:
        log.warning(
            "%s: node %s's agent is gone (its liveness socket %s:%d closed and refuses connections)",
            self.name,
            node,
            *addr,
        )
        with self._lock:
            self._dead.add(node)
        if self.on_dead is not None:
            self.on_dead(node)
