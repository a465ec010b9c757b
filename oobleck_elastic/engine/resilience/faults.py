"""Fault injection for tests and drills (`FaultInjector`, read from `OOBLECK_*_AT` variables in a
worker's environment): raise a deterministic error, be slow, poison a loss, flip a bit, straggle,
block the step thread, or enter a generation late.

Invariant: an injected fault exercises exactly one recovery path (the repeated-error cap, the
restart bound, the step guard, replica fingerprints, the straggler watch, the hang detector), and
never fires on a worker it was not aimed at. The variables' grammar is `FaultInjector`'s docstring;
docs/recovery.md and docs/liveness.md tell what each one drills.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

ENV = "OOBLECK_FAIL_AT"
COMM_FAIL_ENV = "OOBLECK_COMM_FAIL_AT"
SLOW_ENV = "OOBLECK_SLOW_AT"
NAN_ENV = "OOBLECK_NAN_AT"
SPIKE_ENV = "OOBLECK_SPIKE_AT"
FLIP_ENV = "OOBLECK_FLIP_AT"
STRAGGLE_ENV = "OOBLECK_STRAGGLE_AT"
SLOW_ENTRY_ENV = "OOBLECK_SLOW_ENTRY"
BLOCK_ENV = "OOBLECK_BLOCK_AT"
GROUP_ERROR_ENV = "OOBLECK_GROUP_ERROR_AT"
BLOCK_PLACES = ("loop", "comm")
FLIP_BIT = 26


def _refuse() -> Any:
    raise ValueError("malformed")


def _count(text: str) -> int:
    """A rank, step, layer or repeat count: digits only."""
    return int(text) if text.isdigit() else _refuse()


def _at_least(value: float, low: float) -> float:
    return value if value >= low else _refuse()


def _parse(
    environ: Mapping[str, str],
    env: str,
    form: str,
    *,
    who: Callable[[str], Any] = _count,
    value: Optional[Callable[[str], Any]] = None,
    times: bool = False,
    default: Any = None,
) -> dict[tuple[Any, int], Any]:
    """The one grammar of every drill: `WHO@STEP[:VALUE][xTIMES]` items, comma-separated, in
    `environ[env]` -> {(who, step): value} (`value` None: items carry no `:VALUE` and map to None;
    `default` not None: `:VALUE` may be left out and means `default`; `times`: items may end with
    `xTIMES`, TIMES >= 1, and map to (value, times)). `who` and `value` convert their part or raise
    ValueError; any item that does not parse is one error naming `form`."""
    spec = environ.get(env, "").strip()
    out = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        try:
            body, count = item, 1
            if times:
                body, _, repeat = item.partition("x")
                count = _count(repeat) if repeat else 1
                if count < 1:
                    _refuse()
            head, at, rest = body.partition("@")
            step, colon, tail = rest.partition(":")
            if not at or (colon and value is None) or (not colon and value is not None and default is None):
                _refuse()
            key = (who(head), _count(step))
            got = value(tail) if colon and value is not None else default
            out[key] = (got, count) if times else got
        except ValueError:
            raise ValueError(f"{env}={spec!r}: each item must be {form}") from None
    return out


def _positive(text: str) -> float:
    return float(text) if float(text) > 0 else _refuse()


def _seconds(text: str) -> float:
    return _at_least(float(text), 0)


def _place(text: str) -> str:
    return text if text in BLOCK_PLACES else _refuse()


def _blocked_step_thread() -> None:
    """Where an injected stuck step stands (OOBLECK_BLOCK_AT): for good, in a plain loop."""
    while True:
        time.sleep(0.05)


def _node(text: str) -> str:
    """A node id, or `*` where the drill allows it: anything not empty."""
    return text or _refuse()


@dataclass(frozen=True)
class FaultInjector:
    """The faults this worker's environment asks for (`from_env`):

    `OOBLECK_FAIL_AT="RANK@STEP[,RANK@STEP...]"` in a worker's environment makes the worker holding
    global rank RANK of its generation raise `RuntimeError("injected fault: ...")` when it starts
    step STEP (0-based), in every generation: the error is not a communication failure, so it ends
    the worker with its traceback, and because it comes back after every restart it exercises the
    repeated-error cap (`fault_tolerance.max_repeated_errors`). Like torchft's `fail_at(rank, step)`.
    `OOBLECK_COMM_FAIL_AT` (same grammar) raises `ConnectionError("injected communication failure:
    ...")` instead, a communication failure: the worker lives on and checks in at the roll call,
    every node answers, and the job restarts on the same nodes; coming back in every generation,
    it exercises the restart bound (`fault_tolerance.max_restarts_without_progress`).

    `OOBLECK_SLOW_AT="RANK@STEP:SECONDS[,...]"` makes that worker sleep SECONDS when it starts step
    STEP (before its stage computes anything), in every generation: a stage as slow as a large
    model's first step (allocator warm-up, kernel autotuning, compilation), so its neighbours wait
    for it in their receives. A slow step is not a failure and must not be treated as one.

    `OOBLECK_NAN_AT="RANK@STEP[xTIMES][,...]"` makes that worker's loss and gradients NaN at step STEP,
    the first TIMES times it runs it in this process (default 1: a transient fault that a replay does
    not meet again; 2 or more: a persistent one, whose batch is skipped). `OOBLECK_SPIKE_AT=
    "RANK@STEP:FACTOR[xTIMES][,...]"` multiplies the loss that worker reports by FACTOR instead (give
    the rank of a last stage: the others report no loss). Both exercise the step guard (engine/resilience/guard.py).

    `OOBLECK_FLIP_AT="RANK@STEP:LAYER[,...]"` flips one bit (bit 26, an exponent bit of a float32: the
    value is multiplied or divided by 256) of the first element of layer LAYER's largest parameter on
    that worker, right after step STEP is applied, once per process: silent corruption of one copy
    of the layer, which the replica fingerprints find and repair (engine/resilience/fingerprint.py).

    `OOBLECK_STRAGGLE_AT="NODE@STEP:FACTOR[,...]"` makes every worker of node NODE (its id, e.g.
    node1) compute FACTOR times slower from step STEP on, in every generation: each forward and
    backward chunk is followed by a sleep of (FACTOR - 1) times its duration, as on a slower device
    (a straggler, engine/resilience/straggler.py).

    `OOBLECK_BLOCK_AT="RANK@STEP[:WHERE][,...]"` blocks the step thread of the worker holding global
    rank RANK at step STEP, for good, while its main thread keeps running: a stuck step, which the
    worker's agent must find (rendezvous/hang.py). WHERE is `loop` (the default: a plain loop at the
    step's start, before any compute, as a deadlock or a stuck kernel would) or `comm` (inside the
    wait of the step's commit all-reduce, after this worker posted its part: a collective wait that
    never returns). It blocks once per job: not in a worker its agent restarted
    (`TORCHELASTIC_RESTART_COUNT` > 0), nor in one that saw a generation break (so the survivor that
    holds rank RANK when the step is replayed runs it).

    `OOBLECK_GROUP_ERROR_AT="RANK@STEP[xTIMES][,...]"` makes that worker's device groups report an
    error after step STEP's waits, the first TIMES times it runs it in this process (default 1), as
    NCCL's error state does after its watchdog aborted a timed-out communicator, and halves its
    gradients (a partial sum): every worker refuses the step and it is replayed in the next
    generation (engine/step/commit.py).

    `OOBLECK_SLOW_ENTRY="NODE@GENERATION:SECONDS[,...]"` makes every worker of node NODE (`*`: of every
    node) sleep SECONDS before it connects to generation GENERATION: a slow reconfiguration, so that a
    test can make a second failure land deterministically while the survivors are entering.
    """

    points: frozenset[tuple[int, int]]
    """(rank, step) pairs at which to raise."""
    comm_points: frozenset[tuple[int, int]] = frozenset()
    """(rank, step) pairs at which to raise a communication failure."""
    slow: dict[tuple[int, int], float] = field(default_factory=dict)
    """(rank, step) -> seconds to sleep at the start of that step."""
    poison: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)
    """(rank, step) -> (factor for the loss: NaN or a spike, how many runs of the step get it)."""
    runs: dict[tuple[int, int], int] = field(default_factory=dict)
    """(rank, step) -> runs so far of a poisoned step."""
    flips: dict[tuple[int, int], int] = field(default_factory=dict)
    """(rank, step) -> the layer one of whose bits to flip after that step (once; popped when done)."""
    straggle: dict[str, tuple[int, float]] = field(default_factory=dict)
    """node -> (first step, factor): that node's workers compute this many times slower."""
    slow_entry: dict[tuple[str, int], float] = field(default_factory=dict)
    """(node or `*`, generation) -> seconds to sleep before connecting to that generation."""
    blocks: dict[tuple[int, int], str] = field(default_factory=dict)
    """(rank, step) -> where that worker's step thread blocks for good (`loop` or `comm`)."""
    disarmed: set[str] = field(default_factory=set)
    """Drills this process no longer runs (`block`: it saw a generation break)."""
    group_errors: dict[tuple[int, int], tuple[None, int]] = field(default_factory=dict)
    """(rank, step) -> (None, how many runs of the step report an errored device group)."""
    group_error_runs: dict[tuple[int, int], int] = field(default_factory=dict)
    """(rank, step) -> runs so far of a step with an injected group error."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "FaultInjector":
        points = frozenset(_parse(environ, ENV, "RANK@STEP, e.g. 1@3"))
        comm_points = frozenset(_parse(environ, COMM_FAIL_ENV, "RANK@STEP, e.g. 1@0"))
        slow = _parse(environ, SLOW_ENV, "RANK@STEP:SECONDS, e.g. 0@0:5", value=_seconds)
        nan = _parse(environ, NAN_ENV, "RANK@STEP[xTIMES], e.g. 1@3x2", times=True)
        poison = {key: (float("nan"), count) for key, (_, count) in nan.items()}
        poison.update(
            _parse(environ, SPIKE_ENV, "RANK@STEP:FACTOR[xTIMES], e.g. 0@3:100x2", value=_positive, times=True)
        )
        flips = _parse(environ, FLIP_ENV, "RANK@STEP:LAYER, e.g. 1@3:2", value=_count)
        slowed = _parse(
            environ,
            STRAGGLE_ENV,
            "NODE@STEP:FACTOR with FACTOR >= 1, e.g. node1@0:3",
            who=_node,
            value=lambda v: _at_least(float(v), 1),
        )
        straggle = {node: (step, factor) for (node, step), factor in slowed.items()}
        slow_entry = _parse(
            environ,
            SLOW_ENTRY_ENV,
            "NODE@GENERATION:SECONDS (NODE * for every node), e.g. *@2:5",
            who=_node,
            value=_seconds,
        )
        blocks = _parse(
            environ, BLOCK_ENV, "RANK@STEP[:WHERE] with WHERE loop or comm, e.g. 1@3:comm", value=_place, default="loop"
        )
        group_errors = _parse(environ, GROUP_ERROR_ENV, "RANK@STEP[xTIMES], e.g. 1@3", times=True)
        if environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
            blocks = {}  # a restarted worker: the stuck step happened once already
        return cls(
            points,
            comm_points,
            slow,
            poison,
            flips=flips,
            straggle=straggle,
            slow_entry=slow_entry,
            blocks=blocks,
            group_errors=group_errors,
        )

    def block(self, *, rank: int, step: int, where: str) -> None:
        """Called by the step thread at step start (`loop`) and inside the commit's wait (`comm`):
        block it for good as the environment says (`FaultInjector`'s docstring)."""
        if self.blocks.get((rank, step)) == where and "block" not in self.disarmed:
            _blocked_step_thread()

    def disarm(self) -> None:
        """A generation broke in this process: blocks are not injected again (`FaultInjector`'s docstring)."""
        self.disarmed.add("block")

    def before_entry(self, *, node: str, generation: int) -> None:
        """Called by a worker before it connects to `generation`: sleep as the environment says."""
        seconds = self.slow_entry.get((node, generation), self.slow_entry.get(("*", generation), 0.0))
        if seconds:
            time.sleep(seconds)

    def slowdown(self, *, node: str, step: int) -> float:
        """How many times slower this node's workers compute at `step` (1: not slowed)."""
        first, factor = self.straggle.get(node, (0, 1.0))
        return factor if step >= first else 1.0

    def check(self, *, rank: int, step: int) -> None:
        """Called by a worker as it starts `step`: sleep and/or raise as the environment says."""
        if (rank, step) in self.slow:
            time.sleep(self.slow[(rank, step)])
        if (rank, step) in self.points:
            raise RuntimeError(f"injected fault: rank {rank} at step {step} ({ENV})")
        if (rank, step) in self.comm_points:
            raise ConnectionError(f"injected communication failure: rank {rank} at step {step} ({COMM_FAIL_ENV})")

    def group_error(self, *, rank: int, step: int, params: Sequence[torch.nn.Parameter] = ()) -> Optional[str]:
        """Called once per run of `step`, after its waits and before the commit vote: the injected
        error state of a device group (`GROUP_ERROR_ENV`), or None. With it the gradients of
        `params` are halved, as an aborted sum would leave them partial: applied, they would part
        from the reference."""
        if (rank, step) not in self.group_errors:
            return None
        _, times = self.group_errors[(rank, step)]
        runs = self.group_error_runs[(rank, step)] = self.group_error_runs.get((rank, step), 0) + 1
        if runs > times:
            return None
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 0.5)
        return f"injected: TIMEOUT ({GROUP_ERROR_ENV})"

    def flip_bit(self, *, rank: int, step: int, layers: Sequence[Optional[torch.nn.Module]]) -> None:
        """Called after `step` is applied: flip the bit the environment names, if any (`FaultInjector`'s docstring)."""
        layer_index = self.flips.pop((rank, step), None)
        layer = None if layer_index is None else layers[layer_index]
        if layer is None:
            return
        from ...models.tensor_parallel import local

        param = max(layer.parameters(), key=lambda p: p.numel())
        words = local(param).detach().view(-1).view(torch.int32)
        words[0] ^= 1 << FLIP_BIT

    def loss_factor(self, *, rank: int, step: int) -> float | None:
        """Called once per run of `step`: NaN or a spike factor to multiply this worker's loss by
        (NaN poisons its gradients too), or None."""
        if (rank, step) not in self.poison:
            return None
        factor, times = self.poison[(rank, step)]
        self.runs[(rank, step)] = self.runs.get((rank, step), 0) + 1
        return factor if self.runs[(rank, step)] <= times else None

    def poisoned(
        self, loss: torch.Tensor, *, rank: int, step: int, params: Sequence[torch.nn.Parameter]
    ) -> torch.Tensor:
        """Called once per run of `step`, after its backward: this worker's `loss` times the injected
        factor (`loss_factor`; a NaN multiplies the gradients of `params` too), or `loss` itself."""
        factor = self.loss_factor(rank=rank, step=step)
        if factor is None:
            return loss
        loss = loss * factor
        if factor != factor:  # NaN
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], factor)
        return loss
