"""Stress: the 4-node kill job, a leader kill, a drain, and a kill during a reconfiguration, each run
N times beside busy loops; every run's weights against the single-process reference.

`make stress` (20 runs per scenario, 2 busy loops per core) and its short form `--quick` (3 runs)
print one JSON line per run and per scenario, a table on stderr, and exit 1 on a lost job, a stall
or weights unlike the reference. False deaths (a `lost` event for a node no fault touched) are
counted, and each must have been survived. Each run's logs stay in `--log-dir`. What is measured
and why: docs/liveness.md#slow-is-not-dead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from bench.harness import ROOT, Bench, emit, median

CONFIG = ROOT / "configs" / "gpt2-tiny.yaml"
RDZV = {"lease_ttl": 2.0, "settle": 0.2, "last_call_timeout": 1.0}
NODES = 4


@dataclass(frozen=True)
class Scenario:
    """What the launcher injects (its `--kill` / `--preempt` flags) and which nodes it touches."""

    kill: tuple[str, ...] = ()
    preempt: tuple[str, ...] = ()
    kill_in_replan: Optional[int] = None
    """A launcher number SIGKILLed as soon as a plan newer than the one of the first fault is
    published: while the survivors enter it."""
    about: str = ""


SCENARIOS = {
    "kill": Scenario(kill=("follower@3",), about="SIGKILL a node that neither leads nor holds rank 0"),
    "leader-kill": Scenario(kill=("leader@3",), about="SIGKILL the leader's node"),
    "drain": Scenario(preempt=("follower@3:60",), about="a preemption notice (SIGTERM) to a node"),
    "kill-in-reconfig": Scenario(
        preempt=("1@3:60",), kill_in_replan=2, about="a drain, then a kill as the drain's plan is published"
    ),
}


def busy_loops(count: int) -> list[subprocess.Popen]:
    """`count` processes spinning in pure Python: the load of a busy machine."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def overrides(work: Path, steps: int, profile: Path) -> list[str]:
    from oobleck_elastic.testing import TINY_PROFILE_OVERRIDES

    return [
        f"training.steps={steps}",
        "data.seq_len=32",
        "training.global_batch_size=16",
        "training.microbatch_size=2",
        "training.optimizer.eps=1e-6",
        f"data.cache_dir={work / 'cache'}",
        f"checkpoint.dir={work / 'ckpt'}",
        f"logging.tensorboard_dir={work / 'runs'}",
        f"logging.events_dir={work / 'events'}",
        f"planning.profile_path={profile}",
        *TINY_PROFILE_OVERRIDES,
    ]


def reference(work: Path, steps: int, profile: Path) -> dict:
    """The single-process run's weights (its output in `work`/reference.log)."""
    from oobleck_elastic.checkpoint import load_model_state

    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "examples/train.py", "--config", str(CONFIG), *overrides(work, steps, profile)]
    with open(work / "reference.log", "w") as log:
        if subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"stress: the single-process reference failed; its output: {work / 'reference.log'}")
    return load_model_state(work / "ckpt")


def same_weights(job: dict, ref: dict) -> Optional[str]:
    """None when `job` matches `ref` (as the tests compare), else the first difference."""
    import torch

    if set(job) != set(ref):
        return f"tensors differ: {sorted(set(job) ^ set(ref))[:3]}"
    for key in ref:
        try:
            torch.testing.assert_close(job[key], ref[key], rtol=1e-5, atol=1e-6)
        except AssertionError:
            return f"{key} differs from the reference"
    return None


def gaps(steps: list[tuple[int, float]], faults: list[float], entries: list[float]) -> tuple[list[float], list[float]]:
    """(gaps between consecutive completed steps that no fault's recovery spans, each fault -> the
    first step completed in a generation entered after it), from (step, time) lines in completion
    order and the times workers entered generations. A step completing just after a fault may be
    the one in flight, done before the fault took effect: recovery ends in the next generation."""
    recovered = []
    for f in faults:
        entered = min((e for e in entries if e > f), default=f)
        after = [t for _, t in steps if t > entered]
        recovered.append((f, min(after)) if after else (f, f))
    plain = [
        t1 - t0 for (_, t0), (_, t1) in zip(steps, steps[1:]) if not any(t0 < end and f < t1 for f, end in recovered)
    ]
    return plain, [end - f for f, end in recovered if end > f]


