"""Shared test helpers: a synthetic profile that forces multi-stage pipelines, a watcher that
acts on a running job's etcd state, and a local job run beside its single-process reference."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from oobleck_elastic.etcd import EtcdClient, EtcdSettings, connect
from oobleck_elastic.checkpoint import load_model_state
from oobleck_elastic.testing import TINY_PROFILE_OVERRIDES, RandomTokens, layout_plan, tiny_profile  # noqa: F401 (tests import them from here)
from oobleck_elastic.config import load_config
from oobleck_elastic.engine.run import train

ROOT = Path(__file__).resolve().parents[1]


# bf16: autocast on the device, fp32 master weights and optimizer state in both runs. The job and the
# reference run the same bf16 ops on the same microbatches. Two things may still differ:
# - how a kernel sums: a matmul's blocking (its fp32 summation order) depends on the intra-op thread
#   count. Both sides compute on one thread (the reference in this process by `one_thread`, the
#   workers by OMP_NUM_THREADS=1, which the launcher otherwise sets to cores // workers): the same
#   kernels, the same order (measured on CPU: 1 vs 2 threads moved the reference by 1.2e-7);
# - the order of sums across processes (the tied embedding's two gradients, the gradient norm for
#   clipping): fp32 roundings, which can flip the bf16 rounding of a gradient, by bf16's eps
#   (2^-7) relative, now and then.
# The bound that follows from bf16's precision: Adam divides a gradient by its own scale, so a
# gradient off by eps relative moves a weight's update by at most about eps x lr per step; over the
# run's steps, with a factor 2 for roundings on both sides, `bf16_atol(steps, lr)` (6.25e-5 here,
# against 1.6e-8 measured on one thread, and 2.2e-3 between bf16 and fp32 weights: the check that
# bf16 ran at all uses the same bound).


def bf16_atol(steps: int, lr: float) -> float:
    """How far a bf16 job's fp32 master weights may be from the reference's (the comment above it)."""
    return 2 * steps * lr * torch.finfo(torch.bfloat16).eps


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch computes on one intra-op thread in this process (the reference), as the workers do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference_state(cfg, dataset, steps: int) -> dict[str, torch.Tensor]:
    """The single-process reference's weights after `steps` steps, as {"layer:param": tensor}
    (0 steps: the initial weights). Its process group is closed before returning."""
    from oobleck_elastic.engine.reference import single_process

    trainer = single_process(cfg, dataset=dataset)
    try:
        for step in range(steps):
            trainer.train_step(step)
        return {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()}
    finally:
        trainer.close()


def flip_byte(path: Path, offset: int = -3) -> None:
    """Corrupt a file in place: one byte inverted."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def when(
    endpoint: str,
    proc,
    condition: Callable[[EtcdClient], bool],
    action: Callable[[EtcdClient], None],
    *,
    timeout: float = 300.0,
) -> None:
    """Poll etcd while `proc` runs; once `condition(client)` holds, run `action(client)` once."""
    client = connect(EtcdSettings(endpoint=endpoint))
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if condition(client):
                action(client)
                return
            time.sleep(0.05)
    finally:
        client.close()


def at_step(endpoint: str, keys, step: int, action: Callable[[EtcdClient], None]) -> Callable[[object], None]:
    """A `during` for `run_job`: once the job's `progress` shows `step` steps done, run
    `action(client)` once (`when`)."""
    return lambda proc: when(
        endpoint, proc, lambda c: (c.get_json(keys.progress)[0] or {}).get("step", 0) >= step, action
    )


def a_follower(client: EtcdClient, keys):
    """The record of a live node that is not the leader (so it can fail without the leader's death
    playing a part)."""
    from oobleck_elastic.rendezvous.membership import live_nodes
    from oobleck_elastic.records.read import read_leader

    leader = read_leader(client, keys)
    return next(r for r in live_nodes(client, keys) if leader is None or r.node_id != leader.node_id)


def worker_pid(agent_pid: int) -> int:
    """The pid of the training worker (examples/train.py) a torchrun agent started."""
    from launcher.faults import descendants

    return next(p for p in descendants(agent_pid) if b"train.py" in Path(f"/proc/{p}/cmdline").read_bytes())


