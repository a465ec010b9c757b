"""Cluster operations: `oobleck agents | kill-agent | stop | status | events | goodput | outcome` over
etcd, and `oobleck samples` over a job's events directory.

They read and write the run's keys (`records.keys`) and never talk to agents directly, so they
work from any machine that reaches etcd. `kill-agent` drains (marks the node `draining`), it never
kills. The story: docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, Optional

from .etcd import EtcdClient, EtcdError, EtcdSettings, connect
from .logs import read_event_lines
from .planning import Plan, PlanningError
from .planning.tolerance.shadows import describe as describe_shadows
from .records import samples as sample_ledger
from .records.control import NodeState
from .records.job import ClosedRecord, Event
from .records.goodput import Ledger, describe, job_origin
from .records.keys import Keys
from .records.read import read_closed, read_leader, read_progress, read_stop, read_stragglers
from .rendezvous.membership import live_nodes, mark_draining, read_events
from .rendezvous.stop import request_stop


class OpsError(RuntimeError):
    """A cluster operation that cannot be done; the message says why."""


def add_connection_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument(
        "--endpoint",
        default=env("OOBLECK_ETCD_ENDPOINT", "127.0.0.1:2379"),
        help="etcd host:port (default $OOBLECK_ETCD_ENDPOINT or 127.0.0.1:2379)",
    )
    p.add_argument("--run-id", default=env("OOBLECK_RUN_ID"), help="the job's --rdzv-id (default $OOBLECK_RUN_ID)")
    p.add_argument("--key-prefix", default=env("OOBLECK_KEY_PREFIX", "/oobleck"), help="etcd key prefix")
    for name in ("cacert", "cert", "key", "user", "password"):
        p.add_argument(f"--{name}", default=env(f"OOBLECK_ETCD_{name.upper()}"), help=f"etcd {name}")


def open_run(args: argparse.Namespace) -> tuple[EtcdClient, Keys]:
    if not args.run_id:
        raise OpsError("--run-id is required (the job's --rdzv-id)")
    settings = EtcdSettings(
        endpoint=args.endpoint,
        cacert=args.cacert,
        cert=args.cert,
        key=args.key,
        user=args.user,
        password=args.password,
        timeout_s=5.0,
    )
    client = connect(settings)
    keys = Keys(args.key_prefix, args.run_id)
    if not client.count(keys.root):
        client.close()
        raise OpsError(
            f"run '{args.run_id}' not found at {args.endpoint} (no keys under {keys.root}): "
            "check --run-id and --key-prefix"
        )
    return client, keys


def _ago(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def agents(client: EtcdClient, keys: Keys) -> list[str]:
    """One line per node: index, node id, host, state (up / draining / returned / lost), devices, since."""
    live = live_nodes(client, keys)
    lines = [f"{'index':>5}  {'node':<8} {'host':<20} {'state':<9} {'devices':>7}  since"]
    for r in live:
        lines.append(f"{r.index:>5}  {r.node_id:<8} {r.host:<20} {r.state:<9} {r.devices:>7}  {_ago(r.since)}")
    live_ids = {r.node_id for r in live}
    lost: dict[str, Event] = {}
    joined: dict[str, Event] = {}
    for _, ev in read_events(client, keys):
        if ev.kind == "join":
            joined[ev.node] = ev
        elif ev.kind in ("lost", "drain", "leave") and ev.node not in live_ids:
            lost[ev.node] = ev
    for node, ev in sorted(lost.items(), key=lambda kv: int(kv[0][4:]) if kv[0][4:].isdigit() else 0):
        host = joined[node].detail.split(",")[0].removeprefix("host ") if node in joined else "?"
        state = "lost" if ev.kind == "lost" else "left"
        index = node[4:] if node.startswith("node") else "?"
        lines.append(f"{index:>5}  {node:<8} {host:<20} {state:<9} {'-':>7}  {_ago(ev.time)}")
    return lines


def kill_agent(client: EtcdClient, keys: Keys, index: int) -> str:
    live = live_nodes(client, keys)
    match = [r for r in live if r.index == index]
    if not match:
        raise OpsError(
            f"no live node with index {index} in run '{keys.run_id}' "
            f"(live: {', '.join(str(r.index) for r in live) or 'none'})"
        )
    rec = match[0]
    if rec.state == NodeState.DRAINING:
        return f"node {rec.node_id} (index {index}) is already draining"
    if not mark_draining(client, keys, rec, "drain requested (oobleck kill-agent)"):
        raise OpsError(f"node {rec.node_id} changed while draining it; try again")
    return f"node {rec.node_id} (index {index}, host {rec.host}) is draining: it leaves at the next step boundary"


def stop_job(client: EtcdClient, keys: Keys, reason: str) -> str:
    """Ask the job to stop at its next step boundary (`StopRecord`): every worker finishes the step
    in flight, saves a checkpoint of it and exits 0; the job closes as stopped, not failed. Returns
    one line saying what was done (or that the job is already closed or asked)."""
    closed = read_closed(client, keys)
    if closed is not None:
        return f"run '{keys.run_id}' is already closed ({closed.reason})"
    if not request_stop(client, keys, reason):
        earlier = read_stop(client, keys)
        said = f" at {_ago(earlier.time)} ({earlier.reason})" if earlier is not None else ""
        return f"run '{keys.run_id}' was already asked to stop{said}: it stops at its next step boundary"
    return (
        f"run '{keys.run_id}' stops at its next step boundary: the step in flight is finished and saved as a "
        "checkpoint, then every node exits 0 (`oobleck outcome` says when it closed)"
    )


PLAN_BUDGETS = "the plan's budgets"
"""Where `oobleck status` says the shadows' host-memory budgets come from: the plan in etcd carries
them (`Plan.shadows`), not where the leader found them."""


def status(client: EtcdClient, keys: Keys) -> list[str]:
    """The run's leader, plan (pipelines, spares, shadow copies: `planning.tolerance.shadows` `describe`),
    current step and stragglers."""
    leader = read_leader(client, keys)
    data, _ = client.get_json(keys.plan)
    progress = read_progress(client, keys)
    closed = read_closed(client, keys)
    live = live_nodes(client, keys)
    lines = [
        f"run {keys.run_id}: {len(live)} live node(s), leader "
        f"{leader.node_id if leader is not None else 'none'}"
        + (f" (closed{' as failed' if closed.failed else ''}: {closed.reason})" if closed is not None else "")
    ]
    plan = None
    if data is not None:
        try:
            plan = Plan.from_json(data)
        except PlanningError as err:
            lines.append(f"plan: malformed ({err})")
    if plan is None:
        lines.append("generation 0: no plan yet (waiting for nodes)")
    else:
        lines.append(
            f"generation {plan.generation}: {len(plan.nodes)} node(s), {len(plan.pipelines)} pipeline(s), "
            f"{plan.world_size} worker(s), est. step {plan.est_step_time_s:.4g} s"
        )
        for p in plan.pipelines:
            lines.append(
                f"  pipeline {p.index}: {len(p.stages)} stage(s) on {','.join(p.nodes)}, {p.microbatches} microbatches"
            )
        if plan.spares:
            lines.append(f"  spares: {', '.join(plan.spares)}")
        lines += describe_shadows(plan, PLAN_BUDGETS)
        lines += [f"  warning: {w}" for w in plan.warnings]
    if progress is not None:
        lines.append(f"step {progress.step} (generation {progress.generation}, {time.time() - progress.time:.1f}s ago)")
    else:
        lines.append("step: no progress reported yet")
    slow = read_stragglers(client, keys)
    if slow is not None and slow.nodes:
        lines.append(
            f"stragglers (generation {slow.generation}, after step {slow.step}): "
            + ", ".join(f"{node} {factor:.1f}x slower" for node, factor in sorted(slow.nodes.items()))
        )
    if plan is not None and plan.rebalanced:
        lines.append("  (microbatches re-split among the pipelines at their measured speeds)")
    return lines


def events(
    client: EtcdClient,
    keys: Keys,
    *,
    follow: bool = False,
    out: Callable[[str], None] = print,
    poll_s: float = 0.5,
    until: Optional[Callable[[], bool]] = None,
) -> None:
    seen: set[str] = set()
    while True:
        for key, ev in read_events(client, keys):
            if key not in seen:
                seen.add(key)
                out(ev.line())
        if not follow or (until is not None and until()):
            return
        time.sleep(poll_s)


def goodput(client: EtcdClient, keys: Keys, *, now: Optional[float] = None) -> tuple[list[str], dict]:
    """The job's goodput ledger (`engine.telemetry.goodput`) against its wall time: from its first event to
    its `closed` record (or `now` while it runs). Returns the lines and the same as JSON."""
    data, _ = client.get_json(keys.progress)
    found = data.get("goodput") if isinstance(data, dict) else None
    if found is None:
        raise OpsError(
            f"run '{keys.run_id}' has no goodput ledger yet: it is reported with the progress of the first step"
        )
    try:
        ledger = Ledger.from_json(found)
    except ValueError as err:
        raise OpsError(f"run '{keys.run_id}': malformed goodput ledger in {keys.progress}: {err}") from None
    start, _ = job_origin((e.time, e.kind, e.generation) for _, e in read_events(client, keys))
    closed = read_closed(client, keys)
    start = ledger.start if start is None else start
    end = closed.time if closed is not None else (time.time() if now is None else now)
    state = "running" if closed is None else f"closed{' as failed' if closed.failed else ''}: {closed.reason}"
    lines = describe(ledger, start=start, end=end, closed=closed is not None)
    lines[0] = f"run {keys.run_id} ({state}): {lines[0]}"
    out = {
        "run_id": keys.run_id,
        "closed": closed is not None,
        "start": start,
        "end": end,
        "wall_s": end - start,
        "accounted_s": ledger.total,
        "fraction": ledger.fraction,
        "steps_done": ledger.done,
        "seconds": ledger.to_json()["seconds"],
    }
    return lines, out


def samples(events_dir: str, *, steps: Optional[int] = None) -> tuple[bool, list[str]]:
    """The sample ledger check over the `samples` lines of a job's events directory (whether it
    holds, and the report's lines)."""
    if not os.path.isdir(events_dir):
        raise OpsError(f"no events directory {events_dir}: pass the job's logging.events_dir")
    report = sample_ledger.check(read_event_lines(events_dir, [sample_ledger.EVENT]), steps=steps)
    return report.ok, sample_ledger.describe(report)


