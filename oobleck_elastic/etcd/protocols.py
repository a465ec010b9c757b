"""What the control plane needs of etcd, named as Protocols.

A reader of control data takes a `KVReader`, whether its keys come from etcd itself or from a
watch-maintained `Mirror`; `KVStore` adds the few writes the failure detectors make. `MemoryKV`
implements both on a dict for unit tests. The story: docs/design.md.
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
