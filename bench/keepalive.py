"""An agent's lease keep-alive under load: the worst gap between two refreshes etcd answered,
while the same process plans 1,024 nodes without pause, workers compile beside it and busy loops
take every core twice over.

The keep-alive runs in its own thread of the agent (rendezvous/membership.py) and refreshes every
TTL/3; a gap past the TTL would let etcd expire the lease of a live node. The bench runs an agent's
`Member` on an etcd started here, calls `plan_job` for GPT-3 175B on 1,024 nodes (tp 8) in a loop
in the same process (the leader's planning: pure Python, the heaviest work an agent does), and
starts `--compilers` processes that compile a small model with torch.compile again and again
(workers warming up) and `--busy-per-core` pure-Python busy loops per core. One JSON line: the
refreshes, the worst and median gap between answered refreshes, the gap over the TTL, expiries
and whether the node was fenced. What it shows: docs/liveness.md#slow-is-not-dead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

from bench.harness import ROOT, Bench, emit

COMPILER = """
import time, torch
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
end = time.time() + {seconds}
while time.time() < end:
    torch._dynamo.reset()  # compile from scratch each round, as a worker's warm-up does
    torch.compile(model)(torch.randn(4, 256)).sum().backward()
"""


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to plan under load (60)")
    ap.add_argument("--ttl", type=float, default=2.0, help="the lease TTL in seconds (2, as the tests use)")
    ap.add_argument("--busy-per-core", type=int, default=2, help="busy loops per core (2)")
    ap.add_argument("--compilers", type=int, default=2, help="processes compiling beside the agent (2)")
    args = ap.parse_args(argv)

    from oobleck_elastic.config import load_config
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.etcd.server import EtcdServer
    from oobleck_elastic.planning import plan_job
    from oobleck_elastic.planning.profile.analytic import gpt3_175b_profile
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.rendezvous.membership import Member

    cfg = load_config(str(ROOT / "configs" / "gpt3-175b.yaml"), ["planning.tensor_parallel=8"])
    profile = gpt3_175b_profile(tensor_parallel=8)
    load = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(args.busy_per_core * (os.cpu_count() or 1))
    ]
    code = COMPILER.format(seconds=args.seconds + 30)
    load += [subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL) for _ in range(args.compilers)]
    etcd = EtcdServer().start()
    client = connect(EtcdSettings(endpoint=etcd.endpoint))
    answered: list[tuple[float, int]] = []
    refresh = client.refresh_lease

    def timed(lease: int) -> int:
        ttl = refresh(lease)
        answered.append((time.monotonic(), ttl))
        return ttl

    client.refresh_lease = timed  # type: ignore[method-assign]
    member = Member(client, Keys("/oobleck", "keepalive-bench"), devices=1, lease_ttl_s=args.ttl)
    plans = 0
    try:
        member.register()
        end = time.monotonic() + args.seconds
        while time.monotonic() < end and not member.fenced.is_set():
            plan_job(cfg, nodes=1024, profile=profile)
            plans += 1
    finally:
        member.close()
        client.close()
        etcd.stop()
        for p in load:
            p.kill()
            p.wait()
    alive = [t for t, ttl in answered if ttl > 0]
    gaps = [b - a for a, b in zip(alive, alive[1:])]
    worst = max(gaps, default=float("nan"))
    emit(
        {
            "seconds": args.seconds,
            "lease_ttl_s": args.ttl,
            "refresh_every_s": round(args.ttl / 3, 3),
            "busy_loops": args.busy_per_core * (os.cpu_count() or 1),
            "compilers": args.compilers,
            "plans_of_1024_nodes": plans,
            "refreshes": len(answered),
            "expired": sum(ttl <= 0 for _, ttl in answered),
            "worst_gap_s": round(worst, 3),
            "median_gap_s": round(statistics.median(gaps), 3) if gaps else None,
            "worst_gap_over_ttl": round(worst / args.ttl, 3),
            "fenced": member.fenced.is_set(),
            "fence_reason": member.fence_reason,
        }
    )
    return 1 if member.fenced.is_set() else 0


BENCH = Bench(main, quick=("--seconds", "15"))
