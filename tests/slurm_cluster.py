"""A real Slurm cluster on this machine, for tests: munge, slurmctld and N slurmd.

Debian's slurm-wlm (22.05) is built with multiple-slurmd support: one machine runs a controller
and several `slurmd -N <node>`, each on its own port of 127.0.0.1, and jobs, steps, node states
(`scontrol update nodename=... state=down`) and signals (`scancel --signal`) behave as on a
cluster. Everything lives in one scratch directory (a short path under /tmp: unix socket paths
are limited to 108 bytes): the munge key and socket, slurm.conf, the controller's state, one
spool per node, logs and job output. Ports are free ports picked at start.

`SlurmCluster.stop()` cancels every job, waits for the steps to go, then ends what is left of
them (processes holding a file in the scratch directory: slurmstepd's spool sockets, the tasks'
output files), stops the daemons by their PIDs (SIGTERM, then SIGKILL) and deletes the
directory. `start()` calls it when the cluster does not come up, so nothing outlives a failure.

With `netns=True` every node gets its own network: a network namespace per node with one address
(10.231.X.1K) and hostname (`nK`, in its own UTS namespace, with a private /etc/hosts that names
every node), all on a bridge in a switch namespace that the test's own namespace joins too (at
10.231.X.254, where slurmctld listens). slurmd enters its namespaces with `nsenter --net` and
`unshare -m -u` (not `ip netns exec`, which remounts /sys: slurmd then finds no cgroup mount), and
job steps inherit them, so the sbatch finds its etcd address with `getent` as on a cluster.
`cut(node)` takes a node's link down: its processes run on, unreachable, as after a switch or
cable failure. `stop()` deletes the namespaces too.

Needs root (slurmd runs job steps as the submitting user) and the Debian packages `munge
slurmctld slurmd slurm-client`; `missing()` says in one line what is absent. Never install
`slurm-wlm-emulator`: it switches slurmd to a front-end build in which every node is node 0.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from oobleck_elastic.etcd.server import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")


def missing(netns: bool = False) -> Optional[str]:
    """Why a Slurm cluster (with `netns`: nodes in network namespaces) cannot run here, in one line;
    None when it can."""
    absent = [b for b in BINARIES + (("ip", "nsenter", "unshare") if netns else ()) if shutil.which(b) is None]
    if absent:
        return (
            f"needs Slurm and munge ({', '.join(absent)} not found): "
            "apt-get install munge slurmctld slurmd slurm-client" + (" iproute2 util-linux" if netns else "")
        )
    if os.geteuid() != 0:
        return "needs root: slurmd runs job steps as the submitting user"
    return None


def _stepd() -> list[str]:
    """`-d slurmstepd-wlm` when it exists, so slurmd never picks up another build's slurmstepd."""
    path = shutil.which("slurmstepd-wlm")
    return ["-d", path] if path else []


