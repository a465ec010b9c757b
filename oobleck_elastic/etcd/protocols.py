"""What the control plane needs of etcd, named as Protocols.

A reader of control data does not care whether its keys come from etcd itself (`EtcdClient`, one
request per read) or from a local copy kept current by watches (`Mirror`, mirror.py): both answer
`KVReader`. The failure detectors (rendezvous/detect.py) also write a few keys, revoke a lease and
ask whether etcd was away a moment ago: `KVStore` adds those verbs, which `EtcdClient` has.
`MemoryKV` (memory.py) implements both on a dict, so the roll call, the deputy and the leader
watch are unit-tested on made-up states without an etcd process (tests/unit/test_detect.py), as the
leader's rules are (rendezvous/decide.py).

Values are `bytes` as stored; the JSON verbs parse them and return None for a value that does not
parse (logged once, docs/design.md, invariant 5). Keys are plain `str`: a prefix ends with "/".
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol

from .client import KV


class KVReader(Protocol):
    """Reads of single keys and prefixes: `EtcdClient`, `Mirror` and `MemoryKV` answer them."""

    def get(self, key: str) -> Optional[KV]:
        """The key as stored, or None when it does not exist."""
        ...

    def get_json(self, key: str) -> tuple[Optional[Any], Optional[int]]:
        """(value, mod revision) of a JSON key: (None, None) if absent, (None, revision) if malformed."""
        ...

    def get_prefix_json(self, prefix: str) -> Iterator[tuple[str, Any]]:
        """(key, parsed value) of every key under `prefix`, sorted by key; malformed values skipped."""
        ...


class KVStore(KVReader, Protocol):
    """A reader that also writes: `EtcdClient` and `MemoryKV`."""

    def put(self, key: str, value: bytes | str, *, lease: Optional[int] = None) -> None: ...

    def put_json(self, key: str, value: Any, *, lease: Optional[int] = None) -> None: ...

    def put_if_absent(self, key: str, value: bytes | str, *, lease: Optional[int] = None) -> bool:
        """Create `key`; False if it exists already."""
        ...

    def delete(self, key: str, *, revision: Optional[int] = None) -> bool:
        """Delete `key` (only if still at mod `revision`, when given); whether it went."""
        ...

    def revoke_lease(self, lease_id: int) -> None:
        """End a lease now: every key bound to it disappears (a lease already gone is no error)."""
        ...

    def outage_within(self, seconds: float) -> bool:
        """Whether etcd is unreachable now, or was (or stalled) within the last `seconds`."""
        ...
