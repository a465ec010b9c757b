"""Shared test helpers: a synthetic profile that forces multi-stage pipelines, and a watcher that
acts on a running job's etcd state."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from oobleck_elastic.etcd import EtcdClient, EtcdSettings, connect
from oobleck_elastic.planning import LayerProfile, ModelProfile


def tiny_profile(path: Path) -> Path:
    """6 layers of 0.4 GiB (params+grads+AdamW) planned on 1.25 GiB devices: n0 = 2 nodes, so
    gpt2-tiny runs as 2-stage pipelines (3 nodes: one 3-stage pipeline; 4 nodes: 2 x 2 stages)."""
    b = int(0.1 * 1024 ** 3)
    ModelProfile(layers=[LayerProfile(name=f"l{i}", forward_s=0.01, backward_s=0.02, param_bytes=b, grad_bytes=b,
                                      optimizer_bytes=2 * b, activation_bytes=0) for i in range(6)]).save(path)
    return path


TINY_PROFILE_OVERRIDES = ["planning.device_memory_gb=1.25", "planning.memory_margin=0"]


def when(endpoint: str, proc, condition: Callable[[EtcdClient], bool], action: Callable[[EtcdClient], None],
         *, timeout: float = 300.0) -> None:
    """Poll etcd while `proc` runs; once `condition(client)` holds, run `action(client)` once."""
    client = connect(EtcdSettings(endpoint=endpoint))
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if condition(client):
                action(client)
                return
            time.sleep(0.05)
    finally:
        client.close()
