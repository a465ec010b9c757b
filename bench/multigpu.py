"""Two machines of 4 GPUs as one job under NCCL: a kill, a join, a drain and a leader kill, each
job's weights against the single-process reference (`bash bench/multigpu_check.sh`).

Each machine runs two 2-GPU torchrun agents (four nodes on two hosts) and does the faults on its
own agents when the job reaches the fault's step; machine 0 runs the reference first and compares
at the end. A line per scenario and machine; its verdict holds the agents' exits to the fault, the
job's logs to the reconfiguration's cause and (machine 0) the weights to the reference's.
`--dry-run` validates both machines' commands and configs; `--cpu` runs the scenarios on CPUs
under gloo, both drivers possibly on one machine. How to start it, the scenarios and what they
showed: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from bench.harness import Bench, emit

ROOT = Path(__file__).resolve().parents[1]
STEPS, AT, PACE_S = 40, 5, 1.5
CPU_STEPS, CPU_AT, CPU_PACE_S = 20, 3, 2.5
AGENTS_PER_MACHINE, GPUS_PER_AGENT = 2, 2


@dataclass(frozen=True)
class Scenario:
    """One job and its fault."""

    action: str
    """kill, join, drain (SIGTERM: a preemption notice) or leader_kill."""
    starts: int
    """Agents started at once (the joiner starts at step `AT`)."""
    victim: Optional[tuple[int, int]]
    """(machine, agent) acted on; None: the leader, wherever it runs."""
    cause: str
    """The cause the reconfiguration's log line names (`generation 1 -> 2 (CAUSE: ...)`)."""


SCENARIOS = {
    "kill": Scenario("kill", 4, (1, 1), "failure"),
    "join": Scenario("join", 3, (1, 1), "join"),
    "drain": Scenario("drain", 4, (1, 1), "drain"),
    "leader_kill": Scenario("leader_kill", 4, None, "failure"),
}


def job_overrides(shared: Path, local: Path, name: str, profile: Path, *, cpu: bool = False) -> list[str]:
    """The job's (and its reference's) config overrides: gpt2-tiny on CUDA (`cpu`: the CPU), 2
    devices a node, the plan from a fixed profile (`testing.tiny_profile`), fp32."""
    from oobleck_elastic.testing import TINY_PROFILE_OVERRIDES

    return [
        f"training.steps={CPU_STEPS if cpu else STEPS}",
        "data.seq_len=32",
        "training.global_batch_size=16",
        "training.microbatch_size=2",
        "training.optimizer.eps=1e-6",
        f"training.device={'cpu' if cpu else 'cuda'}",
        "planning.gpus_per_node=2",
        f"planning.profile_path={profile}",
        *TINY_PROFILE_OVERRIDES,
        "fault_tolerance.comm_timeout_s=30",
        f"data.cache_dir={local / 'cache'}",
        f"logging.tensorboard_dir={local / 'runs'}",
        f"checkpoint.dir={shared / name / 'ckpt'}",
    ]


def torchrun(endpoint: str, run_id: str, scenario: Scenario, script: list[str]) -> list[str]:
    nmin = scenario.starts
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nmin}:4",
        f"--nproc-per-node={GPUS_PER_AGENT}",
        "--rdzv-backend=oobleck",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=lease_ttl=5,settle=0.5,last_call_timeout=1",
        "--monitor-interval=0.1",
        *script,
    ]


def commands(args: argparse.Namespace, name: str, local: Path, profile: Path) -> dict[str, Any]:
    """Every command this machine runs for scenario `name`: its agents' and (machine 0) the reference's."""
    scenario = SCENARIOS[name]
    run_id = f"{args.tag}-{name}"
    over = job_overrides(args.shared / run_id, local, "job", profile, cpu=args.cpu)
    script = ["examples/train.py", "--config", "configs/gpt2-tiny.yaml", *over]
    agents = {}
    for k in range(AGENTS_PER_MACHINE):
        gpus = ",".join(str(GPUS_PER_AGENT * k + g) for g in range(GPUS_PER_AGENT))
        agents[k] = {"cmd": torchrun(args.endpoint, run_id, scenario, script), "gpus": gpus}
    ref = None
    if args.machine == 0:
        ref_over = [o for o in over if not o.startswith("checkpoint.dir=")] + [
            f"checkpoint.dir={args.shared / run_id / 'ref' / 'ckpt'}"
        ]
        ref = [sys.executable, "examples/train.py", "--config", "configs/gpt2-tiny.yaml", *ref_over]
    return {"run_id": run_id, "agents": agents, "reference": ref, "script": script}


