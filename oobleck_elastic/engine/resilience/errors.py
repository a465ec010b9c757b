"""Which worker errors are communication failures (`is_communication_error`), and the errors that
stop a step or the job (`StepAbandoned`, `JobFailed`).

Invariant: a worker never exits because of someone else's failure (a communication failure sends
it to the next generation), and never re-plans forever because of its own bug: any other error
ends it with its traceback, and the same error (records/errors.py: type and message with numbers
masked) ending a worker at the same step `fault_tolerance.max_repeated_errors` times in a row
closes the job as failed. docs/recovery.md.
"""

from __future__ import annotations

import re

import torch.distributed as dist

from ...etcd.settings import EtcdError
from ...logs import clip


# gloo reports a dead or silent peer as a RuntimeError raised by its TCP transport; these are the
# phrases of those messages (and of c10d's own socket and store errors, and of the barrier torch's
# collective checker runs before each collective, which a dead peer never reaches)
_COMM_PATTERNS = re.compile(
    r"gloo/transport|third_party/gloo|Connection (closed|reset|refused)|Broken pipe|Timed out waiting|"
    r"timed out|Socket|connectFullMesh|ProcessGroup\w* .*(aborted|destroyed|shut ?down)|"
    r"NCCL (error|communicator)|ncclRemoteError|ncclSystemError|Collective .*timed out|"
    r"failed to pass monitoredBarrier",  # torch's collective checker (TORCH_DISTRIBUTED_DEBUG=DETAIL)
    re.IGNORECASE,
)


class StepAbandoned(RuntimeError):
    """The control plane abandoned the running step (a newer plan left a lost node out, this
    node was fenced, or the job was closed): the step's results must not be used."""


class GroupErrored(dist.DistError):
    """A device group reported an error after the step's waits had returned (NCCL's watchdog
    aborted a timed-out communicator and the process lived on): no worker applies the step, every
    worker leaves the generation, and the step is replayed (engine/step/commit.py)."""


class JobFailed(RuntimeError):
    """The job was closed as failed (a worker's error repeated too often); every worker stops."""


def is_communication_error(err: BaseException) -> bool:
    """Whether `err` means a peer or the network failed (enter the next generation), rather than
    a fault of this worker (end it with its traceback). Communication: a peer's broken connection
    or a timed-out collective (gloo raises a plain RuntimeError naming its transport), torch's
    `DistError` family (NCCL errors, an aborted group, a store timeout), socket-level
    ConnectionError/TimeoutError, etcd out of reach, a generation superseded while being joined,
    and `StepAbandoned`, also as the cause (`raise ... from`) of another error: torch's pipeline
    stage re-raises what failed in a backward (a gradient hook's collective) as "Failed to run stage
    backward". Everything else (out of memory, a model bug, a CheckpointError) is not."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (StepAbandoned, dist.DistError, ConnectionError, TimeoutError, EtcdError)):
            return True
        if type(cause) is RuntimeError and _COMM_PATTERNS.search(str(cause)):  # exactly: subclasses are ours
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


def describe(err: BaseException) -> str:
    """`err` for a log line: its type and the first line of its message (`clip`: 160 characters at
    most, cut at a word, without a leading C++ source location)."""
    first = clip(str(err).splitlines()[0]) if str(err) else ""
    return f"{type(err).__name__}: {first}"