def stall_bound(plain: list[float]) -> float:
    """A gap longer than this is a stall: a lease TTL and the leader's settle window beyond a
    step (the median step, twice: a loaded machine's step varies that much)."""
    return RDZV["lease_ttl"] + RDZV["settle"] + 2 * (median(plain) or 0.0)


def one_run(
    name: str, scenario: Scenario, i: int, args: argparse.Namespace, etcd: Any, profile: Path, ref: dict
) -> dict[str, Any]:
    from launcher.local import LocalCluster
    from launcher.options import build_parser
    from oobleck_elastic.checkpoint import load_model_state
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.logs import read_event_lines
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.records.read import read_roster
    from oobleck_elastic.rendezvous.membership import read_events

    work = args.log_dir / f"{name}-{i}"
    run_id = f"stress-{name}-{i}-{uuid.uuid4().hex[:4]}"
    rdzv = ",".join(f"{k}={v:g}" for k, v in RDZV.items())
    flags = ["--nodes", str(NODES), "--min-nodes", "2", "--endpoint", etcd.endpoint, "--run-id", run_id]
    flags += ["--log-dir", str(work / "launcher"), "--rdzv-conf", rdzv]
    # the fault meets the 4-node plan the scenario is about: under load a node can join after step
    # 3, and a kill while the job runs one pipeline of the first nodes loses layers by design
    flags += ["--faults-at-full-plan"]
    for k in scenario.kill:
        flags += ["--kill", k]
    for p in scenario.preempt:
        flags += ["--preempt", p]
    cli = build_parser().parse_args(flags)
    cli.max_nodes = NODES
    faults: list[float] = []

    class Cluster(LocalCluster):
        def kill(self, node: Any, why: str) -> None:
            if node.proc.poll() is None:
                faults.append(time.time())
            super().kill(node, why)

    def kill_in_replan() -> None:
        """Kill node `scenario.kill_in_replan` once the roster moves past the first fault's."""
        client = connect(EtcdSettings(endpoint=etcd.endpoint))
        keys, seen = Keys("/oobleck", run_id), None
        try:
            while not stopped.wait(0.02):
                roster = read_roster(client, keys)
                if roster is None:
                    continue
                if not faults and not any(n.preempted_at is not None for n in cluster.nodes):
                    seen = roster.generation
                elif seen is not None and roster.generation > seen:
                    node = cluster.nodes[scenario.kill_in_replan]
                    cluster.kill(node, f"as generation {roster.generation} was published (kill in a reconfiguration)")
                    return
        finally:
            client.close()

    stopped = threading.Event()
    script = ["examples/train.py", "--config", str(CONFIG), *overrides(work, args.steps, profile)]
    work.mkdir(parents=True)
    with open(work / "launcher.out", "w") as out:
        cluster = Cluster(cli, script, out=out)
        offset = time.time() - time.monotonic()
        started = time.monotonic()
        deadline = threading_timer(cluster, args.timeout)
        watcher = threading.Thread(target=kill_in_replan, daemon=True)
        if scenario.kill_in_replan is not None:
            watcher.start()
        try:
            code = cluster.run()
        finally:
            timed_out = deadline()
            stopped.set()
            if watcher.is_alive():
                watcher.join()
    faults += [n.preempted_at + offset for n in cluster.nodes if n.preempted_at is not None]
    touched = {cluster.roles.ids.get(n.number) for n in cluster.nodes if n.killed or n.preempted_at is not None}
    client = connect(EtcdSettings(endpoint=etcd.endpoint))
    try:
        events = [ev for _, ev in read_events(client, Keys("/oobleck", run_id))]
    finally:
        client.close()
    false_deaths = sorted({f"{e.node}: {e.detail}" for e in events if e.kind == "lost" and e.node not in touched})
    lines = read_event_lines(work / "events", ["step", "entered"])
    steps = [(int(e["step"]), float(e["t"])) for e in lines if e["event"] == "step"]
    entries = [float(e["t"]) for e in lines if e["event"] == "entered"]
    plain, recovery = gaps(steps, sorted(faults), entries)
    bound = stall_bound(plain)
    stalls = [round(g, 2) for g in plain if g > bound]
    try:
        mismatch = same_weights(load_model_state(work / "ckpt"), ref) if code == 0 and not timed_out else None
    except Exception as err:  # no checkpoint: the job did not finish
        mismatch = f"no weights to compare: {err}"
    lost_job = code != 0 or timed_out
    record = {
        "scenario": name,
        "run": i,
        "passed": not lost_job and not stalls and mismatch is None,
        "lost_job": lost_job,
        "timed_out": timed_out,
        "weights": "reference" if mismatch is None and not lost_job else (mismatch or "none"),
        "false_deaths": false_deaths,
        "stalls_s": stalls,
        "stall_bound_s": round(bound, 2),
        "fault_to_next_step_s": [round(r, 2) for r in recovery],
        "median_step_s": round(median(plain) or 0.0, 3),
        "wall_s": round(time.monotonic() - started, 1),
        "done": cluster.done_line,
        "logs": str(work),
    }
    emit(record)
    return record


