"""What a worker checks before it builds anything (`check_start`: a resumed run resumes its own model and
has steps left, the data files exist), and how a known error ends a run in one line.

Known errors (`KNOWN_ERRORS`: a setting, a data file, a plan, a profile, a checkpoint, a job
already closed as failed) print as one line that says what to change (`one_line`); anything else
is a bug and keeps its traceback. Invariant: a known error before the job's first step would
recur on every node after every restart, so the worker closes the job as failed (`ends_the_job`)
and every agent stops instead of restarting; later, a node's known error goes through the
repeated-error rule (engine/resilience/errors.py). docs/recovery.md.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..checkpoint import CheckpointError, foreign_checkpoint, latest_checkpoint, nothing_to_do
from ..config import ConfigError, JobConfig
from ..data.dataset import check_data
from ..data.errors import DataError
from ..logs import JobLog
from ..models.identity import model_identity
from ..planning import PlanningError
from ..planning.profile.profile import ProfileError
from ..planning.schedules.choice import candidates
from ..planning.tolerance.shadows import SHADOWS_WITH_TP
from .control import ControlPlane
from .resilience.errors import JobFailed
from .torch_internals import TorchInternalsError, check_torch_internals

__all__ = ["KNOWN_ERRORS", "check_start", "end_job_at_start", "ends_the_job", "foreign_model", "exit_code", "one_line"]

KNOWN_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    DataError,
    PlanningError,
    ProfileError,
    CheckpointError,
    JobFailed,
    TorchInternalsError,
)
"""The package's own errors: their messages say what to change (one line, no traceback)."""

log = JobLog(logging.getLogger(__name__))


def one_line(err: BaseException) -> str:
    """`Type: message`, the message's lines joined: what a known error prints."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def exit_code(err: BaseException) -> int:
    """2 for a known error other than the job's own failure (a setting, data file, plan, profile or
    checkpoint to change: as argparse exits on a bad option), 1 for any other error. An agent
    whose job such an error closed exits 2 as well (rendezvous/exits.py)."""
    return 2 if isinstance(err, KNOWN_ERRORS) and not isinstance(err, JobFailed) else 1


def ends_the_job(err: BaseException, *, steps_done: Optional[int]) -> bool:
    """Whether `err`, ending a worker of a job that has completed `steps_done` steps (None: none
    reported yet), closes the job as failed at once: a known error before any step, other than
    the job's own failure (JobFailed: it is closed already)."""
    return isinstance(err, KNOWN_ERRORS) and not isinstance(err, JobFailed) and not steps_done


def check_start(cfg: JobConfig) -> None:
    """Raise the first problem found before anything is built: a torch without an internal the
    engine uses (TorchInternalsError), a checkpoint of another model to resume from
    (`foreign_model`), nothing left to train, shadow copies with tensor parallelism or a schedule
    the engine does not run asked for (ConfigError), a data file or tokenizer directory that does
    not exist (DataError)."""
    check_torch_internals()
    if cfg.fault_tolerance.shadow_copies > 0 and cfg.planning.tensor_parallel not in (1, "auto"):
        raise ConfigError(SHADOWS_WITH_TP.format(copies=cfg.fault_tolerance.shadow_copies))
    try:
        candidates(cfg.planning.schedule, cfg.planning.chunks_per_device, engine_only=True)
    except PlanningError as err:
        raise ConfigError(str(err)) from None
    if cfg.checkpoint.resume:
        why = foreign_model(cfg) or nothing_to_do(cfg.checkpoint.dir, cfg.training.steps)
        if why:
            raise ConfigError(why)
    check_data(cfg)


def foreign_model(cfg: JobConfig) -> Optional[str]:
    """Why the newest checkpoint in `checkpoint.dir` is no checkpoint of this job's model
    (`checkpoint.foreign_checkpoint`), or None. A model config that does not build (a missing
    config.json) is left for the build to name."""
    if latest_checkpoint(cfg.checkpoint.dir) is None:
        return None
    try:
        identity = model_identity(cfg.model)
    except (OSError, ValueError):
        return None
    return foreign_checkpoint(cfg.checkpoint.dir, identity)


def end_job_at_start(ctx: ControlPlane, err: BaseException) -> None:
    """Close the job as failed with `err`'s line when `ends_the_job` says so (the first such
    error's line stays the reason); never hides `err`, which the worker still ends with."""
    try:
        progress = ctx.progress()
        if not ends_the_job(err, steps_done=progress.step if progress is not None else None):
            return
        if ctx.failure_of_job() is None:
            ctx.close_job(one_line(err), failed=True, known_error=True)
    except Exception as etcd_err:  # noqa: BLE001 - the worker ends with `err` all the same
        log.at(node=ctx.node_id).error("could not close the job after %s: %s", one_line(err), one_line(etcd_err))
