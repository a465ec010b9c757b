"""Recovery against the number of simultaneous losses, with and without host-memory shadow copies.

What it shows: with `fault_tolerance.shadow_copies` = s, a job with f + 1 device copies of every
layer survives any k <= f + s simultaneous node losses from memory (a surviving replica or shadow
copy, engine/step/shadows.py); past that it restores the newest checkpoint (disk).

Method. `--nodes` (default 7) simulated nodes on this machine (`launcher.local.LocalCluster`, one
torchrun agent and one worker per node, an etcd started here), configs/gpt2-tiny.yaml with the
overrides of bench/recovery.py, planned from a synthetic profile (6 layers of 0.45 GiB on 1 GiB
devices: at least 3 nodes per pipeline, so 7 nodes make 2 pipelines and every layer has exactly 2
device copies, and 3 nodes left after 4 losses still make one), f = 1, a checkpoint every
`--checkpoint-every` steps (the disk the job falls back to). For each setting s in `--shadows`
(default 0 1 2) and each k in `--kills` (default 1 2 3 4), one job: as soon as it reports `--kill-step`
completed steps, k nodes are SIGKILLed at the same moment (`launcher.faults.kill_node`, one
after another in a few ms), chosen adversarially from the plan in etcd: the device holders of
layer 0 first, then the nodes keeping its shadow copies, then the holders and keepers of the last
layer, then the others in plan order. The survivors go on to `--steps`.

Reported per run (one JSON line): `kill_to_next_step_s` (SIGKILL -> the first step completed in a
generation after the one the kill hit: the interrupted step replayed or rolled forward, or the
first step after a restore; a victim may still log the step in flight as it dies, which does not
count), `lost_steps` (completed steps trained again: the steps completed before the new
generation, the victims' last included, minus the step it resumed from; 0 unless it restored a
checkpoint), `source` (where the layers that lost every device copy came from: `replica` when none
did, `shadow` (the `from_shadows` event), `disk` (the `restored` event)), `bytes_moved` (layer
bytes sent plus received by the workers entering the next generation, the `entered` events,
halved: each byte is counted by its sender and receiver), `victims`, `completed` (the job reached
its last step). A last line per setting gives the table row. bench/RESULTS.md keeps the table with
the command and commit.

Run (about 30-40 s per job on 2 cores; 12 jobs by default):

    .venv/bin/python -m bench losses [--shadows 0 1 2] [--kills 1 2 3 4] [--nodes 7] [--kill-step 6]
        [--steps 14] [--checkpoint-every 4] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from bench.harness import Bench, emit


from bench.recovery import CONFIG, OURS_RDZV, OVERRIDES, Lines, cluster_args

from launcher.faults import kill_node
from launcher.local import LocalCluster
from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.etcd.server import EtcdServer
from oobleck_elastic.logs import read_event_lines
from oobleck_elastic.planning import Plan
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.rendezvous.membership import live_nodes
from oobleck_elastic.testing import uniform_profile

ROOT = Path(__file__).resolve().parents[1]


def victims(plan: Plan, k: int) -> list[str]:
    """The k nodes to kill, adversarially (module docstring)."""
    order: list[str] = []
    for layer in (0, plan.num_layers - 1):
        holders = [s.node for p in plan.pipelines for s in p.stages if s.holds(layer)]
        keepers = list(plan.shadows.layers[layer]) if plan.shadows is not None else []
        order += holders + keepers
    order += list(plan.nodes)
    return list(dict.fromkeys(order))[:k]


def recovery_figures(events: list[dict], t_kill: float, steps: int) -> dict[str, Any]:
    """From the workers' event lines: kill -> the first step completed in a generation after the
    one the kill hit (a victim may still log the step in flight before it dies), the steps done
    before and resumed from (completed counts), and whether the job reached its last step."""
    done = [e for e in events if e["event"] == "step"]
    gen_at_kill = max((int(e["gen"]) for e in events if e["t"] <= t_kill and e.get("gen") is not None), default=0)
    before = [int(e["step"]) for e in done if int(e["gen"]) <= gen_at_kill]
    after = sorted((e["t"], int(e["step"])) for e in done if int(e["gen"]) > gen_at_kill)
    if not after:
        return {"completed": False}
    t_first, first = after[0]
    resumed = first - 1
    return {
        "kill_to_next_step_s": round(t_first - t_kill, 3),
        "steps_done_before": max(before, default=0),
        "resumed_from_step": resumed,
        "lost_steps": max(0, max(before, default=0) - resumed),
        "final_step": max(s for _, s in after),
        "completed": max(s for _, s in after) == steps,
    }


def one_job(work: Path, etcd: EtcdServer, args: argparse.Namespace, shadows: int, k: int) -> dict[str, Any]:
    run_id = f"loss-{uuid.uuid4().hex[:6]}"
    lines = Lines(args.log_dir / f"{work.name}.log")
    script = [
        str(ROOT / "examples" / "train.py"),
        "--config",
        str(CONFIG),
        *OVERRIDES,
        f"training.steps={args.steps}",
        "fault_tolerance.f=1",
        f"fault_tolerance.shadow_copies={shadows}",
        "planning.host_memory_gb=4",
        f"planning.profile_path={work.parent / 'profile.json'}",
        "planning.device_memory_gb=1",
        "planning.memory_margin=0",
        f"checkpoint.interval_steps={args.checkpoint_every}",
        f"checkpoint.dir={work / 'ck'}",
        f"data.cache_dir={work / 'cache'}",
        f"logging.tensorboard_dir={work / 'tb'}",
        f"logging.events_dir={work / 'events'}",
    ]
    cluster = LocalCluster(
        cluster_args(
            nodes=args.nodes,
            max_nodes=args.nodes,
            min_nodes=1,
            endpoint=etcd.endpoint,
            run_id=run_id,
            rdzv_conf=OURS_RDZV,
        ),
        script,
        out=lines,
    )
    client = connect(EtcdSettings(endpoint=etcd.endpoint))
    keys = Keys("/oobleck", run_id)
    out: dict[str, Any] = {"bench": "losses", "shadow_copies": shadows, "k": k, "nodes": args.nodes}
    t_kill: Optional[float] = None
    killed_at = 0
    t0 = time.time()
    try:
        for _ in range(args.nodes):
            cluster.start_node()
        deadline = time.monotonic() + args.timeout
        while any(n.proc.poll() is None for n in cluster.nodes):
            if time.monotonic() > deadline:
                out["timed_out"] = True
                break
            if t_kill is None:
                progress = client.get_json(keys.progress)[0] or {}
                if isinstance(progress, dict) and int(progress.get("step", 0)) >= args.kill_step:
                    plan = Plan.from_json(client.get_json(keys.plan)[0])
                    chosen = victims(plan, k)
                    pids = {r.node_id: r.agent_pid for r in live_nodes(client, keys)}
                    killed_at = int(progress["step"])
                    t_kill = time.time()
                    for node in chosen:
                        kill_node(pids[node])
                    for n in cluster.nodes:
                        if n.proc.pid in {pids[v] for v in chosen}:
                            n.killed = True
                    lines.write(f"[bench] killed {chosen} at step {killed_at} at {t_kill:.3f}")
                    out["victims"] = chosen
                    out["shadows_of_layer_0"] = list(plan.shadows.layers[0]) if plan.shadows else []
            time.sleep(0.02)
    finally:
        cluster.cleanup()
        client.close()
        lines.close()
    events = read_event_lines(work / "events")
    if t_kill is None:
        return {**out, "error": "the job never reached the kill step"}
    out["killed_at_step"] = killed_at
    out.update(recovery_figures(events, t_kill, args.steps))
    after = [e for e in events if e["t"] > t_kill]
    restored = any(e["event"] == "restored" for e in after)
    shadowed = any(e["event"] == "from_shadows" for e in after)
    out["source"] = "disk" if restored else "shadow" if shadowed else "replica"
    out["bytes_moved"] = sum(int(e.get("bytes", 0)) for e in after if e["event"] == "entered") // 2
    out["wall_s"] = round(time.time() - t0, 1)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shadows", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--kills", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--nodes", type=int, default=7)
    ap.add_argument("--kill-step", type=int, default=6)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--log-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-losses-logs-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {args.log_dir}", file=sys.stderr)
    rows: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-losses-") as d, EtcdServer(data_dir=str(Path(d) / "etcd")) as etcd:
        # gpt2-tiny's 6 layers planned as 0.45 GiB each on 1 GiB devices: 2 layers per device, so
        # pipelines of 3 nodes or more and, on 7 nodes with f = 1, exactly 2 device copies of every layer
        uniform_profile(6, gib_per_layer=0.45).save(Path(d) / "profile.json")
        for shadows in args.shadows:
            for k in args.kills:
                work = Path(d) / f"s{shadows}-k{k}"
                work.mkdir()
                row = one_job(work, etcd, args, shadows, k)
                emit(row)
                rows.setdefault(shadows, []).append(row)
    for shadows, runs in rows.items():
        cells = {
            r["k"]: f"{r.get('source')} {r.get('kill_to_next_step_s')} s, {r.get('lost_steps')} lost"
            + ("" if r.get("completed") else " (not completed)")
            for r in runs
        }
        emit({"bench": "losses", "summary": True, "shadow_copies": shadows, "by_k": cells})
    return 0


BENCH = Bench(main, quick=None)
