"""Where and how to reach etcd: `EtcdSettings`, endpoint plus TLS (cacert, cert, key) and auth
(user, password), parsed from torchrun's `--rdzv-conf`, CLI flags or the `OOBLECK_ETCD_*`
environment variables the rendezvous handler passes to workers (`to_env` / `from_env`), with
static checks whose errors say what to change (`check`); and `EtcdError`, what every etcd
failure of this package raises. The story: docs/operations.md."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ENV_PREFIX = "OOBLECK_ETCD_"
"""The prefix of the environment variables that carry the settings to workers."""


class EtcdError(RuntimeError):
    """etcd is unreachable or misconfigured; the message says what to check."""


@dataclass(frozen=True)
class EtcdSettings:
    endpoint: str = "127.0.0.1:2379"
    """host:port of an etcd member, or a comma-separated list of a cluster's members
    (`h1:2379,h2:2379,h3:2379`: requests fail over between them); an http:// or https:// prefix
    is accepted."""
    cacert: Optional[str] = None
    """CA certificate (PEM) that signed the server certificate; enables TLS."""
    cert: Optional[str] = None
    """Client certificate (PEM) for mutual TLS; needs `key`."""
    key: Optional[str] = None
    """Client private key (PEM) for mutual TLS; needs `cert`."""
    user: Optional[str] = None
    """etcd user name (etcd auth)."""
    password: Optional[str] = None
    """etcd password."""
    timeout_s: float = 5.0
    """Timeout of every request."""
    outage_s: float = 60.0
    """How long a request is retried while etcd is unreachable (a stalled or restarting server,
    a cluster electing a leader) before it fails with EtcdError."""

    @property
    def host_ports(self) -> list[tuple[str, int]]:
        """Every member's (host, port)."""
        return [EtcdSettings(endpoint=ep.strip()).host_port for ep in self.endpoint.split(",") if ep.strip()]

    @property
    def host_port(self) -> tuple[str, int]:
        ep = self.endpoint.split(",")[0].strip()
        for scheme in ("http://", "https://"):
            if ep.startswith(scheme):
                ep = ep[len(scheme) :]
        host, _, port = ep.rstrip("/").rpartition(":")
        if not host:
            return ep, 2379
        try:
            return host.strip("[]"), int(port)
        except ValueError:
            raise EtcdError(f"etcd endpoint '{self.endpoint}' is not host:port") from None

    def to_env(self) -> dict[str, str]:
        """Environment variables that `from_env` reads back (passed to workers)."""
        env = {
            f"{ENV_PREFIX}ENDPOINT": self.endpoint,
            f"{ENV_PREFIX}TIMEOUT_S": str(self.timeout_s),
            f"{ENV_PREFIX}OUTAGE_S": str(self.outage_s),
        }
        for name in ("cacert", "cert", "key", "user", "password"):
            value = getattr(self, name)
            if value:
                env[f"{ENV_PREFIX}{name.upper()}"] = value
        return env

    @classmethod
    def from_env(cls, environ: Optional[dict[str, str]] = None) -> "EtcdSettings":
        env = os.environ if environ is None else environ
        if f"{ENV_PREFIX}ENDPOINT" not in env:
            raise EtcdError(f"{ENV_PREFIX}ENDPOINT is not set: run under torchrun --rdzv-backend=oobleck")
        get = lambda name: env.get(f"{ENV_PREFIX}{name}") or None  # noqa: E731
        return cls(
            endpoint=env[f"{ENV_PREFIX}ENDPOINT"],
            cacert=get("CACERT"),
            cert=get("CERT"),
            key=get("KEY"),
            user=get("USER"),
            password=get("PASSWORD"),
            timeout_s=float(env.get(f"{ENV_PREFIX}TIMEOUT_S", "5")),
            outage_s=float(env.get(f"{ENV_PREFIX}OUTAGE_S", "60")),
        )

    def check(self) -> None:
        """Static checks of the TLS/auth settings (files exist, pairs complete)."""
        for name in ("cacert", "cert", "key"):
            value = getattr(self, name)
            if value and not Path(value).is_file():
                raise EtcdError(f"etcd TLS setting {name}={value}: file does not exist")
        if bool(self.cert) != bool(self.key):
            raise EtcdError("etcd TLS settings cert and key must be given together (mutual TLS)")
        if (self.cert or self.key) and not self.cacert:
            raise EtcdError("etcd TLS settings cert/key need cacert too (the CA of the server certificate)")
        if bool(self.user) != bool(self.password):
            raise EtcdError("etcd auth settings user and password must be given together")
