"""A fork while etcd clients are open (etcd/forking.py): the child refuses etcd in one line, from a
client it inherited, from a new `connect()` and from a new rendezvous handler, instead of crashing
or failing at random inside gRPC; the parent goes on; a child forked with no client open, and a
spawned one, use etcd as usual. Each scenario runs in a fresh interpreter (pytest's own threads
stay out of the fork)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from oobleck_elastic.etcd.forking import FORKED

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, sys, threading
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.etcd.mirror import Mirror

    def use_etcd(how, q, endpoint, prefix):
        try:
            if how == "inherited":
                parent.get(prefix + "parent")
            elif how == "handler":
                from torch.distributed.elastic.rendezvous import RendezvousParameters
                from oobleck_elastic.rendezvous.entry import create_handler
                params = RendezvousParameters(backend="oobleck", endpoint=endpoint, run_id="fork-handler",
                    min_nodes=1, max_nodes=1, config="configs/gpt2-tiny.yaml", lease_ttl="2")
                create_handler(params).shutdown()
            else:
                c = connect(EtcdSettings(endpoint=endpoint))
                c.put(prefix + "child-" + str(os.getpid()), "v")
                assert c.get(prefix + "child-" + str(os.getpid())).value == b"v"
                c.close()
            q.put(["ok", ""])
        except Exception as err:
            q.put([type(err).__name__, str(err)])

    def main(endpoint, prefix, scenario):
        global parent
        parent = connect(EtcdSettings(endpoint=endpoint))
        mirror = Mirror(parent, prefix).start()
        stop = threading.Event()
        def busy():  # a thread inside gRPC while the process forks, as an agent's always are
            while not stop.is_set():
                parent.put(prefix + "parent", "p")
                parent.get(prefix + "parent")
        busy_thread = threading.Thread(target=busy, daemon=True)
        busy_thread.start()
        if scenario == "closed-first":
            stop.set(); busy_thread.join(); mirror.close(); parent.close()
        ctx = mp.get_context("spawn" if scenario == "spawn" else "fork")
        hows = {"fork": ["new", "inherited", "handler"], "closed-first": ["new"], "spawn": ["new"]}[scenario]
        results, q = {}, ctx.Queue()
        for how in hows:
            child = ctx.Process(target=use_etcd, args=(how, q, endpoint, prefix))
            child.start()
            try:
                results[how] = q.get(timeout=120)
            finally:
                child.join(30)
                if child.is_alive():
                    child.kill()
                    child.join()
        if not parent.closed:
            parent.put(prefix + "after", "still here")
            results["parent"] = parent.get(prefix + "after").value.decode()
            stop.set(); busy_thread.join(); mirror.close(); parent.close()
        results["pid"] = os.getpid()
        print(json.dumps(results), flush=True)

    parent = None
    if __name__ == "__main__":
        main(*sys.argv[1:4])
    """
)


def _run(tmp_path: Path, etcd_server, run_id: str, scenario: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    script = tmp_path / "forks.py"
    script.write_text(SCRIPT)
    res = subprocess.run(
        [sys.executable, str(script), etcd_server.endpoint, f"/fork/{run_id}/", scenario],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_child_forked_while_clients_are_open_refuses_etcd_in_one_line(tmp_path: Path, etcd_server, run_id) -> None:
    got = _run(tmp_path, etcd_server, run_id, "fork")
    line = FORKED.format(pid=got["pid"])
    assert got["new"] == ["EtcdError", line]
    assert got["inherited"] == ["EtcdError", line]
    assert got["handler"] == ["EtcdError", line]
    assert got["parent"] == "still here"  # the parent's client, its mirror and its busy thread go on


def test_a_child_forked_after_every_client_closed_uses_etcd(tmp_path: Path, etcd_server, run_id) -> None:
    assert _run(tmp_path, etcd_server, run_id, "closed-first")["new"] == ["ok", ""]


def test_a_spawned_child_uses_etcd_while_the_parent_holds_clients(tmp_path: Path, etcd_server, run_id) -> None:
    got = _run(tmp_path, etcd_server, run_id, "spawn")
    assert got["new"] == ["ok", ""] and got["parent"] == "still here"
