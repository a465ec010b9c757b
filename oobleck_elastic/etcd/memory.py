"""`MemoryKV`: a dict that answers like etcd, for unit tests of the control plane.

It implements `KVStore` (`etcd.protocols`): keys with mod and create revisions that grow by one per
write, leases whose revocation deletes the keys bound to them, put-if-absent and
delete-at-revision, and JSON reads that skip malformed values like `EtcdClient`'s. Nothing
expires by itself and nothing runs in the background: a test sets up a state, calls the code
under test, and reads what it wrote. `outage` stands for "etcd was away a moment ago"
(`outage_within` returns it, whatever the window). The story: docs/design.md.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional

from .client import KV, parse_json


class MemoryKV:
    """Keys in a dict, with revisions and leases (see the module docstring)."""

    def __init__(self, values: Optional[dict[str, Any]] = None) -> None:
        self.data: dict[str, KV] = {}
        self.revision = 0
        """The revision of the last write."""
        self.outage = False
        """What `outage_within` answers."""
        self._next_lease = 0
        for key, value in (values or {}).items():
            self.put_json(key, value)

    # ------------------------------------------------------------------ KVReader
    def get(self, key: str) -> Optional[KV]:
        return self.data.get(key)

    def get_json(self, key: str) -> tuple[Optional[Any], Optional[int]]:
        kv = self.data.get(key)
        if kv is None:
            return None, None
        return parse_json(kv.value, key, kv.mod_revision), kv.mod_revision

    def get_prefix_json(self, prefix: str) -> Iterator[tuple[str, Any]]:
        for key in sorted(k for k in self.data if k.startswith(prefix)):
            kv = self.data[key]
            parsed = parse_json(kv.value, key, kv.mod_revision)
            if parsed is not None:
                yield key, parsed

    # ------------------------------------------------------------------ writes
    def put(self, key: str, value: bytes | str, *, lease: Optional[int] = None) -> None:
        self.revision += 1
        old = self.data.get(key)
        self.data[key] = KV(
            key=key,
            value=value.encode() if isinstance(value, str) else bytes(value),
            mod_revision=self.revision,
            create_revision=old.create_revision if old else self.revision,
            lease=lease or 0,
        )

    def put_json(self, key: str, value: Any, *, lease: Optional[int] = None) -> None:
        self.put(key, json.dumps(value, sort_keys=True), lease=lease)

    def put_if_absent(self, key: str, value: bytes | str, *, lease: Optional[int] = None) -> bool:
        if key in self.data:
            return False
        self.put(key, value, lease=lease)
        return True

    def delete(self, key: str, *, revision: Optional[int] = None) -> bool:
        kv = self.data.get(key)
        if kv is None or (revision is not None and kv.mod_revision != revision):
            return False
        del self.data[key]
        self.revision += 1
        return True

    def grant_lease(self, ttl_s: float) -> int:
        """A new lease id (it never expires by itself: revoke it)."""
        self._next_lease += 1
        return self._next_lease

    def revoke_lease(self, lease_id: int) -> None:
        for key in [k for k, kv in self.data.items() if kv.lease == lease_id]:
            self.delete(key)

    def outage_within(self, seconds: float) -> bool:
        return self.outage
