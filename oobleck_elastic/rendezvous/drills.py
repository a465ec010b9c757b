"""Drills that freeze an agent the way a loaded machine does, for the tests of what the job does then.

`OOBLECK_AGENT_SPIN=<seconds>` in an agent's environment: SIGUSR2 makes its main thread spin in
pure Python for that long holding the GIL (a switch interval longer than the spin), so none of
its threads runs, as in an agent starved by a busy machine or stuck in a C call that holds the
GIL: no lease refresh, no pong, while its sockets stay open. The story: docs/liveness.md.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

SPIN_ENV = "OOBLECK_AGENT_SPIN"


def install_spin_drill() -> None:
    """Install the SIGUSR2 handler when `OOBLECK_AGENT_SPIN` is set (from the main thread only)."""
    seconds = float(os.environ.get(SPIN_ENV, "0") or 0)
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        return

    def spin(_signum: int, _frame: object) -> None:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(seconds + 1)
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass
        finally:
            sys.setswitchinterval(interval)

    signal.signal(signal.SIGUSR2, spin)
