"""Which worker errors are communication failures, and when a repeated error stops the job.

A worker must never exit because of someone else's failure, and must never re-plan forever
because of its own bug. Errors therefore fall in two classes (`is_communication_error`):

- **communication**: a peer's broken connection or a collective that timed out (gloo raises a
  plain `RuntimeError` naming its transport), torch's `DistError` family (`DistBackendError`,
  `DistNetworkError`, `DistStoreError`: NCCL errors, an aborted group, a store that timed out),
  socket-level `ConnectionError`/`TimeoutError`, etcd out of reach (`EtcdError`), a generation
  superseded while it was being joined, and a step abandoned by the control plane
  (`StepAbandoned`). The worker tears its groups down, checks in at the leader's roll call and
  enters the next generation.
- **everything else**: out of memory, a bug in the model, a `CheckpointError`, a plan that
  cannot be loaded. The worker ends with the original traceback (its agent may restart it).

A deterministic error comes back after every restart and re-plan. Each worker that ends with
an error records it in etcd as an `ErrorRecord` (records/errors.py); `next_error_record` counts
how many times in a row the same error (`error_signature`: type and message with numbers
masked) ended a worker at the same step. When the count reaches
`fault_tolerance.max_repeated_errors`, the job is closed as failed with that error, every
worker leaves with `JobFailed`, and nothing is re-planned again.
"""

from __future__ import annotations

import re

import torch.distributed as dist

from ...etcd.settings import EtcdError
from ...logs import clip


# gloo reports a dead or silent peer as a RuntimeError raised by its TCP transport; these are the
# phrases of those messages (and of c10d's own socket and store errors)
_COMM_PATTERNS = re.compile(
    r"gloo/transport|third_party/gloo|Connection (closed|reset|refused)|Broken pipe|Timed out waiting|"
    r"timed out|Socket|connectFullMesh|ProcessGroup\w* .*(aborted|destroyed|shut ?down)|"
    r"NCCL (error|communicator)|ncclRemoteError|ncclSystemError|Collective .*timed out",
    re.IGNORECASE,
)


class StepAbandoned(RuntimeError):
    """The control plane abandoned the running step (a newer plan left a lost node out, this
    node was fenced, or the job was closed): the step's results must not be used."""


class JobFailed(RuntimeError):
    """The job was closed as failed (a worker's error repeated too often); every worker stops."""


def is_communication_error(err: BaseException) -> bool:
    """Whether `err` means a peer or the network failed (enter the next generation), rather than
    a fault of this worker (end it with its traceback)."""
    if isinstance(err, (StepAbandoned, dist.DistError, ConnectionError, TimeoutError, EtcdError)):
        return True
    if type(err) is RuntimeError:  # exactly: subclasses (CheckpointError, LayersLost, ...) are ours
        return bool(_COMM_PATTERNS.search(str(err)))
    return False


def describe(err: BaseException) -> str:
    """`err` for a log line: its type and the first line of its message (`clip`: 160 characters at
    most, cut at a word, without a leading C++ source location)."""
    first = clip(str(err).splitlines()[0]) if str(err) else ""
    return f"{type(err).__name__}: {first}"