class SlurmCluster:
    """munged + slurmctld + `nodes` slurmd on loopback (module docstring)."""

    def __init__(self, nodes: int = 4, cpus: int = 2, *, netns: bool = False, slurmd_timeout_s: int = 30) -> None:
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus, self.netns, self.slurmd_timeout_s = cpus, netns, slurmd_timeout_s
        self.root = Path(tempfile.mkdtemp(prefix="oobslurm-"))
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: dict[str, subprocess.Popen] = {}
        tag = "".join(c for c in self.root.name.split("-")[-1] if c.isalnum())[:6]
        self._ns = {n: f"oob{tag}{n}" for n in (*self.nodes, "sw")}
        self._host_link = f"oob{tag}"  # the test's own end of the link to the switch
        self._made_ns: list[str] = []
        self._subnet = ""

    def address(self, node: str) -> str:
        """A node's address: 127.0.0.1 on loopback, its own address with `netns`."""
        return f"{self._subnet}.{10 + self.nodes.index(node) + 1}" if self.netns else "127.0.0.1"

    @property
    def controller_address(self) -> str:
        return f"{self._subnet}.254" if self.netns else "127.0.0.1"

    def cut(self, node: str) -> None:
        """Take the node's link to the switch down (netns only)."""
        self._ip("-n", self._ns["sw"], "link", "set", f"v{node}", "down")

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        r = self.root
        for d in ("state", "log", "munge", "out", *(f"spool/{n}" for n in self.nodes)):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (r / "munge").chmod(0o711)
        self._spawn(
            "munged",
            [
                "munged",
                "-F",
                "-f",
                f"--socket={r}/munge/munge.sock",
                f"--key-file={key}",
                f"--log-file={r}/log/munged.log",
                f"--pid-file={r}/munge/munged.pid",
                f"--seed-file={r}/munge/munged.seed",
            ],
        )
        self.wait_for(lambda: (r / "munge" / "munge.sock").exists(), timeout_s, "munged to open its socket")
        if self.netns:
            self._make_network()
        ctl_port = free_port()
        node_ports = []
        while len(node_ports) < len(self.nodes):
            p = free_port()
            if p != ctl_port and p not in node_ports:
                node_ports.append(p)
        lines = [
            "ClusterName=oobtest",
            f"SlurmctldHost=localhost({self.controller_address})",
            f"SlurmctldPort={ctl_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge/munge.sock",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            "KillWait=5",
            "MinJobAge=300",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "MailProg=/bin/true",
        ]
        for node, port in zip(self.nodes, node_ports):
            host = node if self.netns else "localhost"
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr={self.address(node)} Port={port} "
                f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            slurmd = ["slurmd", "-D", "-N", node, *_stepd(), "-f", str(self.conf)]
            if self.netns:  # its own network, hostname and /etc/hosts; job steps inherit them
                inner = f"mount --bind {self.root}/hosts /etc/hosts && hostname {node} && exec {' '.join(slurmd)}"
                slurmd = ["nsenter", f"--net=/run/netns/{self._ns[node]}", "unshare", "-m", "-u", "sh", "-c", inner]
            self._spawn(f"slurmd-{node}", slurmd)
        self.wait_for(lambda: self.node_states() == {n: "idle" for n in self.nodes}, timeout_s, "every node to be idle")

    def stop(self) -> None:
        """Cancel every job, end what is left of them, stop the daemons, delete the directory."""
        if self._daemons.get("slurmctld") is not None and self._daemons["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--quiet", "--partition=debug"], check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        self._end_stray_processes()
        for name in sorted(self._daemons, key=lambda n: (n != "slurmctld", n == "munged")):
            # slurmctld takes 10 s to stop once jobs ran; its state is thrown away: 2 s, then SIGKILL
            self._terminate(self._daemons[name], grace_s=2.0 if name == "slurmctld" else 10.0)
        self._end_stray_processes()
        for ns in reversed(self._made_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def _ip(self, *args: str) -> None:
        res = subprocess.run(["ip", *args], capture_output=True, text=True)
        if res.returncode != 0:
            raise AssertionError(f"ip {' '.join(args)} exited {res.returncode}: {res.stderr.strip()}")

    def _make_network(self) -> None:
        """A switch namespace with a bridge; per node a namespace with a veth to it; one veth from
        the test's own namespace (module docstring)."""
        used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        third = next(x for x in range(1 + os.getpid() % 200, 255) if f" 10.231.{x}." not in used)
        self._subnet = f"10.231.{third}"
        sw = self._ns["sw"]
        self._ip("netns", "add", sw)
        self._made_ns.append(sw)
        self._ip("-n", sw, "link", "add", "br0", "type", "bridge")
        self._ip("-n", sw, "link", "set", "br0", "up")
        hosts = ["127.0.0.1 localhost"]
        for node in self.nodes:
            ns = self._ns[node]
            self._ip("netns", "add", ns)
            self._made_ns.append(ns)
            self._ip("link", "add", f"v{node}", "netns", sw, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("-n", sw, "link", "set", f"v{node}", "master", "br0", "up")
            self._ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            hosts.append(f"{self.address(node)} {node}")
        self._ip("link", "add", self._host_link, "type", "veth", "peer", "name", "vhost", "netns", sw)
        self._ip("-n", sw, "link", "set", "vhost", "master", "br0", "up")
        self._ip("addr", "add", f"{self.controller_address}/24", "dev", self._host_link)
        self._ip("link", "set", self._host_link, "up")
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        self._daemons[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()

    @staticmethod
    def _terminate(proc: subprocess.Popen, grace_s: float) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _end_stray_processes(self) -> None:
        """SIGKILL processes (not the daemons) that hold a file under the scratch directory."""
        ours = {p.pid for p in self._daemons.values()} | {os.getpid()}
        prefix = str(self.root) + "/"
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in ours:
                continue
            try:
                links = [os.readlink(fd) for fd in (entry / "fd").iterdir()] + [os.readlink(entry / "cwd")]
            except OSError:
                continue
            if any(link.startswith(prefix) for link in links):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    @staticmethod
    def wait_for(predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm test cluster: timed out waiting for {what}")
            time.sleep(0.3)

    # ---- commands -------------------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, check: bool = True, **kw) -> subprocess.CompletedProcess:
        res = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60, **kw)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {res.returncode}: {res.stderr.strip()}")
        return res

    def logs(self) -> str:
        """The tail of the controller's and every slurmd's log, for a failed test's message."""
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    def node_states(self) -> dict[str, str]:
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        return dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)

    def sbatch(self, script: Path, args: Sequence[str], *, cwd: Path, env: dict[str, str]) -> str:
        """Submit `script` with sbatch `args` (and `env` added to the job's environment); its job id."""
        res = subprocess.run(
            ["sbatch", "--parsable", f"--output={self.root}/out/job-%j.out", *args, str(script)],
            cwd=cwd,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, f"sbatch exited {res.returncode}: {res.stderr}"
        return res.stdout.strip().split(";")[0]

    def output(self, job: str) -> str:
        path = self.root / "out" / f"job-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, ...)."""
        res = self.run(["scontrol", "-o", "show", "job", job])
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", res.stdout))

    def wait_job(self, job: str, timeout_s: float) -> dict[str, str]:
        """The job's record once it left PENDING/RUNNING (its steps' processes gone too)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job)
            if info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job} still {info.get('JobState')} after {timeout_s:.0f} s; its output:\n"
                    + self.output(job)[-5000:]
                )
            time.sleep(0.5)

    def step_on(self, job: str, node: str, name: str = "torchrun") -> str:
        """The id (`job.step`) of the job's running step named `name` on `node`."""
        res = self.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j %N"], check=False)
        found = [f[0] for f in (line.split() for line in res.stdout.splitlines()) if f[1:] == [name, node]]
        assert len(found) == 1, f"expected one {name} step of job {job} on {node}:\n{res.stdout}"
        return found[0]