def validate(args: argparse.Namespace, name: str, local: Path, profile: Path) -> dict[str, Any]:
    """--dry-run: parse every command of both machines as torchrun and the launcher would, and plan
    the job for 3 and 4 nodes of 2 GPUs."""
    from torch.distributed.run import get_args_parser

    from launcher.checks import preflight
    from oobleck_elastic.config import load_config
    from oobleck_elastic.planning import load_profiles, plan_job

    problems, plans = [], {}
    for machine in (0, 1):
        cmds = commands(argparse.Namespace(**{**vars(args), "machine": machine}), name, local, profile)
        for k, agent in cmds["agents"].items():
            parsed = get_args_parser().parse_args(agent["cmd"][3:])
            if parsed.rdzv_backend != "oobleck" or parsed.nproc_per_node != str(GPUS_PER_AGENT):
                problems.append(f"machine {machine} agent {k}: {parsed}")
        problem = preflight(cmds["script"], "", nodes=4, warn=lambda _line: None)
        if problem:
            problems.append(problem)
    cfg = load_config(ROOT / "configs/gpt2-tiny.yaml", [o for o in cmds["script"][3:]] + ["training.device=cpu"])
    profiles = load_profiles(cfg)
    for n in (3, 4):
        plan = plan_job(cfg, nodes=n, profile=profiles).plan
        plans[n] = [[(s.start, s.end) for s in p.stages] for p in plan.pipelines]
    return {"problems": problems, "plans": {str(k): v for k, v in plans.items()}}


