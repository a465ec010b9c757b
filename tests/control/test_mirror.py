"""The watch-maintained mirror (etcd/mirror.py) against a real etcd: it follows puts and deletes,
wakes waiters on a change, resumes without missing an event after etcd restarts, lists again after
a compaction, and keeps answering (with the last state) while etcd is stalled."""

from __future__ import annotations

import threading
import time

import pytest

from oobleck_elastic.etcd import EtcdSettings, connect
from oobleck_elastic.etcd.mirror import Mirror

from helpers import eventually, stall_process


def test_the_mirror_follows_puts_and_deletes_and_wakes_waiters(etcd_settings, run_id) -> None:
    client = connect(etcd_settings)
    prefix = f"/t/{run_id}/"
    client.put_json(prefix + "a", {"v": 1})
    client.put(f"/t/{run_id}x", "outside")  # a sibling key outside the prefix
    mirror = Mirror(client, prefix).start()
    try:
        assert mirror.get_json(prefix + "a")[0] == {"v": 1}
        assert mirror.get(f"/t/{run_id}x") is None
        version = mirror.version
        threading.Timer(0.2, lambda: client.put_json(prefix + "b", {"v": 2})).start()
        t0 = time.monotonic()
        assert mirror.wait(version, 5.0) > version and time.monotonic() - t0 < 2.0
        eventually(lambda: mirror.get_json(prefix + "b")[0] == {"v": 2})
        client.delete(prefix + "a")
        eventually(lambda: mirror.get(prefix + "a") is None)
        assert [k for k, _ in mirror.get_prefix_json(prefix)] == [prefix + "b"]
        kv = mirror.get(prefix + "b")
        assert kv.mod_revision == client.get(prefix + "b").mod_revision
    finally:
        mirror.close()
        client.close()


def test_the_mirror_resumes_after_a_restart_without_missing_events(own_etcd) -> None:
    client = connect(EtcdSettings(endpoint=own_etcd.endpoint, timeout_s=1.0, outage_s=30.0))
    writer = connect(EtcdSettings(endpoint=own_etcd.endpoint, timeout_s=1.0, outage_s=30.0))
    mirror = Mirror(client, "/m/").start()
    try:
        writer.put("/m/a", "1")
        eventually(lambda: mirror.get("/m/a") is not None)
        port = own_etcd.port
        own_etcd.stop()
        time.sleep(1.0)
        own_etcd.port = port
        own_etcd.start()
        for i in range(5):  # written right after the restart, possibly before the watch is back
            writer.put(f"/m/k{i}", str(i))
        writer.delete("/m/a")
        eventually(lambda: len(mirror.range("/m/")) == 5 and mirror.get("/m/a") is None, timeout=20)
        assert mirror.resumes >= 1
        assert [kv.value for kv in mirror.range("/m/")] == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        mirror.close()
        client.close()
        writer.close()


def test_the_mirror_lists_again_after_a_compaction(own_etcd) -> None:
    client = connect(EtcdSettings(endpoint=own_etcd.endpoint, timeout_s=1.0, outage_s=30.0))
    mirror = Mirror(client, "/c/").start()
    try:
        client.put("/c/a", "1")
        eventually(lambda: mirror.get("/c/a") is not None)
        mirror.close()  # stop following, change things, compact the history away, then resume
        mirror._closed = False
        client.put("/c/b", "2")
        client.delete("/c/a")
        revision = client.get("/c/b").mod_revision
        client.compact(revision)
        mirror._resume("/c/", compacted=False)
        eventually(lambda: mirror.get("/c/b") is not None and mirror.get("/c/a") is None)
    finally:
        mirror.close()
        client.close()


def test_reads_answer_while_etcd_is_stalled(own_etcd) -> None:
    client = connect(EtcdSettings(endpoint=own_etcd.endpoint, timeout_s=1.0, outage_s=30.0))
    mirror = Mirror(client, "/s/").start()
    try:
        client.put("/s/a", "1")
        eventually(lambda: mirror.get("/s/a") is not None)
        stall = stall_process(own_etcd.pid, 3.0)
        time.sleep(0.2)
        t0 = time.monotonic()
        assert mirror.get("/s/a").value == b"1"
        assert time.monotonic() - t0 < 0.1
        stall.join()
        client.put("/s/b", "2")  # the watch stream survives the stall
        eventually(lambda: mirror.get("/s/b") is not None)
    finally:
        mirror.close()
        client.close()


