"""`--rdzv-conf mode=restart`: torchrun's own semantics for scripts that do not use the worker context.

torch's `DynamicRendezvousHandler` with etcd v3 under it; nothing read from etcd is unpickled
(the state is stored as JSON). The story: docs/running.md.
"""

from __future__ import annotations

import json
import os
import pickle
from datetime import datetime, timedelta
from typing import Any, Optional

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
    _NodeDesc,
    _RendezvousState,
)

from ..etcd import EtcdClient, EtcdError
from ..etcd.store import EtcdStore
from ..records.keys import Keys

SCHEMA_VERSION = 1


def _node(desc: _NodeDesc) -> str:
    return json.dumps([desc.addr, desc.pid, desc.local_id])


def _desc(text: str, key: str) -> _NodeDesc:
    value = json.loads(text)
    if not (
        isinstance(value, list)
        and len(value) == 3
        and isinstance(value[0], str)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value[1:])
    ):
        raise RendezvousStateError(f"malformed node {text[:80]!r} in the rendezvous state at {key}")
    return _NodeDesc(value[0], value[1], value[2])


def state_to_json(state: _RendezvousState) -> dict[str, Any]:
    """torch's rendezvous state as JSON (node descriptors as "[addr, pid, local_id]" strings)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "round": state.round,
        "complete": state.complete,
        "deadline": state.deadline.isoformat() if state.deadline is not None else None,
        "closed": state.closed,
        "participants": {_node(n): rank for n, rank in state.participants.items()},
        "wait_list": sorted(_node(n) for n in state.wait_list),
        "redundancy_list": sorted(_node(n) for n in state.redundancy_list),
        "last_heartbeats": {_node(n): at.isoformat() for n, at in state.last_heartbeats.items()},
    }


def state_from_json(data: Any, key: str) -> _RendezvousState:
    """Validate `data` (from `state_to_json`) and rebuild torch's state; RendezvousStateError if malformed."""
    try:
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"not a rendezvous state of schema_version {SCHEMA_VERSION}")
        state = _RendezvousState()
        state.round = data["round"]
        state.complete = data["complete"]
        state.closed = data["closed"]
        if (
            not isinstance(state.round, int)
            or not isinstance(state.complete, bool)
            or not isinstance(state.closed, bool)
        ):
            raise ValueError("round must be an integer, complete and closed booleans")
        deadline = data["deadline"]
        state.deadline = datetime.fromisoformat(deadline) if deadline is not None else None
        state.participants = {_desc(n, key): _int(r) for n, r in dict(data["participants"]).items()}
        state.wait_list = {_desc(n, key) for n in list(data["wait_list"])}
        state.redundancy_list = {_desc(n, key) for n in list(data["redundancy_list"])}
        state.last_heartbeats = {
            _desc(n, key): datetime.fromisoformat(at) for n, at in dict(data["last_heartbeats"]).items()
        }
    except RendezvousStateError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise RendezvousStateError(f"malformed rendezvous state at {key}: {err}") from None
    return state


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"rank {value!r} is not an integer")
    return value


