"""Lean precision: the bf16 loss never materialises fp32 logits yet matches fp32 cross-entropy,
padded vocabulary rows get no gradient, weights are cast to bf16 once per step (not once per
microbatch), and a bf16 run stays close to the fp32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from oobleck_elastic.config import load_config
from oobleck_elastic.data.dataset import build_dataset
from oobleck_elastic.engine.step.loss import ChunkedCrossEntropy, token_sum_loss
from oobleck_elastic.engine.reference import single_process

ROOT = Path(__file__).resolve().parents[2]


def test_chunked_bf16_loss_matches_fp32_cross_entropy_over_the_real_vocabulary() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 37, 72, generator=gen)).bfloat16().requires_grad_()  # 64 real + 8 padded
    labels = torch.randint(0, 64, (2, 37), generator=gen)
    labels[0, :5] = -100
    loss = ChunkedCrossEntropy.apply(logits, labels, 64, 1 / 100, 16)  # 5 chunks of 16 tokens
    (2 * loss).backward()
    ref_logits = logits.detach().float().requires_grad_()
    ref = (
        F.cross_entropy(ref_logits[..., :64].reshape(-1, 64), labels.reshape(-1), ignore_index=-100, reduction="sum")
        / 100
    )
    (2 * ref).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)  # fp32 arithmetic on the same bf16 logits
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=1e-2, atol=1e-4)  # bf16 rounding
    assert not logits.grad[..., 64:].any() and not logits.grad[0, :5].any()


def test_the_loss_reads_only_the_real_vocabulary() -> None:
    logits = torch.randn(1, 4, 10)
    labels = torch.tensor([[1, 2, 3, 4]])
    padded = token_sum_loss(4, vocab_size=8)(logits, labels)
    logits[..., 8:] = 1e4  # padded logits cannot change it
    assert token_sum_loss(4, vocab_size=8)(logits, labels) == padded
    assert torch.allclose(padded, F.cross_entropy(logits[0, :, :8], labels[0]))


def _cfg(tmp: Path, *extra: str):
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=32",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            f"data.cache_dir={tmp}",
            *extra,
        ],
    )


def test_weights_are_cast_to_bf16_once_per_step(tmp_path: Path) -> None:
    """4 microbatches, one step: every weight matrix goes through one bf16 cast, not four."""
    cfg = _cfg(tmp_path, "training.precision=bf16")
    trainer = single_process(cfg, dataset=build_dataset(cfg, log=lambda m: None))
    try:
        shape = list(trainer.layer_model.layers[1].block.attn.c_attn.weight.shape)
        with torch.profiler.profile(record_shapes=True) as prof:
            trainer.train_step(0)
        # forward casts (autograd's backward casts of the gradients have no sequence number)
        casts = [
            e
            for e in prof.events()
            if e.name == "aten::_to_copy" and e.input_shapes and list(e.input_shapes[0]) == shape and e.sequence_nr >= 0
        ]
        blocks = cfg.model.num_layers
        assert len(casts) == blocks, f"{len(casts)} casts of {blocks} c_attn weights in one step of 4 microbatches"
    finally:
        trainer.close()


def test_a_bf16_run_stays_close_to_the_fp32_reference(tmp_path: Path) -> None:
    losses = {}
    for precision in ("fp32", "bf16"):
        cfg = _cfg(tmp_path, f"training.precision={precision}")
        trainer = single_process(cfg, dataset=build_dataset(cfg, log=lambda m: None))
        try:
            losses[precision] = [trainer.train_step(s).loss for s in range(4)]
        finally:
            trainer.close()
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2), losses