OUTCOME_OPEN = 3
OUTCOME_STOPPED = 4
"""`oobleck outcome`'s exit status for a run that is not closed (1 is a failed run, 2 an etcd error)."""


def outcome(closed: Optional[ClosedRecord], run_id: str) -> tuple[int, str]:
    """The exit status and line `oobleck outcome` gives for a run's `closed` record: 0 finished,
    1 closed as failed, OUTCOME_OPEN (3) not closed (it still runs, or every node stopped first),
    OUTCOME_STOPPED (4) asked to stop before its last step (the same command resumes it)."""
    if closed is None:
        return OUTCOME_OPEN, (
            f"run {run_id} is not closed: it still runs, or every node stopped before it finished "
            "(see oobleck status and oobleck events)"
        )
    if closed.failed:
        return 1, f"run {run_id} failed: {closed.reason}"
    if closed.stopped:
        return OUTCOME_STOPPED, f"run {run_id} stopped before its last step: {closed.reason}"
    return 0, f"run {run_id} finished: {closed.reason}"


def run_ops(args: argparse.Namespace) -> int:
    """Entry for the ops subcommands (`cli` wires the parsers)."""
    client, keys = open_run(args)
    try:
        if args.command == "agents":
            print("\n".join(agents(client, keys)))
        elif args.command == "kill-agent":
            print(kill_agent(client, keys, args.index))
        elif args.command == "stop":
            print(stop_job(client, keys, args.reason))
        elif args.command == "status":
            print("\n".join(status(client, keys)))
        elif args.command == "goodput":
            lines, data = goodput(client, keys)
            print(json.dumps(data, indent=1) if args.json else "\n".join(lines))
        elif args.command == "outcome":
            code, line = outcome(read_closed(client, keys), keys.run_id)
            print(line)
            return code
        elif args.command == "events":
            try:
                events(client, keys, follow=args.follow)
            except KeyboardInterrupt:
                pass
    finally:
        client.close()
    return 0


__all__ = [
    "EtcdError",
    "OpsError",
    "add_connection_args",
    "agents",
    "events",
    "goodput",
    "kill_agent",
    "open_run",
    "outcome",
    "run_ops",
    "samples",
    "status",
    "stop_job",
]
