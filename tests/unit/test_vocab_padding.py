"""A padded vocabulary (models/vocab.py): a 300-token GPT-2 trains with 320-row matrices, its
padded rows stay zero, the weights equal an unpadded run's, and checkpoints and Hugging Face
exports hold the 300 real rows only (and load back padded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from oobleck_elastic.config import load_config
from oobleck_elastic.engine import checkpointing
from oobleck_elastic.engine.reference import single_process
from oobleck_elastic.models.export import export_checkpoint
from helpers import RandomTokens

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp: Path, pad: int):
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "model.vocab_size=300",
            f"model.pad_vocab_to={pad}",
            "data.seq_len=16",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            "training.optimizer.eps=1e-6",  # see tests/worlds/test_engine.py
            f"checkpoint.dir={tmp / f'ckpt{pad}'}",
        ],
    )


def _run(cfg, steps: int):
    trainer = single_process(cfg, dataset=RandomTokens(n=64, seq_len=16, vocab=300))
    for step in range(steps):
        trainer.train_step(step)
    return trainer


def test_padded_rows_stay_zero_and_the_run_equals_an_unpadded_one(tmp_path: Path) -> None:
    padded = _run(_cfg(tmp_path, 64), 3)
    try:
        wte = padded.layer_model.layers[0].wte.weight
        assert wte.shape[0] == 320 and padded.layer_model.vocab_size == 300
        assert not wte[300:].any() and not padded.optimizer.state[wte]["exp_avg"][300:].any()
        weights = padded.checkpoint_state.layer_state()
        assert weights[0]["wte.weight"].shape[0] == 300
        assert padded.checkpoint_state.optimizer_state()[0]["wte.weight"]["exp_avg"].shape[0] == 300
        saved = checkpointing.save(padded, padded.cfg.checkpoint.dir, next_step=3)
    finally:
        padded.close()
    plain = _run(_cfg(tmp_path, 1), 3)
    try:
        assert plain.layer_model.layers[0].wte.weight.shape[0] == 300 and plain.layer_model.vocab_size is None
        reference = plain.checkpoint_state.layer_state()
    finally:
        plain.close()
    for i in reference:
        for name in reference[i]:
            torch.testing.assert_close(weights[i][name], reference[i][name], rtol=1e-5, atol=1e-6)
    # the checkpoint loads back into a padded worker, padded again
    again = single_process(_cfg(tmp_path, 64), dataset=RandomTokens(n=64, seq_len=16, vocab=300))
    try:
        assert checkpointing.restore(again, saved) == 3
        assert again.layer_model.layers[0].wte.weight.shape[0] == 320
        assert not again.layer_model.layers[0].wte.weight[300:].any()
        for i, layer in again.checkpoint_state.layer_state().items():
            for name, t in layer.items():
                assert torch.equal(t, weights[i][name]), (i, name)
    finally:
        again.close()
    out = export_checkpoint(saved, tmp_path / "hf", log=lambda m: None)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.vocab_size == 300 and model.lm_head.weight.shape[0] == 300


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_padded_vocabulary_matrices_hold_the_unpadded_draws_then_zeros(family: str) -> None:
    """The real rows are drawn as the unpadded matrix (the same shape, the same generator), not
    cut from a larger draw: equal to an unpadded build by construction, for a tied and an untied
    head."""
    from oobleck_elastic.config import ModelConfig
    from oobleck_elastic.models.build import build_layer_model

    def built(pad: int) -> dict[str, torch.Tensor]:
        cfg = ModelConfig(
            family=family,
            vocab_size=300,
            pad_vocab_to=pad,
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            intermediate_size=64,
            tie_embeddings=family == "gpt2",
        )
        model = build_layer_model(cfg, seed=7)
        return {f"{i}.{n}": p.detach() for i, layer in enumerate(model.layers) for n, p in layer.named_parameters()}

    padded, plain = built(64), built(1)
    assert set(padded) == set(plain)
    vocab = [name for name in plain if padded[name].shape != plain[name].shape]
    assert len(vocab) == 2, vocab  # the embedding and the head (tied or not)
    for name in plain:
        assert torch.equal(padded[name][: plain[name].shape[0]], plain[name]), name
    for name in vocab:
        assert padded[name].shape[0] == 320 and not padded[name][300:].any(), name
