"""Recovery from a node failure: the oobleck job against the honest torchrun baseline, side by side.

Goals: (a) a median under 0.5 s from a node's death to resumed training (the leader's death: under
0.8 s); (b) at least 20x faster than torchrun's restart-from-checkpoint, counting the work it
redoes; (c) after losing 1 of
4 nodes, samples/s at least 95 % of 3/4 of the samples/s before.

Method. Both jobs train the same tiny GPT-2 (configs/gpt2-tiny.yaml + OVERRIDES: seq_len 32,
global batch 16 in microbatches of 2) on the same data for `--steps` steps, on 4 simulated nodes
(one torchrun per node, 1 worker each, all on this machine), and the benchmark SIGKILLs node 1
(its torchrun agent, process group and every descendant, `launcher.faults.kill_node`) as soon as
the job reports `--kill-step` completed steps; the survivors go on to the last step.

- (a) ours: `launcher.local.LocalCluster` (the code behind `python -m launcher.local`), i.e.
  `torchrun --rdzv-backend=oobleck --nnodes=4:4 --rdzv-conf=lease_ttl=2,settle=0.2,
  last_call_timeout=1 examples/train.py --config configs/gpt2-tiny.yaml ...` per node, on an
  etcd started here (`EtcdServer`). Progress: the `progress` key in etcd (rank 0, after every
  step); steps, their times and the reconfiguration: the workers' JSON event lines
  (`logging.events_dir`, oobleck_elastic/logs.py: `step`, `comm_failed`, `step_abandoned`,
  `entered`) and the `lost` / `plan` events in etcd.
- (b) baseline: `bench/baseline_train.py` (DDP over gloo, checkpoint every `--checkpoint-every`
  steps with torch.save, resume from the newest; see its docstring) under stock torchrun with the
  same process handling (a LocalCluster subclass): `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun
  --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT --nnodes=3:4 --max-restarts=3
  --monitor-interval=0.1 --rdzv-conf=join_timeout=120,last_call_timeout=1,keep_alive_interval=1,
  keep_alive_max_attempt=2,is_host=0|1`. keep_alive 1 s x 2 attempts is the c10d equivalent of
  our 2 s lease TTL (the defaults, 5 s x 3, would add 13 s); last_call_timeout=1 as ours (its
  default, 30 s, would add 29 s). Node 0 is started first with is_host=1 and hosts the c10d
  store (the others are clients, as on a real cluster); it is never the victim: losing it kills
  the stock job outright. The 2.13 share-TCP-store bug needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  (the restarted agent otherwise reuses a store nobody serves any more). Progress: `progress.json` / `history.jsonl`.

The kill happens when progress shows step >= S (polled every 20 ms; the baseline also needs world
4). P = the completed steps at that moment; the step in flight is P+1. Reported per run:

- `kill_to_next_step_s`: SIGKILL -> the first step completed after it (ours: the interrupted step,
  replayed or rolled forward; baseline: the first step after its last checkpoint);
- `kill_to_step_past_kill_s`: SIGKILL -> the first completed step numbered > P, measured;
- `lost_steps`: completed steps redone = P - (step resumed from); ours 0 (the partial in-flight step
  is replayed in both jobs and is inside kill_to_next_step_s);
- `samples_s_before` / `samples_s_after`: global batch / median interval between consecutive step
  completions, before the kill (steps 3..P) and after recovery (from the 2nd step after it);
- `recovery_cost_s` = kill_to_next_step_s + lost_steps x median step time after recovery;
- `timeline_s`: seconds after the kill of each phase (detection, new membership, first step);
  `last_survivor_saw_failure`: the last survivor's main thread saw its step fail or abandoned it
  (the `seen` field of `comm_failed` / `step_abandoned`, before the generation's teardown);
- `longest_teardown_s`: the longest teardown of a survivor's generation (`abort_s` of the same
  lines: aborting its groups and collecting their cycles).

The comparison line: `ratio_b_over_a` = recovery_cost_s of b / of a (medians over repeats) and
the three goals. The jobs run one after the other (order alternates between repeats), never
together. The machine (2 shared cores, 4 workers + 4 agents + etcd) is oversubscribed, so
throughput is CPU-bound and noisy, and the 3/4 throughput goal is only loosely meaningful here:
fewer processes on 2 cores can even be faster per step.

Run (about 1.5-3 min per job on 2 cores):

    /tmp/venv/bin/python -m bench recovery [--kill-step 10] [--steps 30] [--checkpoint-every 4]
        [--repeats 1] [--log-dir DIR] [key=value ...]      # extra config overrides for both jobs
    /tmp/venv/bin/python -m bench recovery --victim leader --lease-ttl 10   # ours only: the leader dies
    /tmp/venv/bin/python -m bench recovery --victim hung    # ours only: node 1 SIGSTOPped (comm timeout 30 s)

Logs of every run are kept in --log-dir (default: a fresh temp dir, printed on stderr).
Every process (torchruns, workers, etcd) is started here and killed by PID at the end, on Ctrl-C
or on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from bench.harness import Bench, emit, median


from launcher.faults import descendants, kill_node
from launcher.local import LocalCluster
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.etcd.server import EtcdServer, free_port
from oobleck_elastic.logs import read_event_lines
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.membership import live_nodes, read_events

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "gpt2-tiny.yaml"
OVERRIDES = [
    "data.seq_len=32",
    "training.global_batch_size=16",
    "training.microbatch_size=2",
    "fault_tolerance.comm_timeout_s=30",
]
OURS_RDZV = "lease_ttl=2,settle=0.2,last_call_timeout=1"
C10D_RDZV = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
NODES, VICTIM = 4, 1
GOAL_RECOVERY_S, GOAL_RATIO, GOAL_THROUGHPUT = 0.5, 20.0, 0.95


class Lines:
    """The `out` of a LocalCluster: every line, with the time it arrived, into a log file."""

    def __init__(self, path: Path) -> None:
        self.fh = open(path, "w")
        self.lines: list[tuple[float, str]] = []
        self._part = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            self._part += text
            while "\n" in self._part:
                line, self._part = self._part.split("\n", 1)
                now = time.time()
                self.lines.append((now, line))
                self.fh.write(f"{now:.3f} {line}\n")

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


class BaselineCluster(LocalCluster):
    """The same process handling as launcher.local, running stock torchrun + c10d + DDP."""

    def __init__(self, args: argparse.Namespace, script: list[str], *, out: Lines, port: int) -> None:
        super().__init__(args, script, out=out)
        self.endpoint = f"127.0.0.1:{port}"

    def torchrun_command(self) -> list[str]:
        host = 1 if len(self.nodes) == 0 else 0  # node 0 serves the c10d store
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={NODES - 1}:{NODES}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            "--monitor-interval=0.1",
            "--max-restarts=3",
            f"--rdzv-conf={C10D_RDZV},is_host={host}",
        ] + self.script

    def start_node(self):  # as LocalCluster.start_node, plus the 2.13 workaround in the environment
        old = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        try:
            return super().start_node()
        finally:
            if old is None:
                del os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]
            else:
                os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = old


def cluster_args(**kw: Any) -> argparse.Namespace:
    base = dict(
        nodes=NODES,
        nproc_per_node=1,
        min_nodes=None,
        max_nodes=NODES,
        endpoint=None,
        run_id=None,
        kill=[],
        join=[],
        rdzv_conf="",
        max_restarts=3,
        verbose=True,  # every node line: the bench reads them
        log_dir="runs",
    )
    base.update(kw)
    return argparse.Namespace(**base)


def wait_port(port: int, timeout_s: float, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the c10d store on 127.0.0.1:{port} did not come up")


class Run:
    """One job: start, kill node VICTIM at the kill step, wait for the end, keep the raw data."""

    def __init__(
        self,
        job: str,
        cluster: LocalCluster,
        lines: Lines,
        read_progress: Callable[[], Optional[dict]],
        *,
        want_world: Optional[int],
    ) -> None:
        self.job, self.cluster, self.lines, self.read_progress = job, cluster, lines, read_progress
        self.want_world = want_world
        self.t_kill: Optional[float] = None
        self.killed_at: Optional[int] = None
        self.timed_out = False
        self.before_kill: Callable[[], dict] = dict
        self.kill_info: dict = {}
        self.victim: Callable[[], int] = lambda: VICTIM
        self.freeze = False  # SIGSTOP the victim (a hung node) instead of SIGKILL

    def drive(self, kill_step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        nodes = self.cluster.nodes
        while any(n.proc.poll() is None for n in nodes if not (self.freeze and n.killed)):
            if time.monotonic() > deadline:
                self.timed_out = True
                return
            if self.t_kill is None:
                p = self.read_progress()
                if (
                    p
                    and int(p.get("step", 0)) >= kill_step
                    and (self.want_world is None or p.get("world") == self.want_world)
                ):
                    self.kill_info = self.before_kill()
                    self.killed_at = int(p["step"])
                    self.t_kill = time.time()
                    if self.freeze:
                        node = nodes[self.victim()]
                        node.killed = True
                        for pid in [node.proc.pid] + descendants(node.proc.pid):
                            os.kill(pid, signal.SIGSTOP)
                        self.lines.write(
                            f"[bench] froze node {node.number} (SIGSTOP) at step {self.killed_at} at {self.t_kill:.3f}"
                        )
                    else:
                        self.cluster.kill(nodes[self.victim()], f"at step {self.killed_at}")
            time.sleep(0.02)
        for n in nodes:  # a frozen node never exits by itself
            if n.proc.poll() is None:
                kill_node(n.proc.pid)


def analyse(records: list[tuple[int, float]], t_kill: float, killed_at: int, gbs: int) -> dict:
    """records: (completed step, time) in completion order (a redone step appears again)."""
    before = [r for r in records if r[1] <= t_kill]
    after = [r for r in records if r[1] > t_kill]
    b_int = [t - pt for (s, t), (ps, pt) in zip(before[1:], before) if s == ps + 1 and s >= 3]
    a_int = [t - pt for (s, t), (ps, pt) in zip(after[1:], after) if s == ps + 1]
    out: dict[str, Any] = {}
    if not after:
        return out
    first_step, first_t = after[0]
    resumed = first_step - 1
    past = next((t for s, t in after if s > killed_at), None)
    step_after = median(a_int)
    lost = max(0, killed_at - resumed)
    out.update(
        kill_to_next_step_s=round(first_t - t_kill, 3),
        kill_to_step_past_kill_s=round(past - t_kill, 3) if past else None,
        resumed_from_step=resumed,
        lost_steps=lost,
        step_time_before_s=round(median(b_int), 3) if b_int else None,
        step_time_after_s=round(step_after, 3) if step_after else None,
        samples_s_before=round(gbs / median(b_int), 2) if b_int else None,
        samples_s_after=round(gbs / step_after, 2) if step_after else None,
    )
    if b_int and step_after:
        out["after_over_before"] = round(median(b_int) / step_after, 3)
        out["throughput_goal"] = bool(out["after_over_before"] >= GOAL_THROUGHPUT * (NODES - 1) / NODES)
    out["recovery_cost_s"] = round(first_t - t_kill + lost * (step_after or 0.0), 3)
    out["final_step"] = max(s for s, _ in records)
    return out


def rel(t: Optional[float], t0: float) -> Optional[float]:
    return None if t is None else round(t - t0, 3)


# ------------------------------------------------------------------------------------ ours
def run_ours(
    work: Path,
    etcd: EtcdServer,
    args: argparse.Namespace,
    overrides: list[str],
    register: Callable[[LocalCluster], None],
) -> dict:
    run_id = f"rec-{uuid.uuid4().hex[:6]}"
    lines = Lines(args.log_dir / f"{work.name}.log")
    script = [
        str(ROOT / "examples" / "train.py"),
        "--config",
        str(CONFIG),
        *overrides,
        f"checkpoint.dir={work / 'ck'}",
        f"logging.tensorboard_dir={work / 'tb'}",
        f"logging.events_dir={work / 'events'}",
    ]
    rdzv = OURS_RDZV.replace("lease_ttl=2", f"lease_ttl={args.lease_ttl:g}")
    cluster = LocalCluster(cluster_args(endpoint=etcd.endpoint, run_id=run_id, rdzv_conf=rdzv), script, out=lines)
    register(cluster)
    client = connect(EtcdSettings(endpoint=etcd.endpoint))
    keys = Keys("/oobleck", run_id)

    def progress() -> Optional[dict]:
        data, _ = client.get_json(keys.progress)
        return data if isinstance(data, dict) else None

    def victim() -> int:
        if args.victim != "leader":
            return VICTIM
        leader = (client.get_json(keys.leader)[0] or {}).get("node_id")
        pid = next(r.agent_pid for r in live_nodes(client, keys) if r.node_id == leader)
        return next(i for i, n in enumerate(cluster.nodes) if n.proc.pid == pid)

    def before_kill() -> dict:
        victim_pid = cluster.nodes[victim()].proc.pid
        leader, _ = client.get_json(keys.leader)
        node = next((r.node_id for r in live_nodes(client, keys) if r.agent_pid == victim_pid), None)
        prog = progress() or {}
        leader_node = leader.get("node_id", leader.get("node")) if isinstance(leader, dict) else None
        return {"victim": node, "victim_was_leader": leader_node == node, "victim_was_rank0": prog.get("node") == node}

    run = Run("oobleck", cluster, lines, progress, want_world=None)
    run.before_kill = before_kill
    run.victim = victim
    run.freeze = args.victim == "hung"
    t0 = time.time()
    try:
        for _ in range(NODES):
            cluster.start_node()
        run.drive(args.kill_step, args.timeout)
        events = [ev for _, ev in read_events(client, keys)]
    finally:
        cluster.cleanup()
        client.close()
        lines.close()
    return report_ours(run, events, read_event_lines(work / "events"), args, t0)


def report_ours(run: Run, events: list, lines: list[dict], args: argparse.Namespace, t0: float) -> dict:
    """The report of one run of ours from the etcd `events` and the workers' JSON event `lines`
    (oobleck_elastic/logs.py: `step` lines come from the worker holding rank 0)."""
    steps = [(int(e["step"]), e["t"]) for e in lines if e["event"] == "step"]
    fails = [e["t"] for e in lines if e["event"] == "comm_failed"]
    abandons = [e["t"] for e in lines if e["event"] == "step_abandoned"]
    # when each survivor's main thread saw its step fail or abandoned (before the teardown)
    seen = [e.get("seen", e["t"]) for e in lines if e["event"] in ("comm_failed", "step_abandoned")]
    enters = [
        (e["t"], e["gen"], e["step"], "rolled forward" if e.get("rolled_forward") else "")
        for e in lines
        if e["event"] == "entered"
    ]
    out: dict[str, Any] = {
        "bench": "recovery",
        "job": "a:oobleck",
        "lease_ttl_s": args.lease_ttl,
        "kill_step": args.kill_step,
        "killed_at_step": run.killed_at,
        **run.kill_info,
    }
    if run.t_kill is None:
        return {**out, "error": "the job never reached the kill step", "timed_out": run.timed_out}
    tk = run.t_kill
    out.update(analyse(steps, tk, run.killed_at, args.global_batch))
    gen2 = [e for e in enters if e[0] > tk]
    lost_ev = [e for e in events if e.kind in ("lost", "leave") and e.time > tk]
    lost = [e.time for e in lost_ev]
    plans = [e.time for e in events if e.kind == "plan" and e.time > tk]
    first_after = next((t for s, t in steps if t > tk), None)
    out["rolled_forward"] = any(e[3] == "rolled forward" for e in gen2)
    out["lost_because"] = lost_ev[0].detail if lost_ev else None
    out["timeline_s"] = {
        "first_comm_failure": rel(min((t for t in fails if t > tk), default=None), tk),
        "first_step_abandoned": rel(min((t for t in abandons if t > tk), default=None), tk),
        "last_survivor_saw_failure": rel(max((t for t in seen if t > tk), default=None), tk),
        "node_declared_lost": rel(min(lost, default=None), tk),
        "new_plan_published": rel(min(plans, default=None), tk),
        "all_entered_new_generation": rel(max((e[0] for e in gen2), default=None), tk),
        "first_step_done": rel(first_after, tk),
    }
    teardowns = [e["abort_s"] for e in lines if "abort_s" in e and e["t"] > tk]
    out["longest_teardown_s"] = max(teardowns, default=None)
    out["completed"] = out.get("final_step") == args.steps and not run.timed_out
    out["wall_s"] = round(time.time() - t0, 1)
    return out


# ------------------------------------------------------------------------------------ baseline
def run_baseline(
    work: Path, args: argparse.Namespace, overrides: list[str], register: Callable[[LocalCluster], None]
) -> dict:
    prog_dir = work / "progress"
    prog_dir.mkdir(parents=True)
    lines = Lines(args.log_dir / f"{work.name}.log")
    script = [
        str(ROOT / "bench" / "baseline_train.py"),
        "--config",
        str(CONFIG),
        "--progress-dir",
        str(prog_dir),
        "--checkpoint-every",
        str(args.checkpoint_every),
        *overrides,
        f"checkpoint.dir={work / 'ck'}",
        f"logging.tensorboard_dir={work / 'tb'}",
    ]
    port = free_port()
    cluster = BaselineCluster(cluster_args(run_id=f"rec-{uuid.uuid4().hex[:6]}"), script, out=lines, port=port)
    register(cluster)

    def progress() -> Optional[dict]:
        try:
            data = json.loads((prog_dir / "progress.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    run = Run("torchrun", cluster, lines, progress, want_world=NODES)
    t0 = time.time()
    try:
        first = cluster.start_node()
        wait_port(port, 120, lambda: first.proc.poll() is None)
        for _ in range(NODES - 1):
            cluster.start_node()
        run.drive(args.kill_step, args.timeout)
    finally:
        cluster.cleanup()
        lines.close()
    history = []
    try:
        history = [json.loads(x) for x in (prog_dir / "history.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        pass
    return report_baseline(run, history, args, t0)


def report_baseline(run: Run, history: list[dict], args: argparse.Namespace, t0: float) -> dict:
    out: dict[str, Any] = {
        "bench": "recovery",
        "job": "b:torchrun-ddp",
        "kill_step": args.kill_step,
        "killed_at_step": run.killed_at,
        "checkpoint_every": args.checkpoint_every,
    }
    restarts_before = sorted(
        {h["restart"] for h in history if h["kind"] == "step" and (run.t_kill is None or h["time"] <= run.t_kill)}
    )
    out["restarts_before_kill"] = max(restarts_before, default=0)
    if run.t_kill is None:
        return {**out, "error": "the job never reached the kill step with 4 nodes", "timed_out": run.timed_out}
    tk = run.t_kill
    steps = [(h["step"], h["time"]) for h in history if h["kind"] == "step"]
    out.update(analyse(steps, tk, run.killed_at, args.global_batch))
    after = [h for h in history if h["time"] > tk]

    def first(kind: str, key: str = "time") -> Optional[float]:
        return next((h.get(key) for h in after if h["kind"] == kind), None)

    out["world_after"] = next((h["world"] for h in after if h["kind"] == "step"), None)
    out["restarts_after_kill"] = max((h["restart"] for h in after), default=0) - out["restarts_before_kill"]
    out["timeline_s"] = {
        "first_comm_failure": rel(first("failed"), tk),
        "workers_respawned": rel(first("spawned", "time_spawned"), tk),
        "imports_done": rel(first("ready", "imported"), tk),
        "process_group_ready": rel(first("ready", "group_ready"), tk),
        "model_built": rel(first("ready", "model_built"), tk),
        "resumed_from_checkpoint": rel(first("ready"), tk),
        "first_step_done": rel(first("step"), tk),
    }
    out["completed"] = out.get("final_step") == args.steps and not run.timed_out
    out["wall_s"] = round(time.time() - t0, 1)
    return out


# ------------------------------------------------------------------------------------ main
def code_version() -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kill-step", type=int, default=10, help="SIGKILL node 1 once this many steps are done (10)")
    ap.add_argument("--steps", type=int, default=30, help="steps of each job (30)")
    ap.add_argument("--checkpoint-every", type=int, default=4, help="baseline torch.save interval in steps (4)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each job; order alternates (1)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one job may take (600)")
    ap.add_argument("--log-dir", type=Path, help="where run logs are kept (default: a new temp dir)")
    ap.add_argument("--only", choices=["a", "b"], help="run only ours (a) or only the baseline (b)")
    ap.add_argument(
        "--victim",
        choices=["node1", "leader", "hung"],
        default="node1",
        help="ours: kill launcher node 1 (default) or whichever node leads, or SIGSTOP node 1 "
        "(hung: its sockets stay open); 'leader' and 'hung' run ours only",
    )
    ap.add_argument("--lease-ttl", type=float, default=2.0, help="ours: etcd lease TTL in seconds (2)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="extra config overrides for both jobs")
    args = ap.parse_args(argv)
    if not 2 <= args.kill_step < args.steps - 3:
        ap.error("need 2 <= --kill-step < --steps - 3")
    if args.victim in ("leader", "hung"):
        if args.only == "b":
            ap.error(f"--victim {args.victim} is about ours (a)")
        args.only = "a"
    overrides = OVERRIDES + [f"training.steps={args.steps}"] + list(args.overrides)
    from oobleck_elastic.config import load_config

    args.global_batch = load_config(str(CONFIG), overrides).training.global_batch_size
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="oobleck-recovery-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"recovery: logs in {args.log_dir}", file=sys.stderr, flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="oobleck-recovery-work-"))
    overrides.append(f"data.cache_dir={scratch / 'cache'}")

    live: list[LocalCluster] = []
    etcd: Optional[EtcdServer] = None

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    results: dict[str, list[dict]] = {"a": [], "b": []}
    load0 = os.getloadavg()[0]
    try:
        if args.only != "b":
            etcd = EtcdServer().start()
        for i in range(args.repeats):
            order = ["a", "b"] if i % 2 == 0 else ["b", "a"]
            for job in order:
                if args.only and job != args.only:
                    continue
                work = scratch / f"{'a-oobleck' if job == 'a' else 'b-torchrun'}-{i}"
                work.mkdir()
                print(f"recovery: repeat {i}, job {job} ...", file=sys.stderr, flush=True)
                if job == "a":
                    res = run_ours(work, etcd, args, overrides, live.append)
                else:
                    res = run_baseline(work, args, overrides, live.append)
                res["repeat"] = i
                results[job].append(res)
                emit(res)
                shutil.rmtree(work / "ck", ignore_errors=True)
                shutil.rmtree(work / "tb", ignore_errors=True)
        emit(compare(results, args, load0))
        return 0
    except KeyboardInterrupt:
        print("recovery: interrupted; stopping every process", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for cluster in live:
            cluster.cleanup()
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def compare(results: dict[str, list[dict]], args: argparse.Namespace, load0: float) -> dict:
    def med(job: str, key: str) -> Optional[float]:
        vals = [r[key] for r in results[job] if r.get(key) is not None]
        m = median(vals)
        return round(m, 3) if m is not None else None

    a_cost, b_cost = med("a", "recovery_cost_s"), med("b", "recovery_cost_s")
    a_next = med("a", "kill_to_next_step_s")
    ratio = round(b_cost / a_cost, 2) if a_cost and b_cost else None
    ratio_past = (
        round(med("b", "kill_to_step_past_kill_s") / med("a", "kill_to_step_past_kill_s"), 2)
        if med("a", "kill_to_step_past_kill_s") and med("b", "kill_to_step_past_kill_s")
        else None
    )
    a_tp = med("a", "after_over_before")
    return {
        "bench": "recovery",
        "compare": "b:torchrun-ddp / a:oobleck",
        "repeats": args.repeats,
        "kill_step": args.kill_step,
        "steps": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "a_kill_to_next_step_s": a_next,
        "b_kill_to_next_step_s": med("b", "kill_to_next_step_s"),
        "a_lost_steps": med("a", "lost_steps"),
        "b_lost_steps": med("b", "lost_steps"),
        "a_recovery_cost_s": a_cost,
        "b_recovery_cost_s": b_cost,
        "ratio_b_over_a": ratio,
        "ratio_b_over_a_measured_to_step_past_kill": ratio_past,
        "a_after_over_before": a_tp,
        "b_after_over_before": med("b", "after_over_before"),
        "goals": {
            "a_median_under_0_5s": a_next is not None and a_next < GOAL_RECOVERY_S,
            "ratio_at_least_20x": ratio is not None and ratio >= GOAL_RATIO,
            "a_throughput_after_at_least_95pct_of_3_4": a_tp is not None and a_tp >= GOAL_THROUGHPUT * 0.75,
        },
        "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "code": code_version(),
    }


BENCH = Bench(main, quick=None)
