"""launcher/slurm/oobleck.sbatch on a real Slurm (tests/slurm_cluster.py: munge, slurmctld and four
slurmd on this machine, on loopback or in network namespaces). The job trains gpt2-tiny (two 2-stage
pipelines on four nodes); Slurm takes a node away (`scontrol update ... state=down`), its link is
cut, or a preemption notice reaches it (`scancel --signal=TERM` of its step); a second allocation
joins a run whose etcd runs outside Slurm. Each time the job must end with the single-process
reference's weights and Slurm must report it COMPLETED, with nothing left behind (etcd data,
processes, namespaces)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from oobleck_elastic.config import load_config
from oobleck_elastic.engine.run import train
from oobleck_elastic.etcd import EtcdError, EtcdSettings, connect
from oobleck_elastic.etcd.server import free_port, start_cluster
from oobleck_elastic.checkpoint import load_model_state
from oobleck_elastic.records.keys import Keys
from oobleck_elastic.records.read import read_progress
from helpers import assert_same, overrides, tiny_profile
from slurm_cluster import SlurmCluster, missing

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launcher" / "slurm" / "oobleck.sbatch"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=str(missing()))]


@pytest.fixture
def slurm():
    cluster = SlurmCluster(nodes=4).start()
    try:
        yield cluster
    finally:
        cluster.stop()


class Job:
    """One submission of oobleck.sbatch: its Slurm job id, etcd endpoint and run keys."""

    def __init__(
        self, slurm: SlurmCluster, tmp: Path, steps: int, *, nodes: int = 4, env: Optional[dict] = None
    ) -> None:
        self.slurm, self.tmp = slurm, tmp
        profile = tmp / "profile.json"  # written once: a second job of the same run reads it
        if not profile.exists():
            tiny_profile(profile)
        self.overrides = overrides(tmp / "job", steps, profile)
        self.reference = overrides(tmp / "ref", steps, profile)
        self.etcd_port = free_port()
        self.etcd_data = slurm.root / f"etcd-{self.etcd_port}"
        job_env = {
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # torchrun, oobleck, python
            "CONFIG": "configs/gpt2-tiny.yaml",
            "TRAIN_ARGS": " ".join(self.overrides),
            "MIN_NODES": "2",
            "GPUS_PER_NODE": "1",
            "ETCD_PORT": str(self.etcd_port),
            "ETCD_DATA_DIR": str(self.etcd_data),
            "RDZV_CONF": "lease_ttl=2,settle=0.2,last_call_timeout=1",
            **({} if slurm.netns else {"ETCD_IP": "127.0.0.1"}),  # loopback: every node is this machine
            **(env or {}),
        }
        self.endpoint = job_env.get("ETCD_ENDPOINT") or f"{slurm.address('n1')}:{self.etcd_port}"
        args = [f"--nodes={nodes}", "--exclusive", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10:00"]
        self.id = slurm.sbatch(SBATCH, args, cwd=ROOT, env=job_env)
        self.keys = Keys("/oobleck", job_env.get("RDZV_ID", self.id))

    def when_step(self, step: int, action: Callable[[], None], timeout_s: float = 180.0, generation: int = 0) -> None:
        """Run `action` once the run reports `step` completed steps in `generation` or a later one."""
        deadline = time.monotonic() + timeout_s
        client = None
        try:
            while time.monotonic() < deadline:
                state = self.slurm.job(self.id).get("JobState")
                assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {state}:\n{self.output()[-5000:]}"
                try:
                    client = client or connect(EtcdSettings(endpoint=self.endpoint, timeout_s=2))
                    progress = read_progress(client, self.keys)
                except EtcdError:
                    progress = None
                if progress is not None and progress.step >= step and progress.generation >= generation:
                    action()
                    return
                time.sleep(0.1)
            raise AssertionError(f"the job did not reach step {step}:\n{self.output()[-5000:]}")
        finally:
            if client is not None:
                client.close()

    def output(self) -> str:
        return self.slurm.output(self.id)

    def finish(self, timeout_s: float = 240.0) -> tuple[dict[str, str], str]:
        """Slurm's record of the ended job, and its output (also kept in the test's tmp dir)."""
        info = self.slurm.wait_job(self.id, timeout_s)
        out = self.output()
        (self.tmp / f"slurm-{self.id}.out").write_text(out)
        return info, out

    def weights(self) -> dict:
        return load_model_state(self.tmp / "job" / "ckpt")

    def reference_weights(self) -> dict:
        train(load_config(ROOT / "configs/gpt2-tiny.yaml", self.reference))
        return load_model_state(self.tmp / "ref" / "ckpt")


def test_a_node_set_down_by_slurm_is_survived(slurm: SlurmCluster, tmp_path: Path) -> None:
    """n3 is set DOWN at step 4 of 12: Slurm kills its step (its agent and worker); the three other
    nodes re-plan and train to the end with the reference's weights, and the job is COMPLETED."""
    job = Job(slurm, tmp_path, steps=12)
    job.when_step(4, lambda: slurm.run(["scontrol", "update", "nodename=n3", "state=down", "reason=test"]))
    info, out = job.finish()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-5000:]
    assert "node n3: no longer in the allocation (Slurm took it away" in out, out[-5000:]
    for node in ("n1", "n2", "n4"):
        assert f"node {node}: its agent's step exited with status 0" in out, out[-5000:]
    assert f"run {job.id} finished: " in out, out[-5000:]
    assert "(failure: -node" in out, out[-5000:]
    assert not job.etcd_data.exists(), "the job left its etcd data behind"
    assert_same(job.weights(), job.reference_weights())


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_scancel_signal_term_of_a_node_drains_it(slurm: SlurmCluster, tmp_path: Path) -> None:
    """`scancel --signal=TERM JOB.STEP` of n3's step at step 4 of 12 is a preemption notice: the node
    is drained (hands its layers over at a step boundary, no failure), its step exits 0, and the job
    is COMPLETED with the reference's weights."""
    job = Job(slurm, tmp_path, steps=12)
    # Slurm 22.05's scancel delivers a step's signal yet says "Invalid job id specified" (exit 225)
    job.when_step(4, lambda: slurm.run(["scancel", "--signal=TERM", slurm.step_on(job.id, "n3")], check=False))
    info, out = job.finish()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-5000:]
    assert "preemption notice (SIGTERM): draining" in out and "(drain: -node" in out, out[-5000:]
    assert "communication failed" not in out and "step abandoned" not in out, out[-5000:]
    for node in ("n1", "n2", "n3", "n4"):
        assert f"node {node}: its agent's step exited with status 0" in out, out[-5000:]
    assert "no longer in the allocation" not in out, out[-5000:]
    assert_same(job.weights(), job.reference_weights())


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_a_node_cut_off_from_the_network_is_survived(tmp_path: Path) -> None:
    """Nodes with their own addresses and hostnames (network namespaces; the sbatch finds its etcd
    address with getent, unmodified). n3's link is cut at step 3 of 10: its agent and worker run on,
    unreachable; the others re-plan and finish. Slurm notices only after SlurmdTimeout (45 s), so
    the script stops n3's step CLOSE_GRACE (5 s) after the run closed; once Slurm has declared n3
    down the job is COMPLETED, with the reference's weights."""
    if missing(netns=True):
        pytest.skip(str(missing(netns=True)))
    slurm = SlurmCluster(nodes=4, netns=True, slurmd_timeout_s=45).start()
    try:
        job = Job(slurm, tmp_path, steps=10, env={"CLOSE_GRACE": "5"})
        job.when_step(3, lambda: slurm.cut("n3"))
        info, out = job.finish()
    finally:
        slurm.stop()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-5000:]
    assert f"etcd on n1 ({slurm.address('n1')}:{job.etcd_port})" in out, out[:2000]
    assert "node n3: its step still runs 5 s after the run closed (cut off?): stopping it" in out, out[-5000:]
    assert f"run {job.id} finished: " in out and "(failure: -node" in out, out[-5000:]
    assert not job.etcd_data.exists(), "the job left its etcd data behind"
    assert_same(job.weights(), job.reference_weights())


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_an_external_etcd_and_a_second_allocation_that_joins_the_run(slurm: SlurmCluster, tmp_path: Path) -> None:
    """ETCD_ENDPOINT: a 3-member etcd outside the allocation, so no node of it holds the control
    plane. A 3-node job (MAX_NODES=4) trains; at step 1 a second 1-node sbatch with the same
    ETCD_ENDPOINT and RDZV_ID adds its node to the run; once it trains an etcd member is SIGKILLed. Both
    jobs are COMPLETED and the run ends with the reference's weights."""
    import signal

    members = start_cluster(3, str(tmp_path / "etcd"), extra_args=["--unsafe-no-fsync"])
    try:
        env = {"ETCD_ENDPOINT": ",".join(m.endpoint for m in members), "MAX_NODES": "4"}
        job = Job(slurm, tmp_path, steps=24, nodes=3, env=env)
        joiner: list[Job] = []
        job.when_step(1, lambda: joiner.append(Job(slurm, tmp_path, steps=24, nodes=1, env={**env, "RDZV_ID": job.id})))
        job.when_step(0, lambda: os.kill(members[0].pid, signal.SIGKILL), generation=2)  # the joiner trains
        info, out = job.finish()
        (second,) = joiner
        info2, out2 = second.finish()
    finally:
        for member in members:
            member.stop()
    assert info["JobState"] == "COMPLETED" and info2["JobState"] == "COMPLETED", out[-3000:] + out2[-3000:]
    assert f"etcd at {env['ETCD_ENDPOINT']} (not started by this job); run id {job.id}" in out2, out2[-3000:]
    assert "(join: +node" in out + out2, out[-3000:] + out2[-3000:]
    assert f"run {job.id} finished: " in out and f"run {job.id} finished: " in out2, out[-3000:] + out2[-3000:]
    assert "communication failed" not in out + out2, out[-3000:] + out2[-3000:]
    assert_same(job.weights(), job.reference_weights())


