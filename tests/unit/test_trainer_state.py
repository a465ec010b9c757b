"""`Trainer.checkpoint_state`'s `state_dict` / `load_state_dict` (torch's Stateful): a trainer loaded from another's
state continues exactly like it, and a bad state is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oobleck_elastic.config import load_config
from oobleck_elastic.engine.reference import single_process
from helpers import RandomTokens

ROOT = Path(__file__).resolve().parents[2]


def _cfg():
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        ["data.seq_len=8", "training.global_batch_size=8", "training.microbatch_size=2", "training.steps=4"],
    )


def test_a_loaded_trainer_continues_exactly_like_the_original() -> None:
    a = single_process(_cfg(), dataset=RandomTokens(n=32, seq_len=8))
    for step in range(2):
        a.train_step(step)
    state = a.checkpoint_state.state_dict()
    assert state["next_step"] == 2 and set(state["layers"]) == set(range(6))
    assert all(t.device.type == "cpu" for layer in state["layers"].values() for t in layer.values())
    a.train_step(2)
    a_layers, a_optimizer = a.checkpoint_state.layer_state(), a.checkpoint_state.optimizer_state()
    a.close()  # one default process group per process: the reference is a world of one
    b = single_process(_cfg(), dataset=RandomTokens(n=32, seq_len=8))
    b.checkpoint_state.load_state_dict(state)
    assert b.committed_step == 1
    b.train_step(2)
    for i, layer in a_layers.items():
        for name, t in layer.items():
            torch.testing.assert_close(b.checkpoint_state.layer_state()[i][name], t, rtol=0, atol=0, msg=f"{i}:{name}")
    for i, layer in a_optimizer.items():
        for name, moments in layer.items():
            for k, v in moments.items():
                torch.testing.assert_close(b.checkpoint_state.optimizer_state()[i][name][k], v, rtol=0, atol=0)
    b.close()


def test_a_state_without_an_owned_layer_or_parameter_is_refused() -> None:
    a = single_process(_cfg(), dataset=RandomTokens(n=32, seq_len=8))
    state = a.checkpoint_state.state_dict()
    del state["layers"][3]
    with pytest.raises(KeyError, match="the state has no layer 3"):
        a.checkpoint_state.load_state_dict(state)
    state = a.checkpoint_state.state_dict()
    name = next(iter(state["layers"][2]))
    del state["layers"][2][name]
    with pytest.raises(KeyError, match=f"the state's layer 2 has no parameter '{name}'"):
        a.checkpoint_state.load_state_dict(state)
    a.close()
