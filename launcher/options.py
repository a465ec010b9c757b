"""The local launcher's command line (`python -m launcher.local --help`): how many nodes, which
etcd, and the faults to inject (`--kill`, `--preempt`, `--join`). The story: docs/running.md.
"""

from __future__ import annotations

import argparse

from .targets import parse_at, parse_preempt

__all__ = ["build_parser"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m launcher.local",
        description="A local multi-node simulation: one `torchrun --rdzv-backend=oobleck` per simulated node.",
        epilog="Everything after -- is the training script and its arguments.",
    )
    ap.add_argument("--nodes", type=int, default=4, help="nodes started at once (default 4)")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    ap.add_argument("--min-nodes", type=int, help="--nnodes MIN (default: --nodes)")
    ap.add_argument("--max-nodes", type=int, help="--nnodes MAX (default: --nodes + number of --join)")
    ap.add_argument("--endpoint", help="etcd host:port (default: start an embedded etcd)")
    ap.add_argument(
        "--run-id", help="--rdzv-id and the TensorBoard run's name (default: the config's name and a fresh suffix)"
    )
    ap.add_argument(
        "--log-dir",
        default="runs",
        help="the run's folder is LOG_DIR/RUN_ID: each node's whole output in nodes/K.log (default runs)",
    )
    ap.add_argument(
        "-v", "--verbose", action="store_true", help="print every line of every node (default: the lines a user needs)"
    )
    ap.add_argument(
        "--keep-etcd",
        action="store_true",
        help="leave the embedded etcd running after the job (for oobleck status / goodput); the last "
        "line gives its PID, endpoint and the commands; stop it with kill PID",
    )
    ap.add_argument(
        "--kill",
        type=parse_at,
        action="append",
        default=[],
        metavar="NODE@STEP",
        help="SIGKILL node NODE once the job reaches step STEP; NODE is a launcher number (0 = the first "
        "started), a node id (node2) or a role: leader, rank0, follower (neither)",
    )
    ap.add_argument(
        "--preempt",
        type=parse_preempt,
        action="append",
        default=[],
        metavar="NODE@STEP[:GRACE]",
        help="send node NODE's agent SIGTERM (a preemption notice) at step STEP; SIGKILL it GRACE "
        "seconds later if it is still running (default 60); NODE as for --kill",
    )
    ap.add_argument(
        "--join",
        type=int,
        action="append",
        default=[],
        metavar="STEP",
        help="start one more node once the job reaches step STEP",
    )
    ap.add_argument(
        "--faults-at-full-plan",
        action="store_true",
        help="inject --kill and --preempt only once the plan holds every node started at launch (under load "
        "nodes join late and a job with --min-nodes starts smaller, with fewer copies of each layer)",
    )
    ap.add_argument(
        "--device-classes",
        default="",
        metavar="NAME[,NAME...]",
        help="each node's device class in start order (planning.classes; joins take the next, the last repeats), "
        "e.g. fast,fast,slow,slow",
    )
    ap.add_argument(
        "--paced-speeds",
        default="",
        metavar="S[,S...]",
        help="with training.paced_devices: each node's device speed in start order (1 = the profiled device; "
        "the last repeats), e.g. 1,1,0.5,0.5 (OOBLECK_PACED_SPEED)",
    )
    ap.add_argument("--rdzv-conf", default="", help="passed to torchrun --rdzv-conf (e.g. lease_ttl=2,settle=0.2)")
    ap.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts (local worker crashes)")
    ap.add_argument(
        "--exit-grace",
        type=float,
        default=60.0,
        help="seconds after the job closed before nodes still running are killed (default 60)",
    )
    return ap