def threading_timer(cluster: Any, seconds: float) -> Any:
    """Stop `cluster` (its cleanup kills every node) after `seconds`; the returned call cancels
    the timer and says whether it fired."""
    fired = threading.Event()

    def fire() -> None:
        fired.set()
        cluster.say(f"stress: the run took longer than {seconds:g} s; stopping every node")
        cluster.cleanup()

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()

    def done() -> bool:
        timer.cancel()
        return fired.is_set()

    return done


def summarise(name: str, runs: list[dict]) -> dict[str, Any]:
    worst = max((r for run in runs for r in run["fault_to_next_step_s"]), default=None)
    return {
        "scenario": name,
        "about": SCENARIOS[name].about,
        "runs": len(runs),
        "passed": sum(r["passed"] for r in runs),
        "lost_jobs": sum(r["lost_job"] for r in runs),
        "stalls": sum(len(r["stalls_s"]) for r in runs),
        "false_deaths": sum(len(r["false_deaths"]) for r in runs),
        "false_deaths_survived": sum(len(r["false_deaths"]) for r in runs if not r["lost_job"]),
        "weights_reference": sum(r["weights"] == "reference" for r in runs),
        "worst_fault_to_next_step_s": worst,
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="runs of each scenario (20)")
    ap.add_argument("--busy-per-core", type=int, default=2, help="busy loops per core beside the jobs (2)")
    ap.add_argument("--steps", type=int, default=30, help="steps of each job (30); faults at step 3")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one run may take before it is a stall (300)")
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only this scenario (repeatable)")
    ap.add_argument("--log-dir", type=Path, help="where every run's logs are kept (default: a new temp dir)")
    args = ap.parse_args(argv)
    from oobleck_elastic.etcd.server import EtcdServer
    from oobleck_elastic.testing import uniform_profile

    args.log_dir = (args.log_dir or Path(tempfile.mkdtemp(prefix="oobleck-stress-"))).resolve()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    names = args.only or list(SCENARIOS)
    print(f"stress: {', '.join(names)} x {args.runs} runs; logs in {args.log_dir}", file=sys.stderr, flush=True)
    profile = args.log_dir / "profile.json"
    uniform_profile().save(profile)
    ref = reference(args.log_dir / "reference", args.steps, profile)
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt(f"signal {s}")))
    load = busy_loops(args.busy_per_core * (os.cpu_count() or 1))
    etcd = EtcdServer().start()
    summaries = []
    try:
        for name in names:
            runs = []
            for i in range(args.runs):
                print(f"stress: {name} run {i + 1} of {args.runs} ...", file=sys.stderr, flush=True)
                runs.append(one_run(name, SCENARIOS[name], i, args, etcd, profile, ref))
                if runs[-1]["passed"]:
                    shutil.rmtree(Path(runs[-1]["logs"]) / "ckpt", ignore_errors=True)
            summaries.append(summarise(name, runs))
            emit(summaries[-1])
    finally:
        stop(load)
        etcd.stop()
    print(table(summaries), file=sys.stderr, flush=True)
    bad = sum(s["lost_jobs"] + s["stalls"] + (s["runs"] - s["weights_reference"]) for s in summaries)
    return 1 if bad else 0


def table(summaries: list[dict]) -> str:
    head = ("scenario", "passed", "lost jobs", "stalls", "false deaths (survived)", "worst fault -> next step")
    rows = [
        (
            s["scenario"],
            f"{s['passed']}/{s['runs']}",
            str(s["lost_jobs"]),
            str(s["stalls"]),
            f"{s['false_deaths']} ({s['false_deaths_survived']})",
            "-" if s["worst_fault_to_next_step_s"] is None else f"{s['worst_fault_to_next_step_s']:.2f} s",
        )
        for s in summaries
    ]
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in [head, *rows])


BENCH = Bench(main, quick=("--runs", "3"))
