"""etcd with TLS and password auth: a command without credentials gets one line that says what to
give (exit 2, no traceback), a wrong password too, and a client signs in again when an etcd
restart invalidated its auth token."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oobleck_elastic.etcd import EtcdError, EtcdSettings, connect
from oobleck_elastic.etcd.server import EtcdServer, find_etcd_binary

from helpers import ROOT


@pytest.fixture
def auth_etcd(tmp_path: Path):
    """A TLS etcd (self-signed certificate for 127.0.0.1) with auth enabled for root:secret."""
    if not shutil.which("openssl"):
        pytest.skip("the openssl CLI is needed to make a certificate")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
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
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    server = EtcdServer(data_dir=str(tmp_path / "etcd"), tls=(str(cert), str(key)), extra_args=["--unsafe-no-fsync"])
    server.start()
    try:
        etcdctl = [
            str(Path(find_etcd_binary()).with_name("etcdctl")),
            "--endpoints",
            server.client_url,
            "--cacert",
            str(cert),
        ]
        for args in (["user", "add", "root:secret"], ["auth", "enable"]):
            subprocess.run(etcdctl + args, check=True, capture_output=True, timeout=30)
        yield server, str(cert)
    finally:
        server.stop()


def test_commands_without_or_with_wrong_credentials_give_one_line(auth_etcd) -> None:
    server, cert = auth_etcd
    base = [
        sys.executable,
        "-m",
        "oobleck_elastic.cli",
        "agents",
        "--endpoint",
        server.endpoint,
        "--run-id",
        "job",
        "--cacert",
        cert,
    ]
    for extra, expected in (
        ([], "this etcd has auth enabled: give a user and password"),
        (["--user", "root", "--password", "wrong"], "check the password and the permissions"),
    ):
        proc = subprocess.run(base + extra, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"oobleck agents: error: etcd at {server.endpoint} refused the request ("
        ), proc.stderr
        assert expected in lines[0], proc.stderr


def test_a_client_signs_in_again_after_an_etcd_restart(auth_etcd, caplog) -> None:
    server, cert = auth_etcd
    caplog.set_level(logging.WARNING)
    client = connect(
        EtcdSettings(
            endpoint=server.endpoint, cacert=cert, user="root", password="secret", timeout_s=2.0, outage_s=30.0
        )
    )
    try:
        client.put("/a/k", "1")
        lease = client.grant_lease(60)
        assert client.refresh_lease(lease) == 60  # the keep-alive stream is open, under the first token
        port = server.port
        server.stop()  # the data dir was given: it stays; the simple auth tokens are gone
        time.sleep(0.5)
        server.port = port
        server.start()
        assert client.refresh_lease(lease) > 0  # a new keep-alive stream (TLS, credentials) carries it
        assert client.get("/a/k").value == b"1"
        client.put("/a/k", "2")
        assert client.get("/a/k").value == b"2"
        assert any("signing in again as root" in r.getMessage() for r in caplog.records)
    finally:
        client.close()
    with pytest.raises(EtcdError, match="refused the request"):
        connect(EtcdSettings(endpoint=server.endpoint, cacert=cert, user="root", password="nope", timeout_s=2.0))