class EtcdRendezvousBackend(RendezvousBackend):
    """torch's `RendezvousBackend` on etcd v3: one JSON key, compare-and-swap on its mod revision."""

    def __init__(self, client: EtcdClient, key: str) -> None:
        self.client, self.key = client, key

    @property
    def name(self) -> str:
        return "oobleck"

    def get_state(self) -> Optional[tuple[bytes, Token]]:
        try:
            kv = self.client.get(self.key)
        except EtcdError as err:
            raise RendezvousConnectionError(f"the connection to etcd failed: {err}") from err
        return self._decode(kv.value, kv.mod_revision) if kv is not None else None

    def set_state(self, state: bytes, token: Optional[Token] = None) -> Optional[tuple[bytes, Token, bool]]:
        mine = pickle.loads(state)  # made by torch's handler in this process, not read from etcd
        if not isinstance(mine, _RendezvousState):
            raise RendezvousStateError(f"cannot store a {type(mine).__name__} as the rendezvous state")
        try:
            revision = int(token) if token is not None else None
        except (TypeError, ValueError):
            return None  # torch's contract: a token that is not ours cannot match
        try:
            ok, kv = self.client.swap(self.key, json.dumps(state_to_json(mine), sort_keys=True), revision)
        except EtcdError as err:
            raise RendezvousConnectionError(f"the connection to etcd failed: {err}") from err
        if kv is None:
            return None  # deleted meanwhile: torch reads again
        value, new_token = self._decode(kv.value, kv.mod_revision)
        return value, new_token, ok

    def _decode(self, value: bytes, revision: int) -> tuple[bytes, Token]:
        try:
            data = json.loads(value)
        except ValueError:
            raise RendezvousStateError(f"the rendezvous state at {self.key} is not JSON: {value[:80]!r}") from None
        return pickle.dumps(state_from_json(data, self.key)), revision


_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class RestartRendezvousHandler(DynamicRendezvousHandler):
    """torch's handler without its shared TCPStore: each round's rank 0 publishes MASTER_ADDR and
    a free MASTER_PORT in the etcd store, and the workers' global rank 0 hosts their own store.

    torch 2.13's shared-store path publishes the address only in the first round a node is rank 0
    of: a node that joins a later round, while rank 0 stays the same, waits for that round's
    MASTER_ADDR until the join timeout (found by tests/jobs/test_torchrun_dropin.py). Its opt-out is the
    process-wide `TORCH_DISABLE_SHARE_RDZV_TCP_STORE`; it is set only while `next_rendezvous()`
    runs (on the agent's thread) and restored after, so no other code of the process sees it."""

    client: Optional[EtcdClient] = None
    """The etcd client under the store and the backend: closed by `shutdown()` (`etcd.closing`)."""

    @property
    def use_agent_store(self) -> bool:
        return False

    def shutdown(self) -> bool:
        """torch's shutdown (closes the rendezvous, never raises), then the etcd client is closed:
        its gRPC calls must not be left to the garbage collector at exit (`etcd.closing`)."""
        try:
            return super().shutdown()
        finally:
            if self.client is not None:
                self.client.close()

    def next_rendezvous(self) -> RendezvousInfo:
        previous = os.environ.get(_NO_SHARED_STORE)
        os.environ[_NO_SHARED_STORE] = "1"
        try:
            return super().next_rendezvous()
        finally:
            if previous is None:
                os.environ.pop(_NO_SHARED_STORE, None)
            else:
                os.environ[_NO_SHARED_STORE] = previous


def _seconds(params: RendezvousParameters, option: str) -> Optional[timedelta]:
    value = params.get(option)
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"--rdzv-conf {option}={value}: give a number of seconds > 0")
    return timedelta(seconds=seconds)


def restart_handler(params: RendezvousParameters, client: EtcdClient, keys: Keys) -> RestartRendezvousHandler:
    """torch's dynamic rendezvous on etcd (docs/running.md). `params` as torchrun gives them; torch's
    options join_timeout (600), last_call_timeout (30), close_timeout (30), heartbeat_timeout,
    keep_alive_interval (5) and keep_alive_max_attempt (3) keep torch's defaults (seconds may be
    fractions here)."""
    timeout = RendezvousTimeout(
        *(_seconds(params, f"{name}_timeout") for name in ("join", "last_call", "close", "heartbeat"))
    )
    store = EtcdStore(client, prefix=keys.torchrun_store, timeout=timeout.join)
    backend = EtcdRendezvousBackend(client, keys.torchrun_state)
    handler = RestartRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=int(params.get_as_int("keep_alive_interval", 5) or 5),
        keep_alive_max_attempt=int(params.get_as_int("keep_alive_max_attempt", 3) or 3),
    )
    handler.client = client
    return handler


__all__ = ["EtcdRendezvousBackend", "RestartRendezvousHandler", "restart_handler", "state_from_json", "state_to_json"]
