"""etcd plumbing: the embedded server, `python -m oobleck_elastic.etcd.server`, EtcdStore, connect() errors."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from oobleck_elastic.etcd.client import connect
from oobleck_elastic.etcd.settings import EtcdError, EtcdSettings
from oobleck_elastic.etcd.server import EtcdServer, EtcdServerError, free_port
from oobleck_elastic.etcd.store import EtcdStore


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # an unreaped child of someone else still answers kill(0): count zombies as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def kill_if_alive(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------- server
def test_server_starts_answers_and_stop_leaves_nothing() -> None:
    server = EtcdServer()
    try:
        server.start()
        pid, data_dir = server.pid, Path(server.data_dir)
        assert pid_alive(pid) and data_dir.is_dir()
        client = connect(EtcdSettings(endpoint=server.endpoint, timeout_s=2))
        client.put_json("/t/k", {"a": 1})
        assert client.get_json("/t/k")[0] == {"a": 1}
        client.close()
    finally:
        server.stop()
    assert not pid_alive(pid)
    assert not data_dir.exists() and not data_dir.parent.exists()
    assert server.stop() == server.returncode  # idempotent


def test_given_data_dir_is_kept_and_reused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with EtcdServer(data_dir=str(data_dir)) as server:
        client = connect(EtcdSettings(endpoint=server.endpoint, timeout_s=2))
        client.put_json("/t/persist", 7)
        client.close()
    assert (data_dir / "member").is_dir()
    with EtcdServer(data_dir=str(data_dir)) as server:  # new ports, same member
        client = connect(EtcdSettings(endpoint=server.endpoint, timeout_s=2))
        assert client.get_json("/t/persist")[0] == 7
        client.close()


def test_etcd_variables_of_the_environment_do_not_stop_the_server(tmp_path: Path, monkeypatch) -> None:
    """A launcher's knobs named like etcd's flags (the sbatch's ETCD_DATA_DIR, exported to every step
    of a Slurm job) would make etcd refuse to start ("conflicting environment variable")."""
    monkeypatch.setenv("ETCD_DATA_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("ETCD_IP", "127.0.0.1")
    with EtcdServer(data_dir=str(tmp_path / "data")) as server:
        assert server.running()
    assert not (tmp_path / "elsewhere").exists()


def test_port_in_use_is_a_clear_error(etcd_server: EtcdServer) -> None:
    with pytest.raises(EtcdServerError, match=rf"client port 127\.0\.0\.1:{etcd_server.port} is already in use"):
        EtcdServer(port=etcd_server.port).start()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(EtcdServerError, match="peer port .* already in use"):
            EtcdServer(peer_port=busy.getsockname()[1]).start()


def test_early_exit_quotes_the_log() -> None:
    server = EtcdServer(extra_args=["--no-such-flag"])
    with pytest.raises(EtcdServerError, match=r"(?s)exited with code \d+ while starting.*no-such-flag"):
        server.start()
    assert server.pid is None and server.data_dir and not Path(server.data_dir).exists()


def test_run_etcd_command_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    port, data_dir = free_port(), tmp_path / "etcd-data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "oobleck_elastic.etcd.server", "--port", str(port), "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    etcd_pid = None
    try:
        deadline = time.monotonic() + 20
        while not any("etcd listening" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        first = next(line for line in lines if "etcd listening" in line)
        assert f"etcd listening on 127.0.0.1:{port} (data dir {data_dir}, pid " in first
        etcd_pid = int(first.split(", pid ")[1].split(")")[0])
        assert any(f"--rdzv-backend=oobleck --rdzv-endpoint=127.0.0.1:{port}" in line for line in lines)
        client = connect(EtcdSettings(endpoint=f"127.0.0.1:{port}", timeout_s=2))
        client.put_json("/t/cli", 1)
        client.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
        reader.join(timeout=5)
        assert "etcd stopped (SIGINT)" in "".join(lines)
        assert not pid_alive(etcd_pid)
        assert (data_dir / "member").is_dir()  # a given data dir is kept
    finally:
        kill_if_alive(proc)
        if etcd_pid is not None and pid_alive(etcd_pid):
            os.kill(etcd_pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------- store
@pytest.fixture
def store(etcd_settings: EtcdSettings, run_id: str):
    client = connect(etcd_settings)
    st = EtcdStore(client, prefix=f"/test/{run_id}/store", timeout=timedelta(seconds=5))
    yield st
    st.delete_prefix()
    client.close()


def test_store_matches_tcpstore_semantics(store: EtcdStore) -> None:
    store.set("s", "v")
    store.set("b", b"\x00\xff")
    assert store.get("s") == b"v" and store.get("b") == b"\x00\xff"
    assert store.add("n", 5) == 5 and store.add("n", 2) == 7 and store.add("n", -10) == -3
    # compare_set, as TCPStore: missing+"" sets; missing+expected returns expected; match sets; else current
    assert store.compare_set("c", "", "x") == b"x"
    assert store.compare_set("m", "y", "z") == b"y" and not store.check(["m"])
    assert store.compare_set("c", "x", "w") == b"w"
    assert store.compare_set("c", "q", "v") == b"w" and store.get("c") == b"w"
    assert store.check(["s", "n", "c"]) and not store.check(["s", "nope"])
    assert store.num_keys() == 4
    assert store.delete_key("s") and not store.delete_key("s") and store.num_keys() == 3
    store.multi_set(["m1", "m2"], ["1", "2"])  # through the C++ base class
    assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert store.delete_prefix() == 5 and store.num_keys() == 0


def test_store_wait_times_out_naming_the_key(store: EtcdStore) -> None:
    store.set("here", "1")
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"timed out after 0\.5 s waiting for key\(s\) \['never'\]"):
        store.wait(["here", "never"], timedelta(seconds=0.5))
    assert 0.45 < time.monotonic() - t0 < 2
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="never2"):
        store.get("never2")


def test_store_get_wakes_on_a_later_set(store: EtcdStore) -> None:
    timer = threading.Timer(0.3, store.set, args=("late", "here"))
    timer.start()
    t0 = time.monotonic()
    assert store.get("late") == b"here"
    assert time.monotonic() - t0 < 2
    timer.join()


def test_store_on_wait_hook_sees_progress_and_can_give_up(store: EtcdStore) -> None:
    """The hook runs every quarter second of a wait; an exception it raises ends the wait, also
    when the caller is C++ (init_process_group's rendezvous), so a worker stops joining a
    generation that was superseded instead of waiting out the store timeout."""
    seen: list[float] = []

    def hook(waited: float) -> None:
        seen.append(waited)
        if waited > 0.6:
            raise RuntimeError("generation 3 was superseded by generation 4 while joining")

    store.on_wait = hook
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="superseded by generation 4"):
        store.get("never")
    assert time.monotonic() - t0 < 3 and len(seen) >= 2 and seen == sorted(seen)
    with pytest.raises(RuntimeError, match="superseded by generation 4"):
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=60))
    assert not dist.is_initialized()


def test_store_min_wait_outlasts_a_callers_short_timeout(store: EtcdStore) -> None:
    """gloo waits for peers' addresses under the process group's (short, connect) timeout; with
    min_wait a peer that arrives later than that is still waited for."""
    store.min_wait = timedelta(seconds=5)
    timer = threading.Timer(0.6, store.set, args=("slow", "1"))
    timer.start()
    store.wait(["slow"], timedelta(seconds=0.2))
    timer.join()
    store.min_wait = timedelta(seconds=0.4)
    with pytest.raises(dist.DistStoreError, match=r"timed out after 0\.4 s"):
        store.wait(["never"], timedelta(seconds=0.1))


def test_store_add_is_atomic_under_contention(store: EtcdStore, etcd_settings: EtcdSettings) -> None:
    clients = [connect(etcd_settings) for _ in range(4)]
    stores = [EtcdStore(c, prefix=store.prefix) for c in clients]
    threads = [threading.Thread(target=lambda s=s: [s.add("ctr", 1) for _ in range(25)]) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    assert store.add("ctr", 0) == 100


def test_store_prefix_is_required(etcd_settings: EtcdSettings) -> None:
    client = connect(etcd_settings)
    with pytest.raises(ValueError, match="non-empty prefix"):
        EtcdStore(client, prefix="/")
    client.close()


WORKER = """
import sys, datetime, torch, torch.distributed as dist
from oobleck_elastic.etcd.client import connect
from oobleck_elastic.etcd.settings import EtcdSettings
from oobleck_elastic.etcd.store import EtcdStore
endpoint, prefix, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = EtcdStore(connect(EtcdSettings(endpoint=endpoint)), prefix=prefix, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
g = dist.new_group(list(range(world)))
dist.barrier(group=g)
print("SUM", int(t.item()), flush=True)
dist.destroy_process_group()
"""


def test_init_process_group_gloo_with_etcd_store(etcd_settings: EtcdSettings, run_id: str) -> None:
    world, prefix = 4, f"/test/{run_id}/pg"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, etcd_settings.endpoint, prefix, str(r), str(world)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out
            assert f"SUM {world * (world + 1) // 2}" in out, out
    finally:
        for p in procs:
            kill_if_alive(p)
        client = connect(etcd_settings)
        EtcdStore(client, prefix=prefix).delete_prefix()
        client.close()


# ---------------------------------------------------------------------------------- connect() errors
def test_connect_unreachable_is_quick_and_clear() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(EtcdError, match=rf"cannot reach etcd at 127\.0\.0\.1:{port}"):
        connect(EtcdSettings(endpoint=f"127.0.0.1:{port}", timeout_s=1))
    assert time.monotonic() - t0 < 5


def test_connect_missing_cacert_names_the_setting(etcd_settings: EtcdSettings) -> None:
    with pytest.raises(EtcdError) as info:
        connect(EtcdSettings(endpoint=etcd_settings.endpoint, cacert="/nope.pem"))
    assert str(info.value) == "etcd TLS setting cacert=/nope.pem: file does not exist"


def test_connect_tls_to_plaintext_server_fails_fast(etcd_settings: EtcdSettings, tmp_path: Path) -> None:
    cert = tmp_path / "ca.pem"
    try:
        from cryptography import x509  # noqa: F401

        have_cryptography = True
    except ImportError:
        have_cryptography = False
    if have_cryptography:
        _self_signed_with_cryptography(cert)
    elif shutil.which("openssl"):
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-keyout",
                str(tmp_path / "ca.key"),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
    else:
        pytest.skip("neither the cryptography package nor the openssl CLI is available to make a cert")
    t0 = time.monotonic()
    with pytest.raises(EtcdError, match=rf"etcd at {etcd_settings.endpoint}"):
        connect(EtcdSettings(endpoint=etcd_settings.endpoint, cacert=str(cert), timeout_s=2))
    assert time.monotonic() - t0 < 6


def _self_signed_with_cryptography(path: Path) -> None:
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
