"""bench/shadow_designs.py, its core at tiny sizes: both designs' shadows are checked, not only timed.

- A whole run (two gloo workers, hidden 32, 3 steps of 10 ms, one repeat, modes off, a, b1, b2):
  every JSON line parses; in `a` the keeper's shadows equal the holder's layers bit for bit after
  the run, in `b<N>` they equal the holder's at the last snapshot's step (the bench raises
  otherwise, and reports `verified`); the steps-lost bound is 0 for `a` and at least N for `b<N>`;
  the summary has one line per mode with its overhead against `off`.
- A snapshot (`pack`) unpacked into a `ShadowStore` gives the store the holder's parameters and
  AdamW state exactly; one taken a step earlier does not.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from helpers import ROOT


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))  # the spawned workers import it by name too
    import shadow_designs

    return shadow_designs


def test_both_designs_keep_the_shadows_equal_to_their_holders() -> None:
    bench = _bench()
    args = argparse.Namespace(repeats=1, steps=3, warmup=1, step_s=0.01, intervals=[1, 2], hidden=32)
    printed: list[str] = []
    bench.run(args, emit=lambda line: printed.append(json.dumps(line)))
    lines = [json.loads(text) for text in printed]
    runs = {line["mode"]: line for line in lines if not line.get("summary")}
    summaries = {line["mode"]: line for line in lines if line.get("summary")}
    assert sorted(runs) == sorted(summaries) == ["a", "b1", "b2", "off"]
    assert runs["off"]["verified"] is None and runs["off"]["sent_bytes_per_step"] == 0
    for mode in ("a", "b1", "b2"):
        assert runs[mode]["verified"] is True, runs[mode]
        assert runs[mode]["sent_bytes_per_step"] > 0 and runs[mode]["host_bytes"] > 0
    assert runs["a"]["lost_bound"] == 0
    assert runs["b1"]["lost_bound"] >= 1 and runs["b2"]["lost_bound"] >= 2
    # weights and both moments against gradients (each with a flag or step per parameter)
    assert runs["b1"]["snapshot_bytes"] == runs["b2"]["snapshot_bytes"] > 2.9 * runs["a"]["sent_bytes_per_step"]
    assert summaries["off"]["overhead"] == 0
    assert all(isinstance(s["overhead"], float) for s in summaries.values())
    assert summaries["b2"]["steady_bytes_per_step"] == runs["b2"]["snapshot_bytes"] / 2


def test_a_snapshot_gives_the_store_the_holders_state_of_its_step() -> None:
    bench = _bench()
    cfg = bench.job_config(hidden=32, steps=3)
    grads = bench.real_grads(cfg)
    model = bench.build_layer_model(cfg.model, seed=cfg.training.seed, device="cpu")
    layers = bench.held_layers(1, model.num_layers)
    names = {p: name for name, p in bench._named(model)}
    params = bench.unique_params(model, layers)
    optimizer = bench.build_optimizer(params, cfg.training)
    snapshots = []
    for step in range(2):
        for p in params:
            p.grad = grads[names[p]].clone()
        bench.set_lr(optimizer, step, cfg.training)
        optimizer.step()
        flat = torch.empty(bench.packed_numel(params))
        bench.pack(params, optimizer, flat)
        snapshots.append(flat)
    store = bench.new_store(cfg, generation=0, step=-1, layers=layers, kept=None, incoming=[])
    kept = torch.empty(bench.packed_numel(store.params))
    bench.unpack(snapshots[1], store)
    bench.pack(store.params, store.optimizer, kept)
    assert torch.equal(kept, snapshots[1])
    assert not torch.equal(kept, snapshots[0])
    assert [store.optimizer.state[p]["step"].item() for p in store.params[:1]] == [2.0]
