"""The SLURM and Kubernetes launch recipes parse and start torchrun with the oobleck rendezvous."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launcher" / "slurm" / "oobleck.sbatch"
K8S = ROOT / "launcher" / "k8s" / "oobleck.yaml"
TORCHRUN_FLAGS = ("--rdzv-backend=oobleck", "--rdzv-endpoint=", "--rdzv-id=", "--nnodes=", "--nproc-per-node=")


def torchrun_command(script: str) -> str:
    """The torchrun invocation in a shell script, with backslash continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", script)
    code = [ln.split(" #")[0] for ln in joined.splitlines() if not ln.lstrip().startswith("#")]
    lines = [ln for ln in code if re.search(r"(^|\s)torchrun\s", ln)]
    assert len(lines) == 1, lines
    return lines[0][lines[0].index("torchrun") :]


def k8s_docs() -> list[dict]:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d is not None]
    assert all(isinstance(d, dict) and {"apiVersion", "kind", "metadata"} <= set(d) for d in docs)
    return docs


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# ---- SLURM -----------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_is_valid_bash() -> None:
    res = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_sbatch_directives() -> None:
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash")
    directives = dict(m.groups() for m in re.finditer(r"^#SBATCH\s+(--[\w-]+)(?:=(\S+))?", text, re.M))
    assert directives["--nodes"] == "4"
    assert directives["--ntasks-per-node"] == "1"
    assert directives["--gpus-per-node"] == "8"
    assert "--cpus-per-task" in directives and "--time" in directives
    assert re.search(r"^set -euo pipefail$", text, re.M)
    assert re.search(r"^trap \w+ EXIT$", text, re.M)


def test_sbatch_starts_reachable_etcd_on_head_node() -> None:
    text = re.sub(r"\\\n\s*", " ", SBATCH.read_text())
    etcd = [ln for ln in text.splitlines() if "oobleck etcd" in ln and not ln.lstrip().startswith("#")]
    assert len(etcd) == 1, etcd
    assert "srun" in etcd[0] and '-w "$HEAD"' in etcd[0] and etcd[0].rstrip().endswith("&")
    # the etcd server binds loopback by default: a multi-node job must pass --host
    assert "--host" in etcd[0] and "--port" in etcd[0] and "--data-dir" in etcd[0]


def test_sbatch_torchrun_line() -> None:
    text = SBATCH.read_text()
    cmd = torchrun_command(text)
    for flag in TORCHRUN_FLAGS:
        assert flag in cmd, flag
    assert '--rdzv-id="$RDZV_ID"' in cmd and re.search(r"^RDZV_ID=\$\{RDZV_ID:-\$SLURM_JOB_ID\}", text, re.M)
    assert '--nnodes="${MIN_NODES}:${MAX_NODES}"' in cmd
    assert "examples/train.py --config" in cmd
    srun = [ln for ln in re.sub(r"\\\n\s*", " ", text).splitlines() if "torchrun" in ln and "srun" in ln]
    assert srun, "torchrun must be started with srun on every node"
    for var in ("CONFIG", "MIN_NODES"):
        assert re.search(rf"^{var}=", text, re.M), var


def test_sbatch_runs_one_step_per_node_and_exits_with_the_runs_result() -> None:
    """Slurm kills a step on all its nodes when one fails: each node's agent runs in its own step,
    and the job's status is the run's (`oobleck outcome`), not that of the node that exited last
    (tests/jobs/test_slurm.py runs it on a real Slurm)."""
    text = re.sub(r"\\\n\s*", " ", SBATCH.read_text())
    srun = [ln for ln in text.splitlines() if "torchrun" in ln and "srun" in ln]
    assert len(srun) == 1 and '-w "$node"' in srun[0] and "--nodes=1" in srun[0], srun
    assert srun[0].rstrip().endswith("&")
    code = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert code[-1] == 'oobleck outcome --endpoint "$ENDPOINT" --run-id "$RDZV_ID"'
    getent = [ln for ln in code if "getent" in ln]  # a failing getent must reach the script's own message
    assert len(getent) == 1 and getent[0].endswith("|| true)"), getent
    assert re.search(r'rm -rf "\$ETCD_DATA_DIR"', text)


# ---- Kubernetes ------------------------------------------------------------------------------------


