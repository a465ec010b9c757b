"""A local multi-node simulation: one `torchrun --rdzv-backend=oobleck` per simulated node.

    python -m launcher.local --nodes 4 [--nproc-per-node 1] [--min-nodes N] [--endpoint E]

Every option is in `--help`. The story: docs/running.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

from oobleck_elastic.etcd import EtcdError, connect
from oobleck_elastic.etcd.server import EtcdServer
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.control import NodeRecord
from oobleck_elastic.records.job import ClosedRecord
from oobleck_elastic.records.read import read_closed, read_leader, read_progress, read_roster
from oobleck_elastic.records.errors import ErrorRecord
from oobleck_elastic.records.plans import PlanReader

from .faults import kill_node
from .checks import (
    cores_available,
    etcd_view,
    failure_reason,
    job_name,
    kill_verdict,
    plan_is_full,
    ops_commands,
    preflight,
    stop_settings,
    worker_threads,
)
from .options import build_parser
from .output import Terminal
from .stopping import Interrupt
from .targets import ROLES, Roles, parse_at, resolve

__all__ = ["LocalCluster", "ROLES", "Roles", "main", "parse_at", "resolve", "worker_threads"]


@dataclass
class Node:
    number: int
    proc: subprocess.Popen
    killed: bool = False
    preempted_at: Optional[float] = None
    """Monotonic time its agent got the preemption notice (--preempt)."""
    grace: float = 0.0
    lines: list[str] = field(default_factory=list)
    log: Optional[IO[str]] = None
    """Its log file (nodes/K.log in the run's folder): every line it printed."""
    reader: Optional[threading.Thread] = None
    """The thread that copies its output to the log file and the terminal."""


class LocalCluster:
    def __init__(self, args: argparse.Namespace, script: list[str], *, out: IO[str] = sys.stdout) -> None:
        self.args, self.script, self.out = args, script, out
        self.run_id = args.run_id or f"{job_name(script, args.rdzv_conf) or 'local'}-{uuid.uuid4().hex[:6]}"
        self.folder = Path(args.log_dir) / self.run_id
        """The run's folder: nodes/K.log, launcher.log (module docstring)."""
        self.terminal = Terminal(args.verbose)
        self._log: Optional[IO[str]] = None
        self._t0 = time.monotonic()
        self.threads, self.threads_line = worker_threads(
            cores_available(), (args.max_nodes or args.nodes) * args.nproc_per_node, os.environ
        )
        self.etcd: Optional[EtcdServer] = None
        self.roles = Roles(ids={})
        """Node ids, the leader and rank 0, as far as etcd has told them (`_learn`)."""
        self.endpoint = args.endpoint
        self.nodes: list[Node] = []
        self._lock = threading.RLock()  # a signal's handler says a line in the main thread (`Interrupt`)
        self.done_line = "done: no node ran"
        grace, ckpt_dir = stop_settings(script, args.rdzv_conf)
        self.interrupt = Interrupt(grace_s=grace, checkpoint_dir=ckpt_dir, say=self.say)
        """A Ctrl-C or SIGTERM stops the job at a step boundary (launcher/stopping.py)."""
        self._last_seen: tuple[Optional[int], Optional[tuple[str, ...]]] = (None, None)
        """The job's last reported step and the current plan's nodes, as the kills last saw them."""

    def say(self, text: str, *, detail: bool = False) -> None:
        """A launcher line: on the terminal unless it is a `detail` (then only with -v), always in
        launcher.log."""
        with self._lock:
            if not detail or self.args.verbose:
                print(f"[launcher] {text}", file=self.out, flush=True)
            if self._log is not None:
                self._log.write(f"[launcher] {text}\n")
                self._log.flush()

    def open_folder(self) -> None:
        """Create the run's folder and open launcher.log."""
        (self.folder / "nodes").mkdir(parents=True, exist_ok=True)
        self._log = open(self.folder / "launcher.log", "a", encoding="utf-8")

    def torchrun_command(self) -> list[str]:
        a = self.args
        conf = f"--rdzv-conf={a.rdzv_conf}" if a.rdzv_conf else None
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={a.min_nodes or a.nodes}:{a.max_nodes}",
            f"--nproc-per-node={a.nproc_per_node}",
            "--rdzv-backend=oobleck",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            "--monitor-interval=0.1",
            f"--max-restarts={a.max_restarts}",
        ]
        return cmd + ([conf] if conf else []) + self.script

    def node_env(self, number: int = 0) -> dict[str, str]:
        """Node `number`'s environment: this process's, unbuffered, with the workers' threads
        pinned, and its device class and paced speed when --device-classes and --paced-speeds
        give them."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        for flag, var in (("device_classes", "OOBLECK_DEVICE_CLASS"), ("paced_speeds", "OOBLECK_PACED_SPEED")):
            values = [c for c in getattr(self.args, flag, "").split(",") if c]
            if values:
                env[var] = values[min(number, len(values) - 1)]
        return env

    def start_node(self) -> Node:
        number = len(self.nodes)
        env = self.node_env(number)
        proc = subprocess.Popen(
            self.torchrun_command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        log = open(self.folder / "nodes" / f"{number}.log", "a", encoding="utf-8") if self._log else None
        node = Node(number, proc, log=log)
        self.nodes.append(node)
        node.reader = threading.Thread(target=self._stream, args=(node,), daemon=True)
        node.reader.start()
        self.say(f"started node {number} (torchrun pid {proc.pid})", detail=True)
        return node

    def _stream(self, node: Node) -> None:
        assert node.proc.stdout is not None
        for line in node.proc.stdout:
            node.lines.append(line)
            if node.log is not None:
                node.log.write(line)
                node.log.flush()
            node_id = self.roles.ids.get(node.number)
            with self._lock:
                shown = self.terminal.node_line(node.number, line.rstrip("\n"), time.monotonic())
                if shown is not None:
                    self.out.write(f"[node {node.number}{'/' + node_id if node_id else ''}] {shown}\n")
                    self.out.flush()
        if node.log is not None:
            node.log.close()

    def kill(self, node: Node, why: str) -> None:
        if node.proc.poll() is None:
            node.killed = True
            who = self.roles.describe(node.number)
            pids = kill_node(node.proc.pid)
            self.say(
                f"killed node {node.number} (SIGKILL to pids {', '.join(map(str, pids))}) {why}, "
                f"{time.monotonic() - self._t0:.1f} s after the start" + (f"; it was {who}" if who else "")
            )

    def _learn(self, client: Any, keys: Keys, plans: PlanReader) -> None:
        """Which launcher node is which node id (its agent's pid in its node record), and which
        nodes hold the leader and rank 0; each said once, when it becomes known or changes."""
        ids = dict(self.roles.ids)
        if len(ids) < len(self.nodes):
            by_pid = {n.proc.pid: n.number for n in self.nodes}
            for key, data in client.get_prefix_json(keys.nodes):
                rec = NodeRecord.parse(data, key=key)
                number = by_pid.get(rec.agent_pid) if rec is not None else None
                if rec is not None and number is not None and number not in ids:
                    ids[number] = rec.node_id
                    self.say(f"node {number} is {rec.node_id} (agent pid {rec.agent_pid})", detail=True)
            if len(ids) == len(self.nodes):
                self.say("node ids: " + ", ".join(f"{k} is {ids[k]}" for k in sorted(ids)))
        leader_rec = read_leader(client, keys)
        plan, _ = plans.read(client)
        rank0 = next((s.node for p in plan.pipelines for s in p.stages if s.rank == 0), None) if plan else None
        roles = Roles(
            ids=ids,
            leader=leader_rec.node_id if leader_rec else self.roles.leader,
            rank0=rank0 or self.roles.rank0,
        )
        if (roles.leader, roles.rank0) != (self.roles.leader, self.roles.rank0):
            self.say(
                f"the leader is {roles.leader or 'not elected yet'}; rank 0 is on {roles.rank0 or 'no node yet'}",
                detail=roles.rank0 is None,
            )
        self.roles = roles

    def _target(self, target: int | str, flag: str) -> tuple[Optional[Node], bool]:
        """The running node `target` names (`flag` for the message), and whether to try again later
        (a role or a node id not known yet)."""
        live = [n.number for n in self.nodes if n.proc.poll() is None and not n.killed]
        number, why, later = resolve(target, live, self.roles)
        if number is not None:
            return self.nodes[number], False
        if not later:
            self.say(f"{flag}: {why}")
        return None, later

    def _due(self, pending: list[Any], flag: str) -> Optional[tuple[Node, Any]]:
        """The first of `pending` (kills or preemptions, by step) that may happen now, taken off
        the list with its node; None: wait (`kill_verdict`). A target that names no node is said
        and dropped."""
        step, roster = self._last_seen
        while pending:
            target, at = pending[0][0], pending[0][1]
            if step is None or step < at:
                return None
            node, later = self._target(target, f"{flag} {target}@{at}")
            if later:
                return None
            if node is None:
                pending.pop(0)
                continue
            ok, _ = kill_verdict(at=at, step=step, closed=False, node_id=self.roles.ids.get(node.number), roster=roster)
            return (node, pending.pop(0)) if ok and not self._short_of_full_plan(roster) else None
        return None

    def _short_of_full_plan(self, roster: Optional[tuple[str, ...]]) -> bool:
        """With --faults-at-full-plan: whether the plan still lacks a node started at launch (--nodes)
        that still runs."""
        if not getattr(self.args, "faults_at_full_plan", False):
            return False
        launched = [n.number for n in self.nodes[: self.args.nodes] if n.proc.poll() is None and not n.killed]
        return not plan_is_full(roster, self.roles.ids, launched)

    def _not_due_why(self, target: int | str, at: int) -> str:
        """Why a kill or preemption never happened, once the job ended."""
        step, roster = self._last_seen
        live = [n.number for n in self.nodes]
        number, why, _ = resolve(target, live, self.roles)
        node_id = self.roles.ids.get(number) if number is not None else None
        if number is None and not (step is None or step < at):
            return why
        _, why = kill_verdict(at=at, step=step, closed=False, node_id=node_id, roster=roster)
        if not why and self._short_of_full_plan(roster):
            why = "the plan never held every node started at launch (--faults-at-full-plan)"
        return (why or "the job closed first") + "; nothing was done to any node"

    def _why_failed(self, client: Any, keys: Keys) -> str:
        """Why nodes failed (`failure_reason`), from etcd and the nodes' own lines."""
        closed: Optional[ClosedRecord] = None
        record: Optional[ErrorRecord] = None
        try:
            closed = read_closed(client, keys)
            record = ErrorRecord.parse(client.get_json(keys.errors)[0])
        except EtcdError:
            pass
        lines = [line for n in self.nodes if not n.killed and n.proc.returncode != 0 for line in n.lines]
        return failure_reason(
            closed.reason if closed is not None and closed.failed else None,
            record.error if record is not None else None,
            lines,
        )

    def run(self) -> int:
        a = self.args
        self.open_folder()
        try:
            if not self.endpoint:
                self.etcd = EtcdServer().start()
                self.endpoint = self.etcd.endpoint
                self.say(f"embedded etcd at {self.endpoint} (pid {self.etcd.pid}), run id {self.run_id}")
            _, prefix = etcd_view(self.endpoint, a.rdzv_conf)
            self.say("while the job runs: " + "; ".join(ops_commands(self.endpoint, self.run_id, prefix)))
            self.say(self.threads_line, detail=True)
            for _ in range(a.nodes):
                self.start_node()
            self.say(f"started {a.nodes} node(s): torchrun pids {', '.join(str(n.proc.pid) for n in self.nodes)}")
            self.interrupt.running = True
            code = self._supervise()
            self.interrupt.running = False
        finally:
            self.cleanup()
        for n in self.nodes:  # the nodes' last lines before the launcher's last ones
            if n.reader is not None:
                n.reader.join(timeout=5)
        self.say(
            f"each node's whole output: {self.folder / 'nodes'}/K.log (K: the node's number above); "
            f"this launcher's lines: {self.folder / 'launcher.log'}"
        )
        self.say(self.done_line)  # last: after etcd's line, so that the last line says why nodes failed
        assert self._log is not None
        self._log.close()
        return code

    def _supervise(self) -> int:
        kills = sorted(self.args.kill, key=lambda ks: ks[1])
        preempts = sorted(self.args.preempt, key=lambda p: p[1])
        joins = sorted(self.args.join)
        settings, prefix = etcd_view(self.endpoint, self.args.rdzv_conf)
        client = connect(settings)
        keys = Keys(prefix, self.run_id)
        plans = PlanReader(keys.plan)
        closed_at: Optional[float] = None
        exited_at: dict[int, float] = {}  # node number -> when the launcher saw it exit
        try:
            while any(n.proc.poll() is None for n in self.nodes):
                if self.interrupt.due(client, keys):
                    for n in self.nodes:
                        if n.proc.poll() is None:
                            kill_node(n.proc.pid)
                            n.killed = True
                for n in self.nodes:
                    if n.number not in exited_at and n.proc.poll() is not None:
                        exited_at[n.number] = time.monotonic()
                if closed_at is None and read_closed(client, keys) is not None:
                    closed_at = time.monotonic()
                if closed_at is not None and time.monotonic() - closed_at > self.args.exit_grace:
                    for n in self.nodes:  # e.g. a hung (SIGSTOPped) node that can no longer exit by itself
                        if n.proc.poll() is None:
                            self.say(
                                f"node {n.number} did not exit {self.args.exit_grace:.0f}s after the job closed; "
                                "its agent's stacks follow"
                            )
                            try:  # the agent prints its threads' stacks (faulthandler, rendezvous/handler.py)
                                os.kill(n.proc.pid, signal.SIGUSR1)
                                time.sleep(1.0)
                            except ProcessLookupError:
                                pass
                            kill_node(n.proc.pid)
                    closed_at = float("inf")
                for n in self.nodes:  # the reclaim after a preemption notice's grace
                    if (
                        n.preempted_at is not None
                        and n.proc.poll() is None
                        and not n.killed
                        and time.monotonic() - n.preempted_at > n.grace
                    ):
                        self.kill(n, f"{n.grace:g}s after its preemption notice (--preempt)")
                if closed_at is None:
                    try:
                        self._learn(client, keys, plans)
                    except EtcdError:  # only for the launcher's lines: the job rides out an outage itself
                        pass
                if (kills or joins or preempts) and closed_at is None:
                    progress = read_progress(client, keys)
                    step = progress.step if progress is not None else None
                    roster = read_roster(client, keys)
                    self._last_seen = (step, roster.nodes if roster is not None else None)
                    while (due := self._due(kills, "--kill")) is not None:
                        node, (target, at) = due
                        self.kill(node, f"at step {step} (--kill {target}@{at})")
                    while (due := self._due(preempts, "--preempt")) is not None:
                        node, (target, at, grace) = due
                        node.preempted_at, node.grace = time.monotonic(), grace
                        os.kill(node.proc.pid, signal.SIGTERM)
                        who = self.roles.describe(node.number)
                        self.say(
                            f"preemption notice to node {node.number} (SIGTERM to its agent, pid {node.proc.pid}) "
                            f"at step {step}; grace {grace:g}s (--preempt {target}@{at})"
                            + (f"; it is {who}" if who else "")
                        )
                    while joins and (step or 0) >= joins[0]:
                        at = joins.pop(0)
                        self.say(f"step {step}: starting one more node (--join {at})")
                        self.start_node()
                time.sleep(0.1)
            reason = self._why_failed(client, keys)
        finally:
            client.close()
        for flag, pending in (("--kill", kills), ("--preempt", preempts)):
            for target, at, *_ in pending:
                self.say(f"{flag} {target}@{at} not done: {self._not_due_why(target, at)}")
        self._say_exit_times(closed_at, exited_at)
        failed = [n for n in self.nodes if not n.killed and n.proc.returncode != 0]
        for n in failed:
            self.say(f"node {n.number} exited with status {n.proc.returncode}")
        preempted = [n for n in self.nodes if n.preempted_at is not None and not n.killed and n.proc.returncode == 0]
        for n in preempted:
            self.say(f"node {n.number} was preempted: it left the job and exited 0")
        self.done_line = (
            f"done: {len(self.nodes)} node(s), {sum(n.killed for n in self.nodes)} killed on purpose, "
            f"{len(preempted)} preempted, {len(failed)} failed"
            + (f": {reason}" if failed and reason else "")
            + self.interrupt.summary()
        )
        if self.interrupt.signal is not None:
            return 128 + self.interrupt.signal
        if failed and all(n.proc.returncode == 2 for n in failed):
            return 2  # every node ended on a known error: a setting, data file, plan or checkpoint to change
        return 1 if failed else 0

    def _say_exit_times(self, closed_at: Optional[float], exited_at: dict[int, float]) -> None:
        """One line: how long after the job closed its last nodes exited (a slow agent exit shows)."""
        if closed_at is None or closed_at == float("inf"):
            return
        end = time.monotonic()
        after = {n.number: max(0.0, exited_at.get(n.number, end) - closed_at) for n in self.nodes if not n.killed}
        after = {k: v for k, v in after.items() if exited_at.get(k, end) >= closed_at}
        if after:
            slowest = max(after, key=lambda k: after[k])
            self.say(
                f"every node exited within {after[slowest]:.1f}s of the job closing (the last: node {slowest})",
                detail=True,
            )

    def cleanup(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                kill_node(n.proc.pid)
            try:
                n.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.etcd is not None:
            etcd, self.etcd = self.etcd, None
            pid, endpoint = etcd.pid, etcd.endpoint
            if self.args.keep_etcd:
                data_dir, scratch = etcd.data_dir, etcd.detach()
                commands = "; ".join(ops_commands(endpoint, self.run_id, etcd_view(endpoint, self.args.rdzv_conf)[1]))
                self.say(
                    f"kept the embedded etcd running (--keep-etcd): pid {pid}, endpoint {endpoint}, data dir "
                    f"{data_dir}; {commands}; stop it with: kill {pid}" + (f"; rm -r {scratch}" if scratch else "")
                )
            else:
                etcd.stop()
                self.say(
                    f"stopped the embedded etcd (pid {pid}); --keep-etcd keeps it for oobleck status after the job",
                    detail=True,
                )


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])  # --help and bad options first
    if cut == len(argv):
        build_parser().error("give the training script after --, e.g. -- examples/train.py --config CFG")
    script = argv[cut + 1 :]
    if not script:
        build_parser().error("no training script after --")
    if args.max_nodes is None:
        args.max_nodes = args.nodes + len(args.join)
    # before etcd and any node: one line, not one per node
    problem = preflight(script, args.rdzv_conf, nodes=args.max_nodes, warn=lambda line: print(f"[launcher] {line}"))
    if problem:
        print(f"launcher.local: error: {problem}", file=sys.stderr, flush=True)
        return 2
    cluster = LocalCluster(args, script)

    def on_signal(signum: int, _frame: object) -> None:
        if not cluster.interrupt.received(signum):  # a second one, or before any node runs
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return cluster.run()
    except KeyboardInterrupt:
        cluster.cleanup()
        cluster.say(f"done: stopped every node on a signal{cluster.interrupt.summary()}")
        return 130


if __name__ == "__main__":
    sys.exit(main())