def run_scenario(args: argparse.Namespace, name: str, local: Path, profile: Path) -> dict[str, Any]:
    """This machine's part of scenario `name` (module docstring)."""
    from launcher.faults import kill_node
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.records.read import read_leader

    scenario = SCENARIOS[name]
    cmds = commands(args, name, local, profile)
    logs = local / cmds["run_id"]
    logs.mkdir(parents=True, exist_ok=True)
    if cmds["reference"] is not None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
        with open(logs / "reference.log", "w") as f:
            subprocess.run(cmds["reference"], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    steps, at, pace = (CPU_STEPS, CPU_AT, CPU_PACE_S) if args.cpu else (STEPS, AT, PACE_S)
    slow = ",".join(f"0@{s}:{pace:g}" for s in range(1, steps))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OOBLECK_SLOW_AT": slow}
    if args.cpu:
        env["OMP_NUM_THREADS"] = "1"
    procs: dict[int, subprocess.Popen] = {}
    files: list[Any] = []

    def start(k: int) -> None:
        agent = cmds["agents"][k]
        out = open(logs / f"agent{k}.log", "w")
        files.append(out)
        procs[k] = subprocess.Popen(
            agent["cmd"],
            cwd=ROOT,
            env={**env, "CUDA_VISIBLE_DEVICES": agent["gpus"]},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    mine = scenario.victim == (args.machine, 1) or scenario.victim is None
    for k in range(AGENTS_PER_MACHINE):
        if not (scenario.action == "join" and scenario.victim == (args.machine, k)):
            start(k)
    client = connect(EtcdSettings(endpoint=args.endpoint))
    keys = Keys("/oobleck", cmds["run_id"])
    acted: Optional[str] = None
    killed: Optional[int] = None
    leader = ""  # the leader last seen before step `at`: the machines must agree on the victim
    deadline = time.monotonic() + 900
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        step = (client.get_json(keys.progress)[0] or {}).get("step", 0)
        if scenario.action == "leader_kill" and step < at:
            seen = read_leader(client, keys)
            leader = seen.node_id if seen is not None else leader
        elif acted is None and mine and step >= at:
            acted, killed = act(scenario, procs, start, client, keys, leader)
        time.sleep(0.2)
    for p in procs.values():
        if p.poll() is None:
            kill_node(p.pid)
    exits = {k: p.wait() for k, p in procs.items()}
    for f in files:
        f.close()
    expected = {k: -9 if k == killed else 0 for k in procs}
    # the line comes from the worker that reports it (rank 0's node): read both machines' logs
    paths = sorted(args.shared.glob(f"{args.tag}-m*/{cmds['run_id']}/agent*.log"))
    text = "".join(p.read_text(errors="replace") for p in paths)
    reconfigured = re.search(rf"generation \d+ -> \d+ \({scenario.cause}", text) is not None
    out: dict[str, Any] = {
        "scenario": name,
        "machine": args.machine,
        "acted": acted,
        "agent_exits": exits,
        "reconfigured": reconfigured,
        "logs": str(logs),
    }
    passed = exits == expected and reconfigured
    bound = f"agent exits {expected}; a log names the reconfiguration ({scenario.cause})"
    if args.machine == 0:
        same = compare(args.shared / cmds["run_id"])
        out["max_rel_diff"] = same["max_rel_diff"]
        passed, bound = passed and same["close"], bound + "; weights allclose(rtol=1e-5, atol=1e-6) to the reference"
    out.update(verdict="pass" if passed else "fail", bound=bound)
    return out


def act(scenario: Scenario, procs: dict, start: Any, client: Any, keys: Any, leader: str) -> tuple[str, Optional[int]]:
    """Do the scenario's fault where it is this machine's: (what was done, '' when nothing; the
    agent SIGKILLed, if one was). `leader`: the node that led before the fault (not the one that
    leads now: the other machine may have killed that one already)."""
    from launcher.faults import kill_node
    from oobleck_elastic.rendezvous.membership import live_nodes

    if scenario.action == "join":
        start(1)
        return "started agent 1", None
    if scenario.action == "drain":
        os.kill(procs[1].pid, signal.SIGTERM)
        return "SIGTERM to agent 1", None
    if scenario.action == "kill":
        kill_node(procs[1].pid)
        return "SIGKILL agent 1", 1
    pids = {p.pid: k for k, p in procs.items()}
    for r in live_nodes(client, keys):
        if r.node_id == leader and r.agent_pid in pids:  # our pid (a clash across hosts: negligible)
            kill_node(r.agent_pid)
            return f"SIGKILL agent {pids[r.agent_pid]} (the leader, {r.node_id})", pids[r.agent_pid]
    return "", None


def compare(folder: Path) -> dict[str, Any]:
    """The job's final weights against the reference's, with the equality tests' tolerance."""
    import torch

    from oobleck_elastic.checkpoint import load_model_state

    job, ref = load_model_state(folder / "job" / "ckpt"), load_model_state(folder / "ref" / "ckpt")
    rel = max(float((job[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref)
    close = set(job) == set(ref) and all(torch.allclose(job[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)
    return {"max_rel_diff": rel, "close": close}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", type=int, choices=(0, 1), default=0)
    ap.add_argument("--endpoint", default="127.0.0.1:2379", help="etcd host:port both machines reach")
    ap.add_argument("--shared", type=Path, default=Path("/tmp/multigpu_shared"), help="a folder both machines mount")
    ap.add_argument("--tag", default="multigpu", help="the same on both machines: run ids are TAG-SCENARIO")
    ap.add_argument("--scenario", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--dry-run", action="store_true", help="validate commands and configs only (docstring)")
    ap.add_argument("--cpu", action="store_true", help="run the scenarios on CPUs under gloo (docstring)")
    args = ap.parse_args(argv)
    import shutil
    import tempfile

    from oobleck_elastic.testing import tiny_profile

    # this machine's own files (profile, data cache, TensorBoard, logs); a dry run's are removed
    local = Path(tempfile.mkdtemp(prefix="multigpu_")) if args.dry_run else args.shared / f"{args.tag}-m{args.machine}"
    local.mkdir(parents=True, exist_ok=True)
    profile = tiny_profile(local / "profile.json")
    failed = 0
    try:
        for name in args.scenario:
            if args.dry_run:
                got = validate(args, name, local, profile)
                got.update(verdict="fail" if got["problems"] else "pass", bound="every command and config accepted")
                emit({"check": f"multigpu_{name}", "dry_run": True, **got})
            else:
                got = run_scenario(args, name, local, profile)
                emit({"check": f"multigpu_{name}", "dry_run": False, "cpu": args.cpu, **got})
            failed += got.get("verdict") == "fail"
    finally:
        if args.dry_run:
            shutil.rmtree(local, ignore_errors=True)
    return 1 if failed else 0


BENCH = Bench(main, quick=("--dry-run",))