def test_k8s_etcd_deployment_and_service() -> None:
    docs = k8s_docs()
    svc = one(docs, "Service", "oobleck-etcd")
    assert 2379 in [p["port"] for p in svc["spec"]["ports"]]
    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (etcd,) = dep["spec"]["template"]["spec"]["containers"]
    assert etcd["image"] == "quay.io/coreos/etcd:v3.5.1"
    assert 2379 in [p["containerPort"] for p in etcd["ports"]]
    assert any("--listen-client-urls=http://0.0.0.0:2379" == a for a in etcd["command"] + etcd.get("args", []))
    assert any("emptyDir" in v for v in dep["spec"]["template"]["spec"]["volumes"])


def test_k8s_indexed_job_runs_torchrun_with_oobleck() -> None:
    docs = k8s_docs()
    job = one(docs, "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == 4
    assert spec["backoffLimit"] >= 4 * 3  # several failures per index before the Job gives up
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    (trainer,) = pod["containers"]
    argv = [str(a) for a in trainer.get("command", []) + trainer.get("args", [])]
    if argv[:2] in (["bash", "-c"], ["sh", "-c"], ["/bin/bash", "-c"], ["/bin/sh", "-c"]):
        argv = shlex.split(" ".join(argv[2:]))
    assert "torchrun" in argv[0]
    for flag in TORCHRUN_FLAGS:
        assert any(a.startswith(flag) for a in argv), flag
    assert "--rdzv-endpoint=oobleck-etcd:2379" in argv
    assert "--rdzv-id=$(JOB_NAME)" in argv
    assert "--nnodes=2:4" in argv and "--nproc-per-node=8" in argv
    assert "examples/train.py" in argv and argv[argv.index("--config") + 1] == "/config/gpt2-small.yaml"
    assert "JOB_NAME" in [e["name"] for e in trainer["env"]]
    for kind in ("limits", "requests"):
        assert trainer["resources"][kind]["nvidia.com/gpu"] == 8


def test_k8s_volumes_config_and_shm() -> None:
    docs = k8s_docs()
    pod = one(docs, "Job")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    cm_name = volumes[mounts["/config"]]["configMap"]["name"]
    cm = one(docs, "ConfigMap", cm_name)
    assert "gpt2-small.yaml" in cm["data"]


def test_k8s_configmap_is_a_valid_job_config(tmp_path: Path) -> None:
    from oobleck_elastic.config import load_config

    cm = one(k8s_docs(), "ConfigMap")
    path = tmp_path / "gpt2-small.yaml"
    path.write_text(cm["data"]["gpt2-small.yaml"])
    cfg = load_config(path)
    assert cfg.planning.gpus_per_node == 8  # = --nproc-per-node and nvidia.com/gpu


def test_k8s_manifest_is_valid_against_the_kubernetes_schemas() -> None:
    """Every resource against the real schemas of the newest Kubernetes that kubernetes-validate
    ships (offline), strictly: an unknown or misspelt field fails, as a typo would on a cluster."""
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the test extras)")
    version = kv.latest_version()
    for doc in k8s_docs():
        kv.validate(doc, version, strict=True)
    job = one(k8s_docs(), "Job")
    pod = job["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    with pytest.raises(kv.ValidationError, match="terminationGracePeriodSecond"):
        kv.validate(job, version, strict=True)


def test_k8s_eviction_is_a_preemption_notice_with_time_to_drain(tmp_path: Path) -> None:
    """The kubelet sends SIGTERM to the trainer container's PID 1, then SIGKILL after the pod's
    grace period: PID 1 must be torchrun's agent (a shell would not pass the signal on), SIGTERM a
    preemption notice of the job config, and its drain grace shorter than the pod's."""
    from oobleck_elastic.config import load_config

    pod = one(k8s_docs(), "Job")["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    assert trainer["command"] == ["torchrun"]
    cm = one(k8s_docs(), "ConfigMap")
    path = tmp_path / "gpt2-small.yaml"
    path.write_text(cm["data"]["gpt2-small.yaml"])
    ft = load_config(path).fault_tolerance
    assert "SIGTERM" in ft.preempt_signals
    assert ft.preempt_grace_s + 20 <= pod["terminationGracePeriodSeconds"]


@pytest.mark.skipif(shutil.which("getent") is None, reason="needs getent")
def test_sbatch_says_why_when_the_head_node_has_no_address(tmp_path: Path) -> None:
    """`getent` failing inside `$(...)` under `set -e` used to end the script with status 2 and
    an empty output; it must reach the script's own message."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "scontrol").write_text("#!/bin/sh\necho no-such-node.invalid\n")
    (stub / "scontrol").chmod(0o755)
    env = {"PATH": f"{stub}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "x", "SLURM_JOB_ID": "7", "SLURM_NNODES": "1"}
    res = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stderr == "cannot find a routable address for no-such-node.invalid (got ''); set ETCD_IP\n"
