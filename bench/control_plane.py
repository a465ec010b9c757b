"""The control plane at scale: N simulated agents against one local etcd.

Each simulated agent runs the real rendezvous code a node's torchrun agent runs, without torch
workers: `Member` (registration, lease keep-alive), a `Mirror` of `Keys.agent_watched` and a
`Leader` thread (election, deputy, planning with the real planner over a 6-layer profile). The
agents live in `--procs` processes (threads inside), and connect to etcd as `--clients` says:

- `per-agent` (the default): every agent has its own etcd client, as a node's agent has: its own
  gRPC channel and TCP connection (`connect(..., own_connection=True)`: gRPC would otherwise
  share one connection between the channels of a process), its own watch stream and its own
  keep-alive stream. etcd serves N connections, N watch streams and N keep-alive streams.
- `shared`: the agents of one process share one client, so one TCP connection, one watch stream
  and one keep-alive stream per process: the same requests and watches, fewer connections and
  streams (`--procs` of each).
- `both`: each N in both ways, per-agent first, each against a fresh etcd.

Either way each agent keeps its own lease, keys, mirror and watches. Each JSON line says which
way ran (`clients`), how many clients there were (`etcd_clients`), the TCP connections to etcd
the agent processes held (`etcd_connections`, counted from /proc) and the watch and keep-alive
streams open in etcd (its /metrics). Measured per N:

- `register_s`: start -> all N node records present;
- `first_plan_s`: all present -> generation 1 published (the leader plans N nodes, `max_nodes=N`);
- steady state, over `--window` seconds after the plan: etcd requests/s (gRPC messages received
  by etcd, from its /metrics), split into lease keep-alives (one per node every TTL/3: the cost
  of liveness) and everything else (which must not grow with N: nobody polls), the keep-alive
  streams opened (0: each client refreshes its leases down one stream it keeps open), and bytes/s
  in and out of etcd;
- `leader_cpu`: CPU seconds per second of the leader's thread over the window;
- the cost of the agents: CPU seconds per second of the agent processes (all threads) and of
  etcd over the window, the agents' per agent (milliseconds per second), and threads per agent;
- `generations_in_window`: plans published during the window (0 unless a lease expired that was
  refreshed on time: the sign that keep-alives do not keep up), beside
  `keepalives_expected_per_s` (N per TTL/3);
- `kill_to_plan_s`: `--kill` agents stop at once without revoking anything and their liveness
  sockets close (what a SIGKILL looks like to etcd and to the leader) -> the next plan is
  published: the leader's liveness verdict + 50 ms batch + planning (with `--no-liveness`: lease
  TTL + settle + planning); a plan that does not come within `--kill-wait` seconds leaves it null
  and says so in `kill_failed`;
- `replan_tx_bytes`: bytes out of etcd from the kill to 1 s after that plan: the watch events that
  bring the new roster to every agent and the plan to the leader, plus this script's own polling
  of the roster (every 0.1 s) and the keep-alives of the window.

Before the agents stop, the job is closed (`closed`), as a finished job is: leaving agents then
elect no new leader and nobody re-plans 1,000 departures.

One JSON line per N on stdout; progress on stderr. Run:

    .venv/bin/python -m bench control_plane [--nodes 64 256 1000] [--clients per-agent|shared|both]
        [--kill 4] [--lease-ttl 5] [--settle 0.5] [--window 10] [--procs 4] [--no-liveness]

etcd is started here (a temp data dir) and stopped by PID at the end, as are the agent processes.
With a client per agent a process holds a socket per agent and its liveness sockets; the script
raises its soft open-files limit to the hard one (children inherit it) and says so on stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import resource
import signal
import sys
import time
import urllib.request
import uuid
from pathlib import Path


from bench.harness import Bench, emit

from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.etcd.server import EtcdServer
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.job import ClosedRecord
from oobleck_elastic.records.read import read_roster

ROOT = Path(__file__).resolve().parents[1]


def _planner(nodes_total: int):
    from oobleck_elastic.config import load_config
    from oobleck_elastic.planning import plan_job, templates_for
    from oobleck_elastic.testing import uniform_profile

    profile = uniform_profile()
    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "planning.device_memory_gb=1.25",
            "planning.memory_margin=0",
            "planning.gpus_per_node=1",
            f"training.global_batch_size={8 * nodes_total}",
            "training.microbatch_size=2",
        ],
    )
    templates = templates_for(cfg, profile)
    return lambda nodes, generation, previous: (
        plan_job(cfg, nodes=nodes, generation=generation, templates=templates, previous=previous).plan
    )


def _thread_cpu_s(native_id: int) -> float:
    return _process_cpu_s(f"self/task/{native_id}")


def _process_cpu_s(pid: int | str) -> float:
    """CPU seconds (user + system) of a process (or `self/task/<tid>`: a thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def agents_process(
    endpoint: str,
    run_id: str,
    count: int,
    total: int,
    ttl: float,
    settle: float,
    commands: mp.Queue,
    answers: mp.Queue,
    liveness: bool = True,
    per_agent: bool = True,
) -> None:
    """Host `count` agents, each with its own etcd client (`per_agent`) or all on one; obey
    commands: ("kill", k) stops k agents that do not lead, like a SIGKILL (their clients close);
    ("cpu",) answers the leader thread's CPU seconds if it is here, this process's CPU seconds and
    its thread count; ("stop",) ends."""
    from oobleck_elastic.etcd.mirror import Mirror
    from oobleck_elastic.rendezvous.leader import Leader
    from oobleck_elastic.rendezvous.liveness import LivenessServer
    from oobleck_elastic.rendezvous.membership import Member

    settings = EtcdSettings(endpoint=endpoint, timeout_s=10.0)
    shared = None if per_agent else connect(settings)
    keys = Keys("/oobleck", run_id)
    planner = _planner(total)
    agents = []
    for _ in range(count):
        client = shared if shared is not None else connect(settings, own_connection=True)
        server = LivenessServer("127.0.0.1") if liveness else None
        member = Member(
            client, keys, devices=1, lease_ttl_s=ttl, host="sim", liveness=server.address if server is not None else ""
        )
        member.register()
        view = Mirror(client, keys.agent_watched(member.node_id), name=f"agent {member.node_id}").start()
        leader = Leader(
            client,
            keys,
            member,
            planner=planner,
            min_nodes=total,
            max_nodes=total,
            last_call_s=1.0,
            settle_s=settle,
            view=view,
        )
        leader.start()
        agents.append((member, view, leader, server, client))
    answers.put(("ready", count))
    while True:
        command = commands.get()
        if command[0] == "kill":
            victims = [a for a in agents if not a[2].is_leader.is_set()][: command[1]]
            for *_, server, _ in victims:  # first, all at once: the kernel closes a killed agent's sockets
                if server is not None:
                    server.close(goodbye=False)
            for victim in victims:
                member, view, leader, _, client = victim
                leader.stop()
                member.close(revoke=False)
                view.close()
                if client is not shared:
                    client.close()
                agents.remove(victim)
            answers.put(("killed", len(victims)))
        elif command[0] == "cpu":
            here = [a[2] for a in agents if a[2].is_leader.is_set() and a[2]._thread is not None]
            leader_cpu = _thread_cpu_s(here[0]._thread.native_id) if here else None
            answers.put(("cpu", leader_cpu, time.process_time(), len(os.listdir("/proc/self/task"))))
        else:
            for _, _, leader, _, _ in agents:  # the job is closed: nobody leads or plans any more
                leader.stop()
            for member, *_ in agents:  # then every lease goes, before any client closes
                member.close(revoke=True)
            for _, view, _, server, client in agents:
                view.close()
                if server is not None:
                    server.close()
                if client is not shared:
                    client.close()
            if shared is not None:
                shared.close()
            answers.put(("stopped", 0))
            return


def etcd_metrics(server: EtcdServer) -> dict[str, float]:
    """Totals from etcd's /metrics: requests by method (gRPC messages received), calls (streams)
    started and handled (ended) by method, bytes in and out."""
    text = urllib.request.urlopen(f"{server.client_url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {"rx_bytes": 0.0, "tx_bytes": 0.0}
    for line in text.splitlines():
        m = re.match(r'grpc_server_msg_received_total\{.*grpc_method="(\w+)".*\} ([0-9.e+]+)', line)
        if m:
            out[f"req:{m.group(1)}"] = out.get(f"req:{m.group(1)}", 0.0) + float(m.group(2))
        m = re.match(r'grpc_server_started_total\{.*grpc_method="(\w+)".*\} ([0-9.e+]+)', line)
        if m:
            out[f"started:{m.group(1)}"] = out.get(f"started:{m.group(1)}", 0.0) + float(m.group(2))
        m = re.match(r'grpc_server_handled_total\{.*grpc_method="(\w+)".*\} ([0-9.e+]+)', line)
        if m:
            out[f"handled:{m.group(1)}"] = out.get(f"handled:{m.group(1)}", 0.0) + float(m.group(2))
        m = re.match(r"etcd_network_client_grpc_(received|sent)_bytes_total ([0-9.e+]+)", line)
        if m:
            out["rx_bytes" if m.group(1) == "received" else "tx_bytes"] += float(m.group(2))
    return out


def etcd_connections(pids: list[int], port: int) -> int:
    """Established TCP connections from the processes `pids` to `port` (etcd's client port): their
    socket inodes (/proc/<pid>/fd) matched against the kernel's table (/proc/net/tcp, tcp6)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed since the listing
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            state, remote, inode = fields[3], fields[2], fields[9]
            if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port and inode in inodes:
                found += 1
    return found


def raise_open_files_limit() -> int:
    """Raise this process's soft open-files limit to the hard one (the agent processes inherit
    it); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        print(f"open-files limit raised from {soft} to {hard} (soft = hard)", file=sys.stderr)
    return hard if soft < hard else soft


def _wait(what: str, predicate, timeout: float, poll_s: float = 0.02, workers: list | None = None) -> float:
    t0 = time.monotonic()
    while not predicate():
        dead = [w.pid for w in workers or [] if not w.is_alive()]
        if dead:
            raise RuntimeError(f"{what}: agent processes {dead} died (their stderr says why)")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(poll_s)
    return time.monotonic() - t0


def run(
    n: int,
    *,
    procs: int,
    kill: int,
    ttl: float,
    settle: float,
    window: float,
    liveness: bool = True,
    clients: str = "per-agent",
    kill_wait: float = 120.0,
) -> dict:
    if clients not in ("per-agent", "shared"):
        raise ValueError(f"clients={clients!r}: use 'per-agent' or 'shared'")
    per_agent = clients == "per-agent"
    files_limit = raise_open_files_limit()
    ctx = mp.get_context("spawn")
    run_id = uuid.uuid4().hex[:8]
    keys = Keys("/oobleck", run_id)
    with EtcdServer(extra_args=["--unsafe-no-fsync", "--max-request-bytes", str(8 * 1024 * 1024)]) as server:
        client = connect(EtcdSettings(endpoint=server.endpoint, timeout_s=10.0))
        workers, channels = [], []
        try:
            procs = max(1, min(procs, n))
            t0 = time.monotonic()
            for p in range(procs):
                commands, answers = ctx.Queue(), ctx.Queue()
                count = n // procs + (1 if p < n % procs else 0)
                proc = ctx.Process(
                    target=agents_process,
                    args=(server.endpoint, run_id, count, n, ttl, settle, commands, answers, liveness, per_agent),
                    daemon=True,
                )
                proc.start()
                workers.append(proc)
                channels.append((commands, answers))
            _wait("all nodes registered", lambda: client.count(keys.nodes) >= n, 600, workers=workers)
            register_s = time.monotonic() - t0
            print(f"[N={n}, clients {clients}] {n} nodes registered in {register_s:.1f} s", file=sys.stderr)

            def generation() -> int:  # from the small roster: polling the plan would be most of the traffic
                roster = read_roster(client, keys)
                return roster.generation if roster is not None else 0

            first_plan_s = _wait("first plan", lambda: generation() >= 1, 600, workers=workers)
            print(f"[N={n}] generation 1 published {first_plan_s:.2f} s after all were present", file=sys.stderr)
            for _, answers in channels:
                answers.get(timeout=600)  # every agent has started (mirrors and leader threads)
            time.sleep(max(2.0, ttl))

            def cpu() -> tuple[float, float, float, int]:
                """(leader thread, agent processes, etcd) CPU seconds so far, and the agents' threads."""
                for commands, _ in channels:
                    commands.put(("cpu",))
                found = [answers.get(timeout=60)[1:] for _, answers in channels]
                leader = next((c[0] for c in found if c[0] is not None), float("nan"))
                return leader, sum(c[1] for c in found), _process_cpu_s(server.pid), sum(c[2] for c in found)

            g0 = generation()
            (cpu0, agents0, etcd0, threads), m0, w0 = cpu(), etcd_metrics(server), time.monotonic()
            time.sleep(window)
            (cpu1, agents1, etcd1, _), m1, w1 = cpu(), etcd_metrics(server), time.monotonic()
            connections = etcd_connections([w.pid for w in workers], int(server.endpoint.rsplit(":", 1)[1]))
            g = generation()

            def open_streams(method: str) -> int:
                return round(m1.get(f"started:{method}", 0.0) - m1.get(f"handled:{method}", 0.0))

            span = w1 - w0
            agents_cpu, etcd_cpu = (agents1 - agents0) / span, (etcd1 - etcd0) / span
            rates = {k: (m1.get(k, 0.0) - m0.get(k, 0.0)) / span for k in m1}
            keepalive = rates.get("req:LeaseKeepAlive", 0.0)
            total = sum(v for k, v in rates.items() if k.startswith("req:"))
            others = {
                k[4:]: round(v, 2)
                for k, v in rates.items()
                if k.startswith("req:") and v > 0 and k != "req:LeaseKeepAlive"
            }
            print(
                f"[N={n}, clients {clients}] {connections} connections to etcd, "
                f"{open_streams('LeaseKeepAlive')} keep-alive and {open_streams('Watch')} watch streams open; "
                f"steady: {total:.1f} req/s ({keepalive:.1f} keep-alives of {n * 3 / ttl:.0f} expected), "
                f"{rates['tx_bytes'] / 1024:.1f} KiB/s out of etcd; CPU: agents {agents_cpu:.3f} s/s "
                f"({1000 * agents_cpu / n:.3f} ms/s per agent), etcd {etcd_cpu:.3f} s/s",
                file=sys.stderr,
            )

            result = {
                "bench": "control_plane",
                "nodes": n,
                "clients": clients,
                "procs": procs,
                "agents_per_proc": f"{n // procs}" + (f"-{n // procs + 1}" if n % procs else ""),
                "etcd_clients": n if per_agent else procs,
                "etcd_connections": connections,
                "keepalive_streams_open": open_streams("LeaseKeepAlive"),
                "watch_streams_open": open_streams("Watch"),
                "open_files_limit": files_limit,
                "lease_ttl_s": ttl,
                "settle_s": settle,
                "liveness": liveness,
                "register_s": round(register_s, 2),
                "first_plan_s": round(first_plan_s, 3),
                "steady_requests_per_s": round(total, 2),
                "steady_keepalives_per_s": round(keepalive, 2),
                "keepalives_expected_per_s": round(n * 3 / ttl, 2),
                "generations_in_window": g - g0,
                "steady_other_requests_per_s": round(total - keepalive, 2),
                # 0: every keep-alive goes down a stream opened before the window (etcd/keepalive.py)
                "steady_keepalive_streams_opened_per_s": round(rates.get("started:LeaseKeepAlive", 0.0), 2),
                "other_requests_by_method": others,
                "steady_rx_bytes_per_s": round(rates["rx_bytes"]),
                "steady_tx_bytes_per_s": round(rates["tx_bytes"]),
                "leader_cpu_s_per_s": round((cpu1 - cpu0) / span, 4),
                "agents_cpu_s_per_s": round(agents_cpu, 4),
                "agent_cpu_ms_per_s": round(1000 * agents_cpu / n, 4),
                "etcd_cpu_s_per_s": round(etcd_cpu, 4),
                "threads_per_agent": round(threads / n, 2),
            }
            commands, answers = channels[-1]
            before = etcd_metrics(server)
            t_kill = time.monotonic()
            commands.put(("kill", kill))
            result["killed"] = answers.get(timeout=60)[1]
            try:
                _wait("plan after the kill", lambda: generation() > g, kill_wait, poll_s=0.02, workers=workers)
            except TimeoutError as err:  # the steady figures stand; say that the re-plan did not come
                result.update(kill_to_plan_s=None, replan_tx_bytes=None, kill_failed=str(err))
                print(f"[N={n}, clients {clients}] {err}", file=sys.stderr)
                return result
            kill_to_plan_s = time.monotonic() - t_kill
            time.sleep(1.0)  # the watch traffic of the new plan reaches every agent
            replan_tx = etcd_metrics(server)["tx_bytes"] - before["tx_bytes"]
            print(
                f"[N={n}, clients {clients}] {result['killed']} agents killed: generation {g + 1} published "
                f"{kill_to_plan_s:.2f} s later",
                file=sys.stderr,
            )
            result.update(kill_to_plan_s=round(kill_to_plan_s, 3), replan_tx_bytes=round(replan_tx))
            return result
        finally:
            # a finished job: leaving agents elect no new leader, nobody re-plans their departures
            try:
                client.put_json(keys.closed, ClosedRecord(time=time.time(), reason="benchmark over").to_json())
            except Exception as err:  # noqa: BLE001 - stopping the agents matters more
                print(f"[N={n}] could not close the job: {err}", file=sys.stderr)
            for commands, _ in channels:
                commands.put(("stop",))
            for proc in workers:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
            client.close()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds: agents and etcd are stopped by PID


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1000])
    ap.add_argument("--kill", type=int, default=4, help="agents killed at once (default 4)")
    ap.add_argument(
        "--lease-ttl", type=float, default=5.0, help="lease TTL, seconds (default 5, as fault_tolerance.lease_ttl_s)"
    )
    ap.add_argument("--settle", type=float, default=0.5)
    ap.add_argument("--window", type=float, default=10.0, help="steady-state measurement window, seconds")
    ap.add_argument("--procs", type=int, default=4, help="processes hosting the agents")
    ap.add_argument(
        "--kill-wait",
        type=float,
        default=120.0,
        help="seconds to wait for the plan after the kill before reporting it missing (default 120)",
    )
    ap.add_argument(
        "--clients",
        choices=("per-agent", "shared", "both"),
        default="per-agent",
        help="an etcd client (connection, watch and keep-alive streams) per agent, one per process, or "
        "each N both ways (default per-agent)",
    )
    ap.add_argument(
        "--no-liveness",
        action="store_true",
        help="agents without liveness sockets: a kill is found by lease expiry only",
    )
    args = ap.parse_args(argv)
    modes = ("per-agent", "shared") if args.clients == "both" else (args.clients,)
    for n in args.nodes:
        for mode in modes:
            try:
                result = run(
                    n,
                    procs=args.procs,
                    kill=args.kill,
                    ttl=args.lease_ttl,
                    settle=args.settle,
                    window=args.window,
                    liveness=not args.no_liveness,
                    clients=mode,
                    kill_wait=args.kill_wait,
                )
            except (TimeoutError, RuntimeError) as err:  # this N did not run: say so, go on with the next
                result = {
                    "bench": "control_plane",
                    "nodes": n,
                    "clients": mode,
                    "procs": args.procs,
                    "failed": str(err),
                }
            emit(result)


BENCH = Bench(main, quick=("--nodes", "16", "--window", "2", "--procs", "2"))