def single_process_overrides(tmp: Path, steps: int) -> list[str]:
    """A short single-process run of configs/gpt2-tiny.yaml whose outputs stay under `tmp`."""
    return [
        f"training.steps={steps}",
        "data.seq_len=32",
        "training.global_batch_size=12",
        "training.microbatch_size=2",
        "training.optimizer.eps=1e-6",  # see tests/worlds/test_engine.py: zero-gradient biases under AdamW
        f"data.cache_dir={tmp / 'cache'}",
        f"checkpoint.dir={tmp / 'ckpt'}",
        f"logging.tensorboard_dir={tmp / 'runs'}",
    ]


def signal_after_steps(cmd: list[str], sig: int, timeout: float) -> tuple[int, str]:
    """Run `cmd` (a training command), send it `sig` once its output reports a step from 3 to 9,
    and return its exit status and whole output (stderr in stdout); killed if still running after
    `timeout` seconds from the signal."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # until the run has trained a few steps
            lines.append(line)
            if re.search(r" step [3-9]/\d+ ", line):
                break
        proc.send_signal(sig)
        lines += proc.stdout.readlines()
        return proc.wait(timeout=timeout), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def overrides(tmp: Path, steps: int, profile: Path) -> list[str]:
    return [
        f"training.steps={steps}",
        "data.seq_len=32",
        "training.global_batch_size=16",
        "training.microbatch_size=2",
        "training.optimizer.eps=1e-6",  # see tests/worlds/test_engine.py
        f"data.cache_dir={tmp / 'cache'}",
        f"checkpoint.dir={tmp / 'ckpt'}",
        f"logging.tensorboard_dir={tmp / 'runs'}",
        f"planning.profile_path={profile}",
        *TINY_PROFILE_OVERRIDES,
        "fault_tolerance.comm_timeout_s=30",
    ]


def paced(first: int, last: int, seconds: float, rank: int = 0) -> dict[str, str]:
    """The environment of a job whose rank `rank` sleeps `seconds` as it starts each step in
    [first, last) (`OOBLECK_SLOW_AT`): the job lasts at least (last - first) x seconds however fast
    the machine computes, for tests whose own actions (a join, a drain) must land while it runs.
    The sleep is not compute (stragglers are timed on compute alone) and the main thread keeps
    ticking the heartbeat through it."""
    return {"OOBLECK_SLOW_AT": ",".join(f"{rank}@{s}:{seconds:g}" for s in range(first, last))}


def run_job(
    tmp: Path,
    etcd_server,
    run_id: str,
    launcher_args: list[str],
    steps: int,
    profile: Path,
    extra: list[str] = (),
    during=None,
    killed_by_test=0,
    rdzv: str = "lease_ttl=2,settle=0.2,last_call_timeout=1",
    env: Optional[dict[str, str]] = None,
    expect_failure: bool = False,
    reference: bool = True,
    job_extra: list[str] = (),
) -> tuple[str, dict, dict]:
    """Run a job (and the single-process reference); return (stdout, job state, reference state).
    `env`: extra environment of the launcher and its nodes. `expect_failure`: the job must end with
    a non-zero status (then the states are empty). `reference=False` skips the reference run.
    `job_extra`: overrides of the job alone (not of the reference run), e.g. its events directory."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg_over = overrides(tmp / "job", steps, profile) + list(extra) + list(job_extra)
    ref = single_process_reference(tmp / "ref", steps, profile, list(extra)) if reference and not expect_failure else {}
    cmd = [
        sys.executable,
        "-m",
        "launcher.local",
        "-v",  # every node line: this reads them
        "--log-dir",
        str(tmp / "launcher"),
        *launcher_args,
        "--endpoint",
        etcd_server.endpoint,
        "--run-id",
        run_id,
        "--rdzv-conf",
        rdzv,
        "--",
        "examples/train.py",
        "--config",
        "configs/gpt2-tiny.yaml",
        *cfg_over,
    ]
    log_path = tmp / "job.log"  # kept in pytest's tmp dir for a post-mortem
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )
        try:
            if during is not None:
                during(proc)
            proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"job still running after 400 s; log {log_path}:\n" + log_path.read_text()[-5000:]
            ) from None
        finally:
            if proc.poll() is None:  # a second SIGTERM: the launcher kills every node by PID at once
                proc.terminate()  # (the first asks the job to stop at a step boundary: launcher/stopping.py)
                time.sleep(0.2)
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    from launcher.faults import kill_node

                    kill_node(proc.pid)
                    proc.wait()
    out = log_path.read_text()
    if expect_failure:
        assert proc.returncode != 0, out[-5000:]
        return out, {}, {}
    if callable(killed_by_test):
        killed_by_test = killed_by_test()
    if killed_by_test:  # the launcher reports nodes it did not kill itself as failed
        assert out.count("exited with status -9") == killed_by_test, out[-5000:]
        assert f"0 killed on purpose, 0 preempted, {killed_by_test} failed" in out, out[-5000:]
    else:
        assert proc.returncode == 0, out[-5000:]
    job_ckpt = next((Path(o.split("=", 1)[1]) for o in extra if o.startswith("checkpoint.dir=")), tmp / "job" / "ckpt")
    return out, load_model_state(job_ckpt), ref


