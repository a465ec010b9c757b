"""Compiled layers (engine/stage/compiled.py): one set of graphs per kind of layer, compiled before the
worker joins; steps, rebuilt layers and a reconfiguration after a node failure compile nothing; the
weights stay those of the eager reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from oobleck_elastic.config import load_config
from oobleck_elastic.engine.stage.compiled import CompiledLayer, graphs_compiled, warm_up
from oobleck_elastic.data.dataset import build_dataset
from oobleck_elastic.engine.reference import single_process
from helpers import assert_same, run_job, tiny_profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data and inductor cache for the module: compiled kernels are reused across tests."""
    return tmp_path_factory.mktemp("compile-cache")


def _cfg(cache: Path, *extra: str):
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=32",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            f"data.cache_dir={cache}",
            *extra,
        ],
    )


def _train(cfg, steps: int) -> dict[str, torch.Tensor]:
    trainer = single_process(cfg, dataset=build_dataset(cfg, log=lambda m: None))
    try:
        compiled = any(isinstance(m, CompiledLayer) for m in trainer.stage_module.modules())
        assert compiled == cfg.training.compile
        for step in range(steps):
            trainer.train_step(step)
        return {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()}
    finally:
        trainer.close()


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
def test_warm_up_compiles_each_kind_once_and_steps_compile_nothing(shared_cache: Path) -> None:
    cfg = _cfg(shared_cache, "training.compile=true")
    before = graphs_compiled()
    warm_up(cfg, device=torch.device("cpu"), microbatch_size=2, seq_len=32, autocast=None)
    warmed = graphs_compiled()
    # embedding (forward, weight gradient), block and head (forward, input and weight gradients): 8
    # graphs, none when compiled before in this process
    assert warmed >= 8 and warmed - before in (0, 8)
    compiled = _train(cfg, 3)
    # new layer objects of known kinds (a rebuilt stage, another seed) reuse the graphs
    _train(_cfg(shared_cache, "training.compile=true", "training.seed=7"), 1)
    assert graphs_compiled() == warmed
    eager = _train(_cfg(shared_cache, "training.compile=false"), 3)
    assert set(compiled) == set(eager)
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.slow
def test_a_node_failure_recompiles_nothing_on_the_survivors(
    tmp_path: Path, etcd_server, run_id, shared_cache: Path
) -> None:
    """Four nodes, compiled layers, one SIGKILLed: every survivor entered generation 2 with as
    many compiled graphs as it had after its warm-up, and the weights are the reference's."""
    profile = tiny_profile(tmp_path / "profile.json")
    out, job, ref = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--kill", "1@3"],
        8,
        profile,
        extra=["training.compile=true", f"data.cache_dir={shared_cache}"],
        killed_by_test=0,
    )
    counts: dict[str, list[tuple[int, int]]] = {}
    for gen, node, n in re.findall(r"gen (\d+) step \d+ node (\S+) rank \d+: compiled graphs so far: (\d+)", out):
        counts.setdefault(node, []).append((int(gen), int(n)))
    survivors = [node for node, seen in counts.items() if any(g == 2 for g, _ in seen)]
    assert len(survivors) == 3, counts
    for node in survivors:
        assert len({n for _, n in counts[node]}) == 1, (node, counts[node])
    assert_same(job, ref)


def test_a_planner_chosen_microbatch_is_compiled_before_the_first_step(
    shared_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With training.microbatch_size=auto the size is known only from the first plan: the worker
    compiles every kind of layer right after entering it, before its first step."""
    from oobleck_elastic.engine.run import train

    cfg = _cfg(
        shared_cache,
        "training.compile=true",
        "training.microbatch_size=auto",
        "training.steps=2",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"logging.tensorboard_dir={tmp_path / 'runs'}",
    )
    with caplog.at_level("INFO"):
        train(cfg)
    text = caplog.text
    assert "compiled 3 kind(s) of layer" in text, text[-3000:]
    assert text.index("compiled 3 kind(s) of layer") < text.index("step 1/2"), text[-3000:]
