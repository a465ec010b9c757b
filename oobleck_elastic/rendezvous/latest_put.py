"""A worker's progress reports to etcd, off its training thread: only the latest value is put.

`LatestPut.put` hands a value to a daemon thread and returns at once, so a slow etcd never
delays a step; a value superseded before it was written is skipped, and `flush` waits for the
last one (when the worker's context closes).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from ..etcd import EtcdClient
from ..logs import JobLog

log = JobLog(logging.getLogger(__name__))


class LatestPut:
    """Puts the newest JSON value given to it from a daemon thread, so that the caller never
    waits for etcd; values superseded before they were written are skipped."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self._cond = threading.Condition()
        self._pending: Optional[tuple[str, Any]] = None
        self._busy = False
        threading.Thread(target=self._run, name="oobleck-progress", daemon=True).start()

    def put(self, key: str, value: Any) -> None:
        with self._cond:
            self._pending = (key, value)
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every value given was written (or failed); False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None)
                (key, value), self._pending, self._busy = self._pending, None, True  # type: ignore[misc]
            try:
                self.client.put_json(key, value)
            except Exception as err:  # noqa: BLE001 - progress is informative; a newer value follows
                log.warning("could not report progress to etcd: %s", err)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