_REFERENCES: dict[tuple, dict[str, torch.Tensor]] = {}


def single_process_reference(tmp: Path, steps: int, profile: Path, extra: list[str]) -> dict[str, torch.Tensor]:
    """The weights of configs/gpt2-tiny.yaml trained `steps` steps in this process with `overrides`
    and `extra`, outputs under `tmp`. The reference is a pure function of its settings (the data
    and the initial weights are seeded), so a run with the same steps, profile contents, extra
    settings, fault injections (`OOBLECK_*` in this process's environment) and CPU threads is
    trained once per pytest process and its weights reused: a 4-node job test spends 2-9 s of its
    15-30 s on it otherwise."""
    faults = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("OOBLECK_")))
    key = (steps, profile.read_bytes(), tuple(extra), faults, torch.get_num_threads())
    if key not in _REFERENCES:
        train(load_config(ROOT / "configs/gpt2-tiny.yaml", overrides(tmp, steps, profile) + extra))
        _REFERENCES[key] = load_model_state(tmp / "ckpt")
    return {name: t.clone() for name, t in _REFERENCES[key].items()}


def assert_same(job: dict, ref: dict) -> None:
    assert set(job) == set(ref)
    for key in ref:
        torch.testing.assert_close(job[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)


def stall_process(pid: int, seconds: float) -> threading.Thread:
    """SIGSTOP `pid` now and SIGCONT it after `seconds`, from a daemon thread (returned)."""

    def run() -> None:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def etcd_grpc(server, metric: str) -> dict[str, int]:
    """etcd's count `metric` (from its /metrics, e.g. `grpc_server_msg_received_total`: requests
    received, each message of a stream counted) per gRPC method, summed over its other labels."""
    text = urllib.request.urlopen(f"{server.client_url}/metrics", timeout=10).read().decode()
    counts: dict[str, int] = {}
    for labels, value in re.findall(rf"^{metric}{{([^}}]*)}} (\S+)$", text, re.M):
        method = re.search(r'grpc_method="([^"]*)"', labels)
        if method is not None:
            counts[method.group(1)] = counts.get(method.group(1), 0) + int(float(value))
    return counts


def eventually(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Wait until `predicate()` is true (polled every 20 ms); fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def tensorboard_runs(root: Path) -> list[Path]:
    """The TensorBoard run directories under `root` (`logging.tensorboard_dir`): each directory
    holding event files, sorted."""
    return sorted({p.parent for p in root.rglob("events.out.tfevents.*")})


def tensorboard_run(root: Path) -> Path:
    """The one TensorBoard run under `root`, `<run id>/<start>` (engine/telemetry/board.py)."""
    runs = tensorboard_runs(root)
    assert len(runs) == 1, f"expected one TensorBoard run under {root}, found {[str(r) for r in runs]}"
    return runs[0]
