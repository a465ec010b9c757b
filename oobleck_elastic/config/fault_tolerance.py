"""The `fault_tolerance` section of the job config: what failures to survive and how they are found.

f and the shadow copies (what the plan must survive), the control plane's clocks (leases,
settling, the join, communication and hang bounds, the roll call), preemption notices, and the
step guard's, fingerprints' and stragglers' settings. The clocks left to None are derived from
the measured steps (`config.timing`). `parse_signals` reads `preempt_signals`, for the section's
`validate()` and for the agent that installs the handlers. The fields: docs/config.md.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .schema import ConfigError, Section, at_least


@dataclass
class FaultToleranceConfig(Section):
    f: int = 1
    """Simultaneous node failures to survive without a checkpoint (>= f+1 pipelines)."""
    strict: bool = False
    """Whether a first plan that gives less than the config asks (fewer than f+1 pipelines, fewer
    shadow copies, nodes left idle as spares) fails the job at its start, naming what it lacks,
    instead of training with a warning. A later plan after losses always trains with the warning."""
    shadow_copies: int = 0
    """Copies of every layer's weights and optimizer state kept in the host memory of that many
    nodes that do not hold the layer on their devices (0 = none): with f+1 device copies, any
    f + shadow_copies simultaneous node losses leave a copy of every layer. The planner places
    them within planning.host_memory_gb (planning/tolerance/shadows.py) on nodes running stages, and
    `oobleck plan` shows them. The holders send each step's summed gradients to the shadows, which
    apply the same AdamW update in host memory before the step commits, so a layer whose device
    copies are all lost comes back from a shadow with no step lost (engine/step/shadows.py).
    Not with tensor parallelism (planning.tensor_parallel must be 1)."""
    lease_ttl_s: float = 5.0
    """etcd lease TTL of a node's membership record."""
    settle_s: float = 0.5
    """Window in which simultaneous membership changes are batched into one re-plan."""
    comm_timeout_s: Optional[float] = None
    """Timeout of a step's communication (pipeline sends and receives, gradient sums, the commit)
    and of every collective once connected. A step may take this long, the first one of a
    generation included (allocator warm-up, kernel autotuning, compilation, a large stage): a
    slow peer is not a failure. Dead and hung peers are found by the control plane (liveness
    sockets, leases, the roll call, the hang watch), which abandons the step without waiting for
    this timeout; an abandoned gloo call keeps its thread, and the previous copy of its layers,
    until it. None (auto): 300 s until the worker has measured a step, then max(120 s, 3 x the
    hang bound), derived again at each generation's entry and, while a generation runs, as soon
    as its first step is measured and whenever the typical step changes 2x; every group of the
    running generation moves to it at once (config/timing.py). An explicit value is never
    changed."""
    join_timeout_s: float = 3.0
    """Timeout of connecting a generation's collective groups. A peer that dies during a
    reconfiguration, after publishing its address, holds the others in gloo's connection set-up
    for about 5x this long (gloo retries) before they move on; once connected, groups switch to
    comm_timeout_s. It never applies to a step: pipeline groups, whose gloo receives keep the
    timeout they connected with, connect under comm_timeout_s. Raise it when thousands of ranks
    connect slowly."""
    stall_report_s: Optional[float] = None
    """A worker waiting this long for its peers while joining a generation checks in at the
    leader's roll call, which pings the nodes not heard from and re-plans without the dead ones
    (a node killed during a reconfiguration); 0 disables it. None (auto): max(1 s, the worker's
    typical step) (config/timing.py)."""
    rendezvous_timeout_s: float = 600.0
    """How long the first rendezvous waits for the minimum number of nodes."""
    max_repeated_errors: int = 3
    """A worker error that is not a communication failure (a bug in the model, out of memory, a
    corrupt checkpoint) ends that worker with its traceback; when the same error ends a worker
    at the same step this many times in a row, the job is closed as failed with that error
    instead of being re-planned again."""
    max_restarts_without_progress: int = 5
    """How many restarts in a row the job may make on the same nodes without committing a step. A
    restart is a new generation on exactly the previous plan's nodes (its workers saw their
    generation break, and every node answered the roll call). When the generation after the last
    committed step or membership change and this many restarts after it have all broken before a
    step committed, the job is closed as failed, naming the error that ended each of them, instead
    of being re-planned forever (rendezvous/restart_loop.py). A node joining, lost or drained in
    between starts the count again. 0 = no bound."""
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals to a node's agent that are a preemption notice (Slurm, Kubernetes and spot reclaims
    send SIGTERM; add e.g. SIGUSR1 for Slurm's --signal=USR1@90): the node is drained, hands its
    layers over and exits 0 instead of failing (rendezvous/preempt.py)."""
    preempt_grace_s: float = 60.0
    """Seconds a node has, after its preemption notice, to hand its layers over and leave; a node
    still there then is stopped and handled as a failure."""
    hang_floor_s: Optional[float] = None
    """A worker whose step thread makes no progress (no compute chunk, no communication call
    entered or left, and not waiting for a peer in one) for longer than max(hang_floor_s,
    hang_factor x its typical step) while its node is alive is hung: its agent records its
    stacks, stops it and restarts it, and the job re-plans (rendezvous/hang.py). The floor covers
    a first step; 0 = off. None (auto): 120 s until the worker has measured a step, then 30 s
    (config/timing.py)."""
    hang_factor: float = 10.0
    """See hang_floor_s; the typical step is the median wall time of the worker's last steps."""
    max_skipped_steps: int = 3
    """A step whose loss or gradient norm is not finite (or whose loss spikes, see
    loss_spike_factor) is never applied: it is replayed once, then its batch is skipped. This many
    skipped steps in a row stop the job as failed, naming them (engine/resilience/guard.py)."""
    loss_spike_factor: float = 0.0
    """Treat a loss above this factor times the largest loss of any applied step like a non-finite
    one (replayed, then skipped); 0 = off. Megatron-LM uses 10."""
    fingerprint_interval_steps: int = 0
    """Every this many steps, the holders of each layer compare fingerprints of their copies
    (weights and optimizer state); a copy that differs from a majority is replaced in place, and
    copies with no majority stop the job naming the layer and its nodes (engine/resilience/fingerprint.py).
    0 = off."""
    straggler_factor: float = 1.5
    """A node whose workers compute this many times slower per microbatch than the generation's
    typical worker (against the plan's estimate of their stages), over straggler_steps steps, is
    named a straggler (event, TensorBoard, `oobleck status`; engine/resilience/straggler.py); 0 = off."""
    straggler_steps: int = 10
    """The window, in steps: a node is named when its fastest time in the window and the median of
    its step-by-step slowdowns both reach straggler_factor (a shared machine's noise reaches both
    only when it lasts the whole window); one step at full speed clears it."""
    straggler_rebalance: bool = True
    """The leader re-splits the microbatches among the pipelines at their measured speeds when a
    straggler is named and that shortens the estimated step by 10 % or more (the global batch,
    and so the weights, stay the same)."""
    watch_interval_s: float = 0.1
    """While a step runs, each worker checks the control plane this often: a newer plan that
    drops a lost node, this node being fenced, or the job being closed abandons the step at once
    (a hung peer is cut off by the control plane, not by a collective timing out)."""

    def validate(self) -> list[str]:
        problems = []
        if self.f < 0:
            problems.append(
                f"'fault_tolerance.f' must be >= 0 (got {self.f}): it is the number of simultaneous node failures "
                "to survive"
            )
        if self.shadow_copies < 0:
            problems.append(
                f"'fault_tolerance.shadow_copies' must be >= 0 (got {self.shadow_copies}): 0 keeps no copy "
                "in host memory"
            )
        try:
            parse_signals(self.preempt_signals)
        except ConfigError as err:
            problems.append(str(err))
        if self.preempt_grace_s <= 0:
            problems.append(f"'fault_tolerance.preempt_grace_s' must be > 0 (got {self.preempt_grace_s})")
        if (self.hang_floor_s is not None and self.hang_floor_s < 0) or self.hang_factor < 1:
            problems.append(
                "'fault_tolerance.hang_floor_s' must be >= 0 (0 = off) and 'fault_tolerance.hang_factor' >= 1 "
                f"(got {self.hang_floor_s} and {self.hang_factor})"
            )
        if self.fingerprint_interval_steps < 0:
            problems.append(
                "'fault_tolerance.fingerprint_interval_steps' must be >= 0 (0 = off; got "
                f"{self.fingerprint_interval_steps})"
            )
        if self.straggler_factor < 0 or 0 < self.straggler_factor <= 1 or self.straggler_steps < 1:
            problems.append(
                "'fault_tolerance.straggler_factor' must be 0 (off) or > 1 and "
                f"'fault_tolerance.straggler_steps' >= 1 (got {self.straggler_factor} and {self.straggler_steps})"
            )
        if self.loss_spike_factor < 0 or 0 < self.loss_spike_factor <= 1:
            problems.append(
                f"'fault_tolerance.loss_spike_factor' must be 0 (off) or > 1 (got {self.loss_spike_factor})"
            )
        if self.watch_interval_s <= 0:
            problems.append(f"'fault_tolerance.watch_interval_s' must be > 0 (got {self.watch_interval_s})")
        if self.join_timeout_s <= 0 or (self.comm_timeout_s is not None and self.comm_timeout_s <= 0):
            problems.append(
                "'fault_tolerance.join_timeout_s' and 'fault_tolerance.comm_timeout_s' must be > 0 (got "
                f"{self.join_timeout_s} and {self.comm_timeout_s})"
            )
        problems += at_least("fault_tolerance", self, ("max_skipped_steps", "max_repeated_errors"), 1)
        if self.max_restarts_without_progress < 0:
            problems.append(
                "'fault_tolerance.max_restarts_without_progress' must be >= 0 (0 = no bound; got "
                f"{self.max_restarts_without_progress})"
            )
        if self.stall_report_s is not None and self.stall_report_s < 0:
            problems.append(f"'fault_tolerance.stall_report_s' must be >= 0 (got {self.stall_report_s})")
        return problems


def parse_signals(names: Sequence[str]) -> list[signal.Signals]:
    """Signal names (`SIGTERM`, `USR1`, `SIGUSR1`) as signals; a ConfigError naming
    fault_tolerance.preempt_signals for an unknown name, or for SIGINT, SIGKILL or SIGSTOP."""
    out = []
    for name in names:
        full = str(name).strip().upper()
        full = full if full.startswith("SIG") else f"SIG{full}"
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
            raise ConfigError(
                f"'fault_tolerance.preempt_signals': '{name}' cannot be a preemption notice; give "
                "signal names such as SIGTERM or SIGUSR1 (not SIGINT, SIGKILL or SIGSTOP)"
            )
        out.append(sig)
    return out