@pytest.mark.parametrize("verb", ["put_if_absent", "put_if_revision"])
def test_conditional_puts(etcd_settings, run_id, verb) -> None:
    client = connect(etcd_settings)
    key = f"/t/{run_id}/cas"
    try:
        if verb == "put_if_absent":
            assert client.put_if_absent(key, "a") and not client.put_if_absent(key, "b")
        else:
            assert client.put_if_revision(key, "a", None) and not client.put_if_revision(key, "b", None)
            rev = client.get(key).mod_revision
            assert not client.put_if_revision(key, "c", rev + 1000)
            assert client.put_if_revision(key, "c", rev)
            assert not client.delete(key, revision=rev) and client.delete(key, revision=client.get(key).mod_revision)
        assert client.count(f"/t/{run_id}/") == (1 if verb == "put_if_absent" else 0)
    finally:
        client.close()


def test_exact_keys_and_prefixes_added_and_removed_while_running(etcd_settings, run_id) -> None:
    client = connect(etcd_settings)
    root = f"/t/{run_id}/"
    for key, value in (("plan", "p"), ("plans/1", "h"), ("nodes/a", "1"), ("nodes/b", "2")):
        client.put(root + key, value)
    mirror = Mirror(client, [root + "plan"]).start()  # an exact key: not plans/1
    try:
        assert mirror.get(root + "plan").value == b"p" and mirror.get(root + "plans/1") is None
        mirror.add([root + "nodes/", root + "nodes/a"])
        assert [kv.key for kv in mirror.range(root + "nodes/")] == [root + "nodes/a", root + "nodes/b"]
        mirror.remove([root + "nodes/"])  # nodes/a stays: still mirrored as an exact key
        assert [kv.key for kv in mirror.range(root + "nodes/")] == [root + "nodes/a"]
        client.put(root + "nodes/c", "3")
        client.put(root + "nodes/a", "4")
        eventually(lambda: mirror.get(root + "nodes/a").value == b"4")
        assert mirror.get(root + "nodes/c") is None
    finally:
        mirror.close()
        client.close()


def test_a_resume_that_fails_unexpectedly_is_retried(etcd_settings, run_id) -> None:
    """A watch stream ended and re-creating the watch raised something other than an outage (a
    gRPC error pyetcd did not translate): the mirror tries again instead of following that key
    no more, and sees later changes."""
    client = connect(etcd_settings)
    key = f"/{run_id}/r"
    mirror = Mirror(client, [key], name="test").start()
    real, failures = client.watch, []

    def flaky(*args, **kwargs):
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("StatusCode.UNKNOWN: injected")
        return real(*args, **kwargs)

    try:
        client.cancel_watch(mirror._watch[key])
        client.watch = flaky
        mirror._on_response(key, None)  # what pyetcd calls back with when the stream ends
        eventually(lambda: mirror.resumes == 1, timeout=10)
        client.put(key, "after")
        eventually(lambda: mirror.get(key) is not None and mirror.get(key).value == b"after")
        assert len(failures) == 2 and mirror.error is None
    finally:
        mirror.close()
        client.close()


def test_prefix_reads_match_etcd_through_puts_deletes_adds_and_removes(etcd_settings, run_id) -> None:
    """Prefix reads come from a sorted index of the mirrored keys: after any mix of puts,
    overwrites, deletes and added or removed prefixes they list what etcd lists, in key order."""
    client = connect(etcd_settings)
    root = f"/t/{run_id}/"
    for key in ["nodes/n1", "nodes/n10", "nodes/n2", "ready/n1/0", "ready/n10/0", "ready/n1/1", "x"]:
        client.put(root + key, key)
    mirror = Mirror(client, [root + "nodes/", root + "ready/"]).start()
    prefixes = ["", "nodes/", "nodes/n1", "ready/n1/", "ready/n10/", "ready/n", "ready/n2/", "z"]

    def same() -> bool:
        mirrored = {p: [(kv.key, kv.value) for kv in mirror.range(root + p)] for p in prefixes}
        expected = {
            p: [(kv.key, kv.value) for kv in client.range(root + p)[1] if not kv.key.endswith("/x")] for p in prefixes
        }
        return mirrored == expected

    try:
        assert same()
        client.put(root + "ready/n2/0", "new")
        client.put(root + "nodes/n1", "overwritten")
        client.delete(root + "ready/n1/0")
        client.delete(root + "nodes/n10")
        client.put(root + "nodes/n0", "first")
        eventually(same)
        assert [kv.key for kv in mirror.range(root + "ready/n1/")] == [root + "ready/n1/1"]
        mirror.remove([root + "ready/"])
        assert mirror.range(root + "ready/") == [] and same() is False  # no longer mirrored
        mirror.add([root + "ready/"])
        assert same()
    finally:
        mirror.close()
        client.close()