def test_slurm_ends_a_job_whose_batch_host_fails(slurm: SlurmCluster) -> None:
    """Why etcd on the head node adds no point of failure of its own (launcher/slurm/README.md):
    the head node is the batch host, and Slurm ends a job whose batch host fails, --no-kill or not,
    while its other steps still run."""
    script = slurm.root / "sleep.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --no-kill\n"
        'for n in n1 n2; do srun --overlap -N1 -n1 -w "$n" sleep 300 & done\nwait\necho "the batch script ended"\n'
    )
    job = slurm.sbatch(script, ["--nodes=2", "--exclusive"], cwd=slurm.root, env={})

    def steps_running() -> list[str]:
        res = slurm.run(["squeue", "-h", "-s", "-j", job, "-o", "%j %N"], check=False)
        return sorted(line.split()[1] for line in res.stdout.splitlines() if line.split()[:1] == ["sleep"])

    # Down the batch host only once the batch script runs there (both of its steps started): downed
    # earlier, while the job is RUNNING but its script not yet launched, Slurm may still run it.
    slurm.wait_for(lambda: steps_running() == ["n1", "n2"], 60, "the batch script's two steps to run")
    assert slurm.job(job)["BatchHost"] == "n1"
    slurm.run(["scontrol", "update", "nodename=n1", "state=down", "reason=test"])
    info = slurm.wait_job(job, 120)
    # the job ends with its batch host, long before its steps' 300 s on n2 would: FAILED or NODE_FAIL,
    # or COMPLETED when Slurm first shrank the job to n2 (`ResizeTime`; seen once beside a loaded suite)
    ended = info["JobState"] in ("FAILED", "NODE_FAIL") or (
        info["JobState"] == "COMPLETED" and info.get("ResizeTime") not in (None, "None")
    )
    assert ended, f"{info.get('JobState')} ({info.get('Reason')}): {info}"
    hours, minutes, seconds = (int(v) for v in info["RunTime"].split("-")[-1].split(":"))
    assert "-" not in info["RunTime"] and hours * 3600 + minutes * 60 + seconds < 150, info
